"""A quantized cache's keys or values as the attention reads them."""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx


class QuantizedKV(NamedTuple):
    """Keys or values [B, H_kv, S, D] in MLX's affine layout along D, what
    ``mx.quantize(x, group_size, bits)`` returns: ``data`` uint32
    [B, H_kv, S, D * bits / 32] and ``scales``, ``biases`` [B, H_kv, S,
    D / group_size], each value ``q * scale + bias``."""

    data: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int

    def dequantize(self, dtype: mx.Dtype = mx.float32) -> mx.array:
        """The values as ``dtype``: ``q * scale + bias`` computed in fp32 (as
        the CPU kernel computes them), then rounded to ``dtype``."""
        wide = mx.dequantize(self.data, self.scales.astype(mx.float32), self.biases.astype(mx.float32),
                             group_size=self.group_size, bits=self.bits)
        return wide if dtype == mx.float32 else wide.astype(dtype)
