"""The extension's element-wise and attention ops as drop-ins for MLX's.

Each function here takes the loaded extension and a fallback with the same
signature, and returns a function that runs the extension's kernel on what
that kernel takes (fp32 activations, the shapes it reads) and hands anything
else (another dtype, a corrupt program's shapes) to the fallback, whose
checks name the problem. Which of them a program uses is its plan's
decision (``runtime/plan.py``); the products, whose routes depend on the
row count, are the op builders' (``interp/ops/nn.py``, ``quant.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:
    from ..kv_storage import Storage
from ..quantized_kv import QuantizedKV

# What the attention kernel reads: fp32 queries over fp32, bf16 or fp16 keys and values.
KERNEL_KV_DTYPES = (mx.float32, mx.bfloat16, mx.float16)


def rms_norm(extension, fallback):
    """``mx.fast.rms_norm`` for fp32 rows and weight (or none), of any count."""

    def extension_rms_norm(x, weight, eps):
        if x.dtype == mx.float32 and x.ndim > 0 and x.size and (
                weight is None or (weight.dtype == mx.float32 and weight.shape == x.shape[-1:])):
            return extension.rms_norm(x, weight, eps)
        return fallback(x, weight, eps)

    return extension_rms_norm


def swiglu(extension, fallback):
    """``silu(gate) * up`` for fp32 gate and up of one shape."""

    def extension_swiglu(gate, up):
        if gate.dtype == up.dtype == mx.float32 and gate.shape == up.shape:
            return extension.silu_mul(gate, up)
        return fallback(gate, up)

    return extension_swiglu


def attention(extension, fallback, window: int = 0):
    """Attention (``fastmath.attention``'s signature) for fp32 queries over
    fp32, bf16 or fp16 keys and values, read as stored: a half-precision
    cache under fp32 compute needs no widened copy of the history.

    ``window`` is the layer's sliding window (0: none). The cache spells it
    out as a band mask when it cuts into the keys; the kernel takes the
    window itself, so a band mask without one goes to the fallback.
    """

    def extension_attention(Q, K, V, scale, mask):
        # the cache's masks: None (one query), "causal", or the window's band
        if (Q.dtype == mx.float32 and K.dtype in KERNEL_KV_DTYPES and V.dtype == K.dtype
                and (window > 0 or not isinstance(mask, mx.array)) and kernel_takes(Q, K, V, mask is not None)):
            return extension.attention(Q, K, V, scale, mask is not None, window=window, stream=mx.cpu)
        return fallback(Q, K, V, scale=scale, mask=mask)

    return extension_attention


def quantized_attention(extension, fallback, window: int = 0):
    """``attention``'s drop-in over a quantized cache: K and V are each a
    ``QuantizedKV`` (4 or 8 bits, each its own; one group size; float16
    scales and biases; both rotated or neither), dequantized in registers as
    they are read, so no widened copy of the history is made. Masks as
    ``attention``'s; what the kernel does not take (``quantized_kernel_takes``)
    goes to ``fallback``."""

    def extension_quantized_attention(Q, K, V, scale, mask):
        if (window > 0 or not isinstance(mask, mx.array)) and quantized_kernel_takes(Q, K, V, mask is not None):
            return extension.quantized_attention(Q, K.data, K.scales, K.biases, V.data, V.scales, V.biases, scale,
                                                 mask is not None, K.bits, V.bits, K.group_size, window=window,
                                                 rotated=K.rotated, stream=mx.cpu)
        return fallback(Q, K, V, scale=scale, mask=mask)

    return extension_quantized_attention


def update_and_attend(extension, scale: float):
    """A flat layer's step as one op: the cache write and the attention
    (``Plan.update_and_attend``'s ``InOp`` run, for what ``in_op_takes``). Five MLX
    nodes a layer fewer than writing the pools with ``__setitem__``, slicing
    them and attending."""

    def in_op(Q, Kn, Vn, K, V, position, position_array, rope=None):
        y, k_pool, v_pool = extension.update_and_attend(Q, Kn, Vn, *K, *V, position, scale, rope=rope, stream=mx.cpu)
        return y, [k_pool], [v_pool]

    return in_op


def quantized_update_and_attend(extension, scale: float, keys: Storage, values: Storage):
    """``update_and_attend``'s op over quantized pools (``keys`` and
    ``values`` their storages): each pool's words, scales and biases. The
    op rotates and quantizes the step's keys and values as ``Storage.encode``
    does (its rotation rounded once, where MLX's fp32 product rounds a
    value's fp16 differently about once in 1,500): a few hundred MLX nodes a
    step fewer than encoding, writing and slicing three arrays a pool."""

    def in_op(Q, Kn, Vn, K, V, position, position_array, rope=None):
        y, *pools = extension.quantized_update_and_attend(
            Q, Kn, Vn, *K, *V, position, scale, keys.bits, values.bits, keys.group_size(Q.shape[-1]),
            rotated=keys.rotated, rope=rope, stream=mx.cpu)
        return y, pools[:3], pools[3:]

    return in_op


def in_op_takes(Q, Kn, Vn) -> bool:
    """Whether ``update_and_attend`` (either version) takes this step's
    queries, keys and values (fp32, one batch, as many queries as keys; the
    cache checks the heads and head size against its pools, which it made
    as the ops take them): anything else takes the MLX route."""
    return (Q.dtype == Kn.dtype == Vn.dtype == mx.float32 and Q.ndim == Kn.ndim == 4 and Kn.shape == Vn.shape
            and Q.shape[0] == Kn.shape[0] == 1 and Q.shape[2:] == Kn.shape[2:]
            and 0 < Kn.shape[1] and Q.shape[1] % Kn.shape[1] == 0)


def kernel_takes(Q, K, V, causal: bool) -> bool:
    """The shapes the attention kernel attends over (``attention.cpp``)."""
    if Q.ndim != 4 or K.ndim != 4 or K.shape != V.shape:
        return False
    B, H, T, D = Q.shape
    _, H_kv, S, D_kv = K.shape
    return B == K.shape[0] and D == D_kv and 0 < H_kv and H % H_kv == 0 and 0 < S and (not causal or T <= S)


def quantized_kernel_takes(Q, K: QuantizedKV, V: QuantizedKV, causal: bool) -> bool:
    """What the quantized attention kernel attends over (``attention.cpp``'s
    ``quantized_attention``): fp32 queries [B, H, T, D]; K and V quantized
    along D at 4 or 8 bits in one group size of 32, 64 or 128 dividing D,
    uint32 words and float16 scales and biases of the [B, H_kv, S, D] rows;
    both rotated (as the cache stores them) or neither."""
    if not (isinstance(K, QuantizedKV) and isinstance(V, QuantizedKV)):
        return False  # one of them stored as floats: the fallback
    if K.rotated != V.rotated:  # the kernel takes one flag for both
        return False
    if Q.dtype != mx.float32 or Q.ndim != 4 or K.group_size != V.group_size or K.group_size not in (32, 64, 128):
        return False
    B, H, T, D = Q.shape
    if D % K.group_size or K.data.ndim != 4:
        return False
    rows = (B, *K.data.shape[1:3])
    for kv in (K, V):
        grouped = (*rows, D // kv.group_size)
        if (kv.bits not in (4, 8) or kv.data.dtype != mx.uint32 or kv.data.shape != (*rows, D * kv.bits // 32)
                or kv.scales.dtype != mx.float16 or kv.biases.dtype != mx.float16
                or kv.scales.shape != grouped or kv.biases.shape != grouped):
            return False
    _, H_kv, S = rows
    return 0 < H_kv and H % H_kv == 0 and 0 < S and (not causal or T <= S)
