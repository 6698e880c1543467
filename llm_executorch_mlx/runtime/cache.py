"""The off-graph KV cache behind ``UpdateAndAttendNode``.

One logical length for the whole model; per layer a K and a V pool of
``slots`` cells (``kv_storage.Pool``: a float dtype, or quantized). A flat layer keeps all history
and grows its pool by doubling up to the capacity; a ring layer keeps a sliding
window in ``window + max_write - 1`` slots allocated up front, so a step of up
to ``max_write`` tokens never overwrites a cell an earlier query of the same
step still reads. The graph never sees the cache: the op hands it k/v and a
position, and gets back the history to attend plus the mask to apply.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .errors import CacheFullError, PteError
from .kv_storage import Pool, fields_of, storage

DEFAULT_INITIAL_CAPACITY = 512

# MLX's CUDA backend sends a one-query attention to cuDNN's decode kernel when
# the keys fill a buffer whose rows (as their strides tell) are a multiple of
# 256: a slice of such a pool, or such an array. On an H200 that kernel is not
# deterministic (identical greedy generations part after 7-116 tokens;
# mlx-lm's too) and no faster than MLX's own vector kernel, so such a pool
# gets one spare slot (and a wrapped ring read a spare row, ``_joined``) and
# decoding stays on MLX's kernel. Prefill chunks (several queries) still use
# cuDNN. docs/design.md has the measurements.
_CUDNN_DECODE_POOL_MULTIPLE = 256


def _allocated_slots(slots: int) -> int:
    """Slots to allocate for a pool of ``slots`` usable cells (see above)."""
    return slots + 1 if slots and slots % _CUDNN_DECODE_POOL_MULTIPLE == 0 else slots


@dataclass(frozen=True)
class LayerGeometry:
    """What the export fixes about one layer's cache, plus its window policy."""

    n_kv_heads: int
    head_dim: int
    window: int = 0  # 0 = flat (all history); > 0 = ring of that window

    @property
    def is_ring(self) -> bool:
        return self.window > 0


def parse_windows(spec: str | int | list[int] | tuple[int, ...]) -> list[int]:
    """Read a window pattern: ``"512"``, ``"512,0"``, ``0`` or a list of ints.

    Each entry is a window (0 = flat); the pattern repeats over the layers.
    """
    if isinstance(spec, int):
        fields = [spec]
    elif isinstance(spec, str):
        try:
            fields = [int(f) for f in spec.split(",")]
        except ValueError:
            fields = []
    else:
        fields = list(spec)
    if not fields or any(not isinstance(w, int) or w < 0 for w in fields):
        raise PteError(
            f"invalid window pattern {spec!r}: expected comma-separated "
            "non-negative integers such as '512' or '512,0' (0 = flat layer)"
        )
    return fields


