"""Keys and values in MLX's affine group quantization, and attention over
them with MLX's own ops (any device; the CPU kernel is in cpu/attention.cpp).

A quantized history holds, per head and token, ``D * bits / 32`` uint32
words (``bits`` per value, element i of a word at bit ``bits * i``) and a
scale and a bias per group of ``group_size`` values along the head dimension:
a value is ``q * scale + bias``, exactly what ``mx.quantize`` returns.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import mlx.core as mx
import numpy as np


class QuantizedKV(NamedTuple):
    """A quantized ``[B, H_kv, S, D]`` history (or a slice of a pool)."""

    data: mx.array  # uint32 [B, H_kv, S, D * bits / 32]
    scales: mx.array  # [B, H_kv, S, D / group_size]
    biases: mx.array  # [B, H_kv, S, D / group_size]
    bits: int
    group_size: int
    rotated: bool = False  # each group stored rotated by the Hadamard matrix of its size (``rotate``)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The logical shape, as the float history would have."""
        B, H, S, words = self.data.shape
        return (B, H, S, words * 32 // self.bits)

    @property
    def fields(self) -> tuple[mx.array, mx.array, mx.array]:
        return self.data, self.scales, self.biases

    @classmethod
    def quantize(cls, x: mx.array, bits: int, group_size: int, dtype: mx.Dtype, rotated: bool = False) -> QuantizedKV:
        """``x`` (rotated first, where asked) rounded to ``bits`` per value,
        with scales and biases in ``dtype``."""
        if rotated:
            x = rotate(x, group_size)
        return cls(*mx.quantize(x.astype(dtype), group_size=group_size, bits=bits), bits, group_size, rotated)

    def dequantize(self, dtype: mx.Dtype = mx.float32) -> mx.array:
        """The values as ``dtype``: ``q * scale + bias`` computed in fp32 (as
        the CPU kernel computes them), then rounded to ``dtype``."""
        wide = mx.dequantize(self.data, self.scales.astype(mx.float32), self.biases.astype(mx.float32),
                             group_size=self.group_size, bits=self.bits)
        return wide if dtype == mx.float32 else wide.astype(dtype)


@functools.lru_cache(maxsize=None)
def hadamard(n: int, dtype: mx.Dtype = mx.float32) -> mx.array:
    """The orthonormal Walsh-Hadamard matrix of size ``n`` (a power of two):
    symmetric, its own inverse. Made once per size and dtype (as an
    evaluated array: a step reads it, never builds it)."""
    h = np.ones((1, 1), dtype=np.float32)
    while len(h) < n:
        h = np.block([[h, h], [h, -h]])
    matrix = mx.array(h / np.sqrt(n, dtype=np.float32)).astype(dtype)
    mx.eval(matrix)
    return matrix


def rotate(x: mx.array, group_size: int) -> mx.array:
    """Each group of ``group_size`` values along the last axis multiplied by
    ``hadamard(group_size)``. A rotation spreads a group's outliers over all
    its values, so quantization steps shrink to the group's typical size;
    dot products within a group are unchanged when both sides are rotated,
    and rotating twice is the identity."""
    shape = x.shape
    grouped = x.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    return (grouped @ hadamard(group_size, x.dtype)).reshape(shape)


def attention(Q: mx.array, K, V, scale: float, mask) -> mx.array:
    """``mx.fast.scaled_dot_product_attention``'s result for keys and values
    either of which may be a ``QuantizedKV``: each product reads its operand
    as stored (``mx.quantized_matmul``), so no step widens the history.
    ``mask`` is None, ``"causal"`` (the T queries are the last T of the S
    keys) or a boolean ``[1, 1, T, S]`` array. Softmax runs in fp32."""
    if isinstance(K, QuantizedKV) and K.rotated:
        Q = rotate(Q, K.group_size)  # Q's groups rotated as K's: the same scores
    out = _attend(Q, K, V, scale, mask)
    # rotated values give the rotated output: rotating it again undoes that
    return rotate(out, V.group_size) if isinstance(V, QuantizedKV) and V.rotated else out


def widened_attention(Q: mx.array, K, V, scale: float, mask) -> mx.array:
    """``attention``'s result through ``mx.fast.scaled_dot_product_attention``
    over the history widened to the queries' dtype, one layer at a time:
    what a GPU runs, where MLX's ``quantized_matmul`` has no kernel for many
    of attention's shapes (CUDA: an fp32 query chunk of 70 rows over 8-bit
    keys, for one). The cache stays quantized; the widened copy lives for
    the op."""
    if isinstance(K, QuantizedKV) and K.rotated:
        Q = rotate(Q, K.group_size)
    keys, values = (kv.dequantize(Q.dtype) if isinstance(kv, QuantizedKV) else kv.astype(Q.dtype) for kv in (K, V))
    out = mx.fast.scaled_dot_product_attention(Q, keys, values, scale=scale, mask=mask)
    return rotate(out, V.group_size) if isinstance(V, QuantizedKV) and V.rotated else out


def _attend(Q: mx.array, K, V, scale: float, mask) -> mx.array:
    B, H, T, D = Q.shape
    H_kv, S = K.shape[1], K.shape[2]
    rep = H // H_kv
    # The query heads of a kv head side by side, as one matrix against its keys.
    q = (Q * scale).reshape(B, H_kv, rep, T, D)
    scores = _product(q, K, transpose=True)  # [B, H_kv, rep, T, S]
    if isinstance(mask, str):
        mask = mx.arange(S)[None, :] <= mx.arange(S - T, S)[:, None]
    if mask is not None:
        scores = mx.where(mask, scores, mx.array(-mx.inf, dtype=scores.dtype))
    weights = mx.softmax(scores.astype(mx.float32), axis=-1)
    out = _product(weights, V, transpose=False)  # [B, H_kv, rep, T, D]
    return out.reshape(B, H, T, D).astype(Q.dtype)


def _product(x: mx.array, kv, transpose: bool) -> mx.array:
    """``x @ kv^T`` (``transpose``) or ``x @ kv`` over the S axis of a history
    shaped ``[B, H_kv, S, D]``, broadcast over the query heads' axis."""
    if isinstance(kv, QuantizedKV):
        fields = [f[:, :, None] for f in kv.fields]
        x = x.astype(_common(x.dtype, kv.scales.dtype))
        return mx.quantized_matmul(x, *fields, transpose=transpose, group_size=kv.group_size, bits=kv.bits)
    kv = kv[:, :, None].astype(_common(x.dtype, kv.dtype))
    return x.astype(kv.dtype) @ (kv.swapaxes(-1, -2) if transpose else kv)


def _common(a: mx.Dtype, b: mx.Dtype) -> mx.Dtype:
    """The dtype a product of the two computes in: theirs, or else fp32."""
    return a if a == b else mx.float32
