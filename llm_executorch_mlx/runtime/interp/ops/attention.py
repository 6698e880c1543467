"""Attention with the off-graph cache (``UpdateAndAttendNode``)."""

from __future__ import annotations

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
    sdpa = ctx.plan.cache_attention(window, cache.quantized)
    # the layer's write and attention as one op, where the plan has it
    in_op = ctx.plan.update_and_attend(scale, window, cache.storage)
    at_array = ctx.position_array(n.position) if in_op is not None and in_op.on_device else None

    def run(f):
        at, Q, Kn, Vn = position(f), f[q], f[k], f[v]
        if in_op is not None and in_op.takes(Q, Kn, Vn):
            held = None if at_array is None else f[at_array]
            y = cache.update_in_op(layer, at, Kn, lambda K, V: in_op.run(Q, Kn, Vn, K, V, at, held))
        else:
            K, V, mask = cache.update_and_fetch(layer, at, Kn, Vn)
            y = sdpa(Q, K, V, scale=scale, mask=mask)
        f[out] = y if out_dtype is None else y.astype(out_dtype)

    return run
