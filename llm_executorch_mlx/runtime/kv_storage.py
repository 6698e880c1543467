"""How the off-graph cache stores keys or values: a float dtype, or MLX's
affine group quantization (``int8``, ``int4``) with fp16 scales and biases.

A ``Pool`` is one layer's keys (or values) across its slots: one array for a
float storage, three (``QuantizedKV``'s fields) for a quantized one, each
indexed by slot on axis 2, so growing, writing and slicing are the same
operations on every field. Keys and values choose their storage separately
(``-o kv_storage_dtype``, ``-o kv_value_dtype``).

Groups run along the head dimension, 64 values where it divides (one scale
and bias per head and token at head size 64), else 32: with fp16 scales and
biases an int8 history takes 34/64 of fp16's bytes and an int4 one 18/64.
fp16 (not bf16) keeps the scales' rounding an eighth of a quantization step;
values past fp16's range are as unrepresentable as in an fp16 cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .dtypes import KV_DTYPES
from .errors import PteError
from .quantized_kv import QuantizedKV

GROUP_SIZES = (64, 32)  # the first that divides the head size
SCALE_DTYPE = mx.float16
QUANTIZED_BITS = {"int8": 8, "int4": 4}


@dataclass(frozen=True)
class Storage:
    """One way to store a history: ``bits`` None is the float ``dtype``."""

    name: str
    dtype: mx.Dtype  # the values', or the scales' and biases'
    bits: int | None = None

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def rotated(self) -> bool:
        """Whether its groups are stored rotated (``quantized_kv.rotate``):
        every quantized storage's are."""
        return self.quantized

    def group_size(self, head_dim: int) -> int:
        for g in GROUP_SIZES:
            if head_dim % g == 0:
                return g
        raise PteError(
            f"a KV cache in {self.name} quantizes groups of {' or '.join(map(str, GROUP_SIZES))} values along "
            f"each head, and this model's head size is {head_dim}: store keys and values in bf16, fp16 or fp32"
        )

    def widths(self, head_dim: int) -> list[tuple[int, mx.Dtype]]:
        """Each field's last axis and dtype for one token of one head."""
        if not self.quantized:
            return [(head_dim, self.dtype)]
        groups = head_dim // self.group_size(head_dim)
        return [(head_dim * self.bits // 32, mx.uint32), (groups, self.dtype), (groups, self.dtype)]

    def bytes_per_value(self, head_dim: int) -> float:
        return sum(w * dt.size for w, dt in self.widths(head_dim)) / head_dim

    def encode(self, x: mx.array) -> list[mx.array]:
        """The fields that store the float history ``x``."""
        if not self.quantized:
            return [x.astype(self.dtype)]
        quantized = QuantizedKV.quantize(x, self.bits, self.group_size(x.shape[-1]), self.dtype, rotated=self.rotated)
        return list(quantized.fields)

    def view(self, fields: list[mx.array], head_dim: int):
        """What attention reads: the array itself, or a ``QuantizedKV``."""
        if not self.quantized:
            return fields[0]
        return QuantizedKV(*fields, self.bits, self.group_size(head_dim), rotated=self.rotated)


STORAGES: dict[str, Storage] = {
    **{name: Storage(name, dtype) for name, dtype in KV_DTYPES.items()},
    **{name: Storage(name, SCALE_DTYPE, bits) for name, bits in QUANTIZED_BITS.items()},
}


def storage(name: str) -> Storage:
    try:
        return STORAGES[name]
    except KeyError:
        raise PteError(f"unknown KV storage dtype {name!r}: use one of {', '.join(STORAGES)}") from None


def fields_of(history) -> list[mx.array]:
    """The arrays of a history as ``Pool.read`` returns it (or already a list)."""
    if isinstance(history, QuantizedKV):
        return list(history.fields)
    return list(history) if isinstance(history, (list, tuple)) else [history]


class Pool:
    """One layer's keys or values in ``slots`` cells of a storage."""

    def __init__(self, storage: Storage, n_kv_heads: int, slots: int, head_dim: int):
        self.storage, self.head_dim = storage, head_dim
        self.arrays = [mx.zeros((1, n_kv_heads, slots, w), dtype=dt) for w, dt in storage.widths(head_dim)]

    @property
    def slots(self) -> int:
        return self.arrays[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def grow(self, slots: int) -> None:
        """Extend to ``slots`` cells with zeros after the ones held."""
        self.arrays = [mx.concatenate([a, mx.zeros(a.shape[:2] + (slots - a.shape[2], a.shape[3]), dtype=a.dtype)],
                                      axis=2) for a in self.arrays]

    def write(self, start: int, x: mx.array) -> None:
        """Store the float ``[1, H, n, D]`` history ``x`` in cells ``start`` on."""
        self.put(start, self.storage.encode(x))

    def put(self, start: int, fields: list[mx.array]) -> None:
        """Store already encoded fields (a saved state's) in cells ``start`` on."""
        n = fields[0].shape[2]
        for a, f in zip(self.arrays, fields):
            a[:, :, start : start + n, :] = f

    def put_runs(self, runs: list[tuple[int, int]], fields: list[mx.array]) -> None:
        """Store the fields' cells, in order, into runs of cells ``(start, n)``
        (a ring's, which may wrap), from the fields' first cell on."""
        offset = 0
        for start, n in runs:
            self.put(start, [f[:, :, offset : offset + n, :] for f in fields])
            offset += n

    def read(self, start: int, n: int):
        """Cells ``[start, start + n)`` as attention reads them (lazy slices)."""
        return self.storage.view([a[:, :, start : start + n, :] for a in self.arrays], self.head_dim)

    def read_runs(self, runs: list[tuple[int, int]], join=None):
        """Several runs of cells joined in order; ``join(parts)`` may join
        each field's parts another way than concatenating them."""
        join = join or (lambda parts: mx.concatenate(parts, axis=2))
        fields = [join([a[:, :, s : s + n, :] for s, n in runs]) for a in self.arrays]
        return self.storage.view(fields, self.head_dim)

    def fits(self, fields: list[mx.array], n_kv_heads: int) -> bool:
        """Whether saved fields have this pool's fields' heads, widths and dtypes."""
        return len(fields) == len(self.arrays) and all(
            f.ndim == 4 and f.shape[:2] == (1, n_kv_heads) and f.shape[3] == a.shape[3] and f.dtype == a.dtype
            and f.shape[2] == fields[0].shape[2]
            for f, a in zip(fields, self.arrays))
