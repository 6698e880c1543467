"""Attention with the off-graph cache (``UpdateAndAttendNode``), and a
layer's q and k RoPE groups folded into it where the plan's op rotates.

A transformers export rotates q and k (two RoPE groups, ``fusion.py``) right
before the layer's attention. Where the plan writes the cache and attends in
one op that can rotate too (``InOp.rotates``: the CPU extension's),
``plan_rotated_attention`` claims both groups and the attention node
(``ROTATED``) applies them as its op's first step, from cos and sin rows
made on the host once per call for every layer: four MLX ops a layer fewer
on every step. Where the op does not take a step (its dtypes, its shapes),
the groups run as they would have, first.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from ...errors import NeedsHost, PteError
from ...pte.graph import node_name, tensor_fields
from ..fusion import GROUP, Rope, kept_slots, plan_rope, readers_after
from .table import op


Run = Callable[[list], None]


class RotatedAttention(NamedTuple):
    """The RoPE groups an ``UpdateAndAttendNode`` applies itself."""

    q: Rope
    k: Rope


ROTATED = "RotatedUpdateAndAttend"  # an UpdateAndAttendNode that applies its q and k RoPE groups


def plan_rotated_attention(ctx, instructions: list, i: int) -> tuple[int, Run] | None:
    """``(the attention node's index, its run as ROTATED)`` where
    ``instructions[i:]`` start with two RoPE groups of one table pair whose
    outputs only the next ``UpdateAndAttendNode`` reads, as its q and k, and
    the plan's op for that layer rotates; None otherwise. Built here, so the
    position it reads must not be written in between either."""
    first = plan_rope(ctx, instructions, i)
    if first is None or first.host_tables is None or ctx.cache is None:
        return None
    second = plan_rope(ctx, instructions, i + len(GROUP))
    if second is None or (second.positions, second.tables, second.dims) != (first.positions, first.tables, first.dims):
        return None
    end = i + 2 * len(GROUP) - 1  # the second group's last node
    kept = kept_slots(ctx)
    readers = readers_after(instructions, end, first.out, kept)
    if not readers or len(readers) != 1 or readers_after(instructions, end, second.out, kept) != readers:
        return None
    j = readers[0]
    node = instructions[j]
    if node_name(node) != "UpdateAndAttendNode":
        return None
    n = node.op
    ropes = {first.out: first, second.out: second}
    if {n.q.idx, n.k.idx} != ropes.keys() or n.v.idx in ropes or n.layerId is None or n.scale is None:
        return None
    if not 0 <= n.layerId < len(ctx.cache.layers):
        return None  # its builder says what is wrong
    in_op = ctx.plan.update_and_attend(float(n.scale), ctx.cache.layers[n.layerId].window, ctx.cache.storage)
    if in_op is None or not in_op.rotates:
        return None
    # the groups' inputs are read at the attention node: nothing in between may write them
    read = {r.x for r in ropes.values()} | {n.position.idx}
    if any(read & set(tensor_fields(instructions[m].op)[1]) for m in range(end + 1, j)):
        return None
    return j, _build(n, ctx, RotatedAttention(ropes[n.q.idx], ropes[n.k.idx]))


@op("UpdateAndAttendNode")
def build_update_and_attend(n, ctx):
    return _build(n, ctx, None)


def _build(n, ctx, rotated: RotatedAttention | None) -> Run:
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
    tables = rotated.q.host_tables() if rotated is not None else None

    def run(f):
        at, Vn = position(f), f[v]
        rope = None
        if rotated is not None:
            Q, Kn, rope = f[rotated.q.x], f[rotated.k.x], f[tables]
            if rope.shape[1:] != (Q.shape[2], Q.shape[3] // 2) or not in_op.takes(Q, Kn, Vn):
                rotated.q.run(f)  # the groups as they were (their own checks say what is wrong)
                rotated.k.run(f)
                rope = None
        if rope is None:
            Q, Kn = f[q], f[k]
        if rope is not None or (in_op is not None and in_op.takes(Q, Kn, Vn)):  # rope: taken above
            held = None if at_array is None else f[at_array]
            extra = {} if rope is None else {"rope": rope}
            y = cache.update_in_op(layer, at, Kn, lambda K, V: in_op.run(Q, Kn, Vn, K, V, at, held, **extra))
        else:
            K, V, mask = cache.update_and_fetch(layer, at, Kn, Vn)
            y = sdpa(Q, K, V, scale=scale, mask=mask)
        f[out] = y if out_dtype is None else y.astype(out_dtype)

    # what a call built op by op hands the device after some layers (a GPU
    # kernel writes the pools in place: its result, not the pools, depends
    # on the write; compiled_runs.run_checked)
    run.writes = out
    if rotated is None and at_array is not None:
        # A GPU's kernel writes the pools in place and reads the position
        # from an array, so a compiled decode step can replay it from its
        # trace (compiled_runs.py): the cache's bookkeeping, which a trace
        # would not repeat, runs as the op's prelude at every step (for the
        # step's `rows` tokens), and the pools' arrays it returns (keys',
        # then values', alike in number) are captured by the trace.
        def prelude(f, rows: int) -> tuple:
            K, V = cache.reserve_in_op(layer, position(f), rows)
            return (*K, *V)

        def traced(f, pools: tuple, rows: int) -> None:
            K, V = list(pools[: len(pools) // 2]), list(pools[len(pools) // 2 :])
            Q, Kn, Vn = f[q], f[k], f[v]
            if Kn.shape[2] != rows or not in_op.takes(Q, Kn, Vn):
                raise NeedsHost("not a step the kernel takes")
            y, _, _ = in_op.run(Q, Kn, Vn, K, V, None, f[at_array])
            f[out] = y if out_dtype is None else y.astype(out_dtype)

        run.prelude, run.traced = prelude, traced
    return run
