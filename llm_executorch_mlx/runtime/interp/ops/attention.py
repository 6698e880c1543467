"""Attention with the off-graph cache (``UpdateAndAttendNode``)."""

from __future__ import annotations

import mlx.core as mx

from ...cpu.fastmath import attention
from ...dtypes import on_cpu
from ...errors import PteError
from .table import op


@op("UpdateAndAttendNode")
def build_update_and_attend(n, ctx):
    if ctx.cache is None:
        raise PteError(
            "this program uses an off-graph KV cache: build one with "
            "program.new_cache(capacity=...) and pass it to load_method(..., cache=cache)"
        )
    if n.layerId is None or n.scale is None:
        raise PteError("UpdateAndAttendNode: layer_id and scale must be set")
    if not 0 <= n.layerId < len(ctx.cache.layers):
        raise PteError(
            f"UpdateAndAttendNode: layer {n.layerId} out of range for a cache of "
            f"{len(ctx.cache.layers)} layers"
        )
    q, k, v, out = ctx.t(n.q), ctx.t(n.k), ctx.t(n.v), ctx.out(n.out)
    position = ctx.host_int(n.position)
    layer, scale, cache = n.layerId, float(n.scale), ctx.cache
    out_dtype = None if n.outDtype is None else ctx.dtype(n.outDtype)
    window = cache.layers[layer].window
    in_op = None
    if on_cpu():
        sdpa = cpu_attention(window, ctx.kernels)
        if window == 0:
            in_op = cpu_update_and_attend(scale, ctx.kernels)
    else:
        sdpa = in_query_dtype(mx.fast.scaled_dot_product_attention)

    def run(f):
        at, Q, Kn, Vn = position(f), f[q], f[k], f[v]
        if in_op is not None and in_op_takes(Q, Kn, Vn):
            y = cache.update_in_op(layer, at, Kn, lambda K, V: in_op(Q, Kn, Vn, K, V, at))
        else:
            K, V, mask = cache.update_and_fetch(layer, at, Kn, Vn)
            y = sdpa(Q, K, V, scale=scale, mask=mask)
        f[out] = y if out_dtype is None else y.astype(out_dtype)

    return run


def in_query_dtype(sdpa):
    """``sdpa`` over keys and values cast to the queries' dtype, for a cache
    stored in another one (``kv_storage_dtype``)."""

    def cast_then_sdpa(Q, K, V, scale, mask):
        if K.dtype != Q.dtype:
            K, V = K.astype(Q.dtype), V.astype(Q.dtype)
        return sdpa(Q, K, V, scale=scale, mask=mask)

    return cast_then_sdpa


# What the compiled kernel reads: fp32 queries over fp32, bf16 or fp16 keys and values.
KERNEL_KV_DTYPES = (mx.float32, mx.bfloat16, mx.float16)


def cpu_attention(window: int = 0, kernels=None):
    """Attention on the CPU: the extension's one-op kernel for fp32 queries
    where ``kernels`` (a ``cpu.CpuKernels``) has it on, else
    ``fastmath.attention``'s MLX ops.

    ``window`` is the layer's sliding window (0: none). The cache spells it
    out as a band mask when it cuts into the keys; the kernel takes the
    window itself, so a band mask without one goes to the MLX ops. A bf16 or
    fp16 cache under fp32 compute is read by the kernel as it is, without a
    widened copy of the history.
    """
    mlx_ops = in_query_dtype(attention)
    if kernels is None or not kernels.attention.on:
        return mlx_ops
    fused_attention = kernels.extension.attention

    def sdpa(Q, K, V, scale, mask):
        # the cache's masks: None (one query), "causal", or the window's band
        if (Q.dtype == mx.float32 and K.dtype in KERNEL_KV_DTYPES
                and (window > 0 or not isinstance(mask, mx.array)) and kernel_takes(Q, K, V, mask is not None)):
            return fused_attention(Q, K, V, scale, mask is not None, window=window, stream=mx.cpu)
        return mlx_ops(Q, K, V, scale=scale, mask=mask)

    return sdpa


def cpu_update_and_attend(scale: float, kernels=None):
    """A flat layer's step as the extension's one op (the cache write and the
    attention: ``update_and_attend``), where ``kernels`` has the attention
    kernel on; else None. Five MLX nodes a layer fewer than writing the pools
    with ``__setitem__``, slicing them and attending."""
    if kernels is None or not kernels.attention.on:
        return None
    update_and_attend = kernels.extension.update_and_attend

    def in_op(Q, Kn, Vn, K, V, position):
        return update_and_attend(Q, Kn, Vn, K, V, position, scale, stream=mx.cpu)

    return in_op


def in_op_takes(Q, Kn, Vn) -> bool:
    """Whether ``update_and_attend`` takes this step's queries, keys and values
    (fp32, one batch, as many queries as keys; the cache checks the heads and
    head size against its pools): anything else takes the MLX route."""
    return (Q.dtype == Kn.dtype == Vn.dtype == mx.float32 and Q.ndim == Kn.ndim == 4 and Kn.shape == Vn.shape
            and Q.shape[0] == Kn.shape[0] == 1 and Q.shape[2:] == Kn.shape[2:]
            and 0 < Kn.shape[1] and Q.shape[1] % Kn.shape[1] == 0)


def kernel_takes(Q, K, V, causal: bool) -> bool:
    """The shapes the extension's kernel attends over (cpu/attention.cpp):
    anything else (a corrupt program's query) goes to MLX's ops, whose
    checks name the problem."""
    if Q.ndim != 4 or K.ndim != 4 or K.shape != V.shape:
        return False
    B, H, T, D = Q.shape
    _, H_kv, S, D_kv = K.shape
    return B == K.shape[0] and D == D_kv and 0 < H_kv and H % H_kv == 0 and 0 < S and (not causal or T <= S)