class SequenceCache:
    """Single-sequence KV cache with flat and ring layers.

    Args:
        layers: one ``LayerGeometry`` per cache layer (``layer_id`` order).
        capacity: the most tokens the sequence may hold.
        dtype: the keys' storage: ``"bf16"``, ``"fp16"``, ``"fp32"``, ``"int8"``
            or ``"int4"`` (``kv_storage.STORAGES``).
        value_dtype: the values' storage (default: ``dtype``).
        initial_capacity: slots a flat pool starts with (clamped to capacity;
            0 allocates nothing until the first write).
        max_write: the most tokens one step writes (the prefill chunk); ring
            pools are sized from it. ``None`` uses each ring's own window.
    """

    def __init__(
        self,
        layers: list[LayerGeometry],
        capacity: int,
        dtype: str = "bf16",
        value_dtype: str | None = None,
        initial_capacity: int | None = None,
        max_write: int | None = None,
        held: range | None = None,
    ):
        if not layers:
            raise PteError("a cache needs at least one layer")
        if not isinstance(capacity, int) or capacity <= 0:
            raise PteError(f"cache capacity must be a positive integer, got {capacity!r}")
        self.storage = storage(dtype), storage(value_dtype or dtype)
        if initial_capacity is None:
            initial_capacity = DEFAULT_INITIAL_CAPACITY
        if initial_capacity < 0:
            raise PteError(f"initial capacity must be >= 0, got {initial_capacity}")
        if max_write is not None and max_write <= 0:
            raise PteError(f"max_write must be positive, got {max_write}")
        for g in layers:
            if g.n_kv_heads <= 0 or g.head_dim <= 0 or g.window < 0:
                raise PteError(f"invalid cache layer geometry {g}")
            for s in self.storage:
                s.widths(g.head_dim)  # a quantized storage refuses a head size its groups do not divide

        self.layers = list(layers)
        self.capacity = capacity
        self.dtype, self.value_dtype = self.storage[0].name, self.storage[1].name
        self.initial_capacity = initial_capacity
        self.max_write = max_write
        # The layers whose pools this process holds (a pipeline stage's); the
        # others count in every length, floor and step limit, with no pool.
        self.held = range(len(self.layers)) if held is None else held
        self.length = 0
        # Ring layers are sized to their window plus one step, never past the
        # capacity (a ring that big can never wrap).
        self._max_slots = [
            min(self._ring_size(g), capacity) if g.is_ring else capacity
            for g in self.layers
        ]
        # The most tokens one step may write: the narrowest ring's limit.
        self._max_step = min(
            (self.max_write if self.max_write is not None else g.window for g in self.layers if g.is_ring),
            default=None,
        )
        self._masks: dict[tuple[int, int, int], mx.array] = {}
        self._floor = 0  # raised when an aborted step overwrote ring cells
        self._checkpoint = self._written_end = 0
        self._allocate()

    def _ring_size(self, g: LayerGeometry) -> int:
        step = self.max_write if self.max_write is not None else g.window
        return g.window + step - 1

    def _allocate(self) -> None:
        self._k: list[Pool] = []
        self._v: list[Pool] = []
        keys, values = self.storage
        for i, (g, max_slots) in enumerate(zip(self.layers, self._max_slots)):
            slots = _allocated_slots(max_slots if g.is_ring else min(self.initial_capacity, max_slots))
            slots = slots if i in self.held else 0
            self._k.append(Pool(keys, g.n_kv_heads, slots, g.head_dim))
            self._v.append(Pool(values, g.n_kv_heads, slots, g.head_dim))

    # -- control face -------------------------------------------------------

    def can_extend(self, n: int = 1) -> bool:
        """Whether ``n`` more tokens fit."""
        return self.length + n <= self.capacity

    def rewind(self, new_length: int) -> bool:
        """Truncate the sequence to ``new_length`` tokens.

        Returns False, changing nothing, when that would grow the sequence or
        when a ring layer has already overwritten a cell the next step at
        ``new_length`` would attend to.
        """
        if new_length < 0 or new_length > self.length:
            return False
        if new_length < self.rewind_floor():
            return False
        self.length = new_length
        return True

    def rewind_floor(self) -> int:
        """The shortest length ``rewind`` accepts now."""
        return max(self._floor, self._ring_floor(self.length))

    def _ring_floor(self, length: int) -> int:
        floor = 0
        for g, slots in zip(self.layers, self._max_slots):
            # A ring of `slots` cells holds positions [length - slots, length).
            # A query at p reads back to p - window + 1, so p must satisfy
            # p - window + 1 >= length - slots.
            if g.is_ring and length > slots:
                floor = max(floor, length - slots + g.window - 1)
        return floor

    def clear(self) -> None:
        """Forget the sequence; pools keep their grown size."""
        self.length = self._floor = 0

    def begin_step(self) -> None:
        """Mark the start of a forward call (see ``abort_step``)."""
        self._checkpoint = self._written_end = self.length

    def abort_step(self) -> None:
        """Undo a forward call that failed part-way: some layers wrote, others
        did not, so the length goes back to where the call began. Cells a ring
        layer overwrote stay lost, so the rewind floor keeps them out."""
        self._floor = max(self._floor, self._ring_floor(self._written_end))
        self.length = min(self.length, self._checkpoint)

    @property
    def quantized(self) -> bool:
        """Whether keys or values are stored quantized."""
        return any(s.quantized for s in self.storage)

    @property
    def state(self) -> list[mx.array]:
        """The pool arrays, to ``mx.eval`` after a step whose output is unused."""
        return [a for pool in self._k + self._v for a in pool.arrays]

    @property
    def nbytes(self) -> int:
        """Bytes the pools hold now (allocated slots, not live tokens)."""
        return sum(pool.nbytes for pool in self._k + self._v)

    def bytes_in_use(self) -> int:
        """Bytes of the live tokens: each layer holds at most its slots."""
        return sum(self._layer_bytes(g) * min(self.length, slots) for g, slots in zip(self.layers, self._max_slots))

    def bytes_per_token(self) -> int:
        """K+V bytes one token adds across all layers at the storage dtypes."""
        return sum(self._layer_bytes(g) for g in self.layers)

    def _layer_bytes(self, g: LayerGeometry) -> int:
        return round(sum(g.n_kv_heads * g.head_dim * s.bytes_per_value(g.head_dim) for s in self.storage))

    # -- saved state ------------------------------------------------------------

    def snapshot(self) -> tuple[int, list[tuple[int, mx.array, mx.array]]]:
        """The cells a saved state needs: ``(floor, layers)``.

        ``floor`` is ``rewind_floor()``; per layer ``(first, K, V)`` holds
        positions ``[first, length)`` in logical order, as attention reads them
        (an array, or a ``QuantizedKV``). A flat layer keeps the whole sequence
        (``first`` 0); a ring layer only what a step at any length from the
        floor on still reads (``first = floor - window + 1``). The arrays are
        lazy slices of the pools.
        """
        floor = self.rewind_floor()
        layers = []
        for i, (g, size) in enumerate(zip(self.layers, self._max_slots)):
            if not g.is_ring:
                layers.append((0, self._k[i].read(0, self.length), self._v[i].read(0, self.length)))
                continue
            first = max(0, floor - g.window + 1)
            runs = _ring_runs(first, self.length - first, size) if self.length > first else [(0, 0)]
            layers.append((first, self._k[i].read_runs(runs), self._v[i].read_runs(runs)))
        return floor, layers

    def restore(self, length: int, floor: int, layers: list[tuple[int, mx.array, mx.array]]) -> None:
        """Hold ``length`` tokens from saved cells (``snapshot``'s ``layers``,
        or each history as its list of fields, covering at least ``[first,
        length)`` per layer), forgetting the sequence held before. ``length`` must be at least the saved ``floor``,
        which stays the rewind floor.
        """
        if len(layers) != len(self.layers):
            raise PteError(f"a saved state of {len(layers)} layers for a cache of {len(self.layers)}")
        if not floor <= length <= self.capacity:
            raise PteError(f"cannot restore {length} tokens (floor {floor}, capacity {self.capacity})")
        self.clear()
        for i, (g, (first, K, V)) in enumerate(zip(self.layers, layers)):
            n = length - first
            if n <= 0:
                continue
            K, V = fields_of(K), fields_of(V)
            if (not self._k[i].fits(K, g.n_kv_heads) or not self._v[i].fits(V, g.n_kv_heads)
                    or K[0].shape[2] != V[0].shape[2] or K[0].shape[2] < n
                    or (g.is_ring and (first != max(0, floor - g.window + 1) or n > self._max_slots[i]))):
                raise PteError(f"saved layer {i} {tuple(K[0].shape)} {K[0].dtype} does not fit this cache")
            if g.is_ring:
                runs = _ring_runs(first, n, self._max_slots[i])
            else:
                self._grow(i, length)
                runs = [(0, length)]
            self._k[i].put_runs(runs, K)
            self._v[i].put_runs(runs, V)
        self.length = self._checkpoint = self._written_end = length
        self._floor = floor

    # -- op face --------------------------------------------------------------

    def update_and_fetch(self, layer: int, position: int, k: mx.array, v: mx.array):
        """Write this step's k/v for one layer and return what to attend.

        Args:
            layer: the cache layer (the node's ``layer_id``).
            position: logical position of the step's first token.
            k, v: ``[1, H_kv, T, D]`` new keys and values.

        Returns:
            ``(K, V, mask)``: the history in logical order, and the mask for
            ``mx.fast.scaled_dot_product_attention`` (None, "causal" or a
            boolean ``[1, 1, T, S]`` band). A band is always exactly the
            layer's window over causal queries: the CPU kernel route
            (``ops/attention.py``) takes the window instead of reading it.
        """
        g = self._check_step(layer, position, k)
        T = k.shape[2]
        end = position + T
        if g.is_ring:
            K, V, S = self._ring_step(layer, g, position, T, k, v)
        else:
            K, V, S = self._flat_step(layer, position, end, k, v)
        self._advance(end)

        if T == 1:
            return K, V, None
        if g.is_ring and g.window < S:
            return K, V, self._band_mask(T, S, g.window)
        return K, V, "causal"

    def update_in_op(self, layer: int, position: int, k: mx.array, op):
        """A flat layer's step whose op writes the keys and values itself.

        ``op(K, V)`` gets the layer's pools, each as its list of arrays (one
        for a float storage; a quantized one's words, scales and biases),
        grown to hold ``position`` plus this step's ``T`` tokens; it writes
        the step at ``position`` and returns ``(y, K', V')``: its result and
        the pools' arrays written, which the layer keeps. Returns ``y``.
        ``k`` is only checked, as ``update_and_fetch`` checks it. Ring layers
        take ``update_and_fetch``.
        """
        g = self._check_step(layer, position, k)
        K, V = self._reserve(g, layer, position, k.shape[2])
        y, k_arrays, v_arrays = op(K, V)  # a failure part-way is undone by abort_step
        self._k[layer].arrays, self._v[layer].arrays = list(k_arrays), list(v_arrays)
        return y

    def reserve_in_op(self, layer: int, position: int, rows: int) -> tuple[list[mx.array], list[mx.array]]:
        """``update_in_op`` for an op built ahead of its step, which writes the
        pools in place (a GPU's decode kernel, replayed from a compiled trace):
        the flat layer's pools, each as its list of arrays, grown to hold
        ``rows`` tokens at ``position``, and the cache advanced past them."""
        return self._reserve(self._check_rows(layer, position, rows), layer, position, rows)

    def _reserve(self, g: LayerGeometry, layer: int, position: int, rows: int):
        if g.is_ring:
            raise PteError(f"cache layer {layer} is a ring: its steps go through update_and_fetch")
        end = position + rows
        self._grow(layer, end)
        self._advance(end)
        return self._k[layer].arrays, self._v[layer].arrays

    def _check_step(self, layer: int, position: int, k: mx.array) -> LayerGeometry:
        """The layer's geometry, once a step of ``k`` at ``position`` is known to fit."""
        g = self._check_rows(layer, position, k.shape[2])
        if k.shape[1] != g.n_kv_heads or k.shape[3] != g.head_dim:
            raise PteError(
                f"layer {layer} k has shape {tuple(k.shape)}, cache expects "
                f"[1, {g.n_kv_heads}, T, {g.head_dim}]"
            )
        return g

    def _check_rows(self, layer: int, position: int, T: int) -> LayerGeometry:
        """The layer's geometry, once a step of ``T`` tokens at ``position`` is known to fit."""
        if not 0 <= layer < len(self.layers):
            raise PteError(
                f"cache layer {layer} out of range: this cache has {len(self.layers)} layers"
            )
        g = self.layers[layer]
        end = position + T
        if position < 0 or position > self.length:
            raise PteError(
                f"cache position {position} is past the cache length {self.length}: "
                "positions must continue the sequence (rewind() to go back)"
            )
        if end > self.capacity:
            raise CacheFullError(
                f"KV cache full: writing {T} tokens at position {position} exceeds "
                f"capacity {self.capacity}; rewind, clear, or build a larger cache"
            )
        if self._max_step is not None and T > self._max_step:
            raise PteError(
                f"a step of {T} tokens exceeds the ring layers' max write of "
                f"{self._max_step}; feed at most {self._max_step} tokens per call"
            )
        return g

    def _advance(self, end: int) -> None:
        self.length = max(self.length, end)
        self._written_end = max(self._written_end, end)

    def _flat_step(self, layer, position, end, k, v):
        self._grow(layer, end)
        kp, vp = self._k[layer], self._v[layer]
        kp.write(position, k)
        vp.write(position, v)
        return kp.read(0, end), vp.read(0, end), end

    def _grow(self, layer: int, needed: int) -> None:
        slots = self._k[layer].slots
        if needed <= slots:
            return
        new_slots = max(slots, 1)
        while new_slots < needed:
            new_slots *= 2
        new_slots = _allocated_slots(min(new_slots, self._max_slots[layer]))
        self._k[layer].grow(new_slots)
        self._v[layer].grow(new_slots)

    def _ring_step(self, layer, g, position, T, k, v):
        size = self._max_slots[layer]
        kp, vp = self._k[layer], self._v[layer]
        runs = _ring_runs(position, T, size)
        kp.put_runs(runs, kp.storage.encode(k))
        vp.put_runs(runs, vp.storage.encode(v))
        read_start = max(0, position - g.window + 1)
        S = position + T - read_start
        runs = _ring_runs(read_start, S, size)
        if len(runs) == 1:
            (start, n), = runs
            return kp.read(start, n), vp.read(start, n), S
        join = lambda parts: _joined(parts, T)  # noqa: E731
        return kp.read_runs(runs, join), vp.read_runs(runs, join), S

    def _band_mask(self, T: int, S: int, window: int) -> mx.array:
        key = (T, S, window)
        mask = self._masks.get(key)
        if mask is None:
            # Query i (of T, right-aligned to the S keys) sees key j when
            # hi - window < j - i <= hi, hi = S - T.
            diff = mx.arange(S)[None, :] - mx.arange(T)[:, None]
            hi = S - T
            mask = ((diff <= hi) & (diff > hi - window))[None, None]
            if len(self._masks) > 64:
                self._masks.clear()
            self._masks[key] = mask
        return mask


def _joined(parts: list[mx.array], T: int) -> mx.array:
    """A wrapped ring read, joined in logical order. For one query whose
    history is a multiple of 256 rows it is joined with a spare row and
    sliced back, so that the result, like the pools, does not fill a buffer
    of such a size (see ``_allocated_slots``)."""
    S = sum(p.shape[2] for p in parts)
    if T == 1 and S % _CUDNN_DECODE_POOL_MULTIPLE == 0:
        spare = mx.zeros_like(parts[-1][:, :, :1, :])
        return mx.concatenate(parts + [spare], axis=2)[:, :, :S, :]
    return mx.concatenate(parts, axis=2)


def _ring_runs(start: int, n: int, size: int) -> list[tuple[int, int]]:
    """Split logical cells ``[start, start + n)`` into physical ring runs."""
    phys = start % size
    first = min(n, size - phys)
    if first < n:
        return [(phys, first), (0, n - first)]
    return [(phys, first)]
