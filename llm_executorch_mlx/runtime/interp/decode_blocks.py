"""Load-time grouping of a decode step's linear layers with the ops around
them, each group one kernel where the plan has them (``plan.decode_blocks``:
``gpu/decode.py``'s CUDA kernels).

A Llama layer, as exported, is on a GPU about twenty MLX ops for one token,
and a step there costs the host's time per op, not the weights' reads. Two
patterns cover its four products:

- **an RMSNorm and the products that read its output**: the input norm with
  q, k and v, the post-attention norm with gate and up. When those two
  products feed ``silu(gate) * up`` and nothing else reads the parts, the
  kernel ends in SwiGLU and writes the multiply's output.
- **a product whose one reader is a residual add**: the attention output's
  and the MLP's down product.

When q, k and v are each split into heads (reshape, transpose) and q's and
k's heads go through RoPE (``fusion.plan_rope``'s group), the first kernel
takes those nodes too (``_heads_after``): it writes the rotated heads where
the RoPE groups would, at the position array made as the call starts.

The group's first node decides, each call, from the rows it gets: one row
or a few (``Block.takes``: a decode step, a verifying call, a short chunk)
the kernel takes runs the whole group there, and each later node of the
group hands on its part (or does nothing: the parts only the group read);
anything else (a longer prefill chunk, an ``x`` of another dtype) runs every
node's own route, as without grouping. Nothing the program reads after the group is
left unwritten, so the rewrite changes the numbers only by rounding, as the
kernel's contract says (``gpu/decode.py``).

Weights must be constants (a dense product's ``mat2`` the transpose of one,
a quantized one's operands constant slots, at most filled by the init
chain); the kernel's own limits (``decode.fits``) are checked at the first
call, when the init chain has filled them.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from ..gpu.decode import Block, MadeAtFirstCall, Rotary, Weight
from ..pte.graph import node_name, tensor_fields
from .fusion import GROUP, kept_slots, plan_rope, plan_swiglu, readers_after
from .grouping import dense_weight
from .ops.quant import constant_weight
from .ops.shape import int_list
from .pairs import try_fuse_pair
from .ops.table import BUILDERS

PRODUCTS = ("AddmmNode", "QuantizedMatmulNode")
WINDOW = 12  # nodes after the norm a product may be (q, k, v and their views; gate, up)


def plan_decode_block(ctx, instructions: list, i: int, claimed) -> tuple | None:
    """``(first_run, {j: later_run})`` for a group starting at ``i``, or
    None; a later run of None: the node does nothing in either case (its
    work is another node's of the group)."""
    name = node_name(instructions[i])
    if name != "RMSNormNode" and name not in PRODUCTS:
        return None
    runner = ctx.plan.decode_blocks  # asked only where a group may start
    if runner is None:
        return None
    try:
        if name == "RMSNormNode":
            return _norm_block(ctx, runner, instructions, i, claimed)
        if name in PRODUCTS:
            return _product_add(ctx, runner, instructions, i, claimed)
    except (AttributeError, TypeError):
        return None  # malformed: each node's own builder reports it
    return None


def _written_between(instructions: list, start: int, end: int, slot: int) -> bool:
    return any(slot in tensor_fields(instructions[j].op)[1] for j in range(start + 1, end))


def _weight(ctx, instructions: list, j: int):
    """``(x slot, read(f) -> Weight)`` for a product node whose weight is
    constant, else None."""
    name, op = node_name(instructions[j]), instructions[j].op
    if name == "AddmmNode":
        if op.bias is not None or float(op.alpha) != 1.0:
            return None
        view = dense_weight(ctx, instructions, j, op)  # [K, N]: the constant's transpose
        if view is None:
            return None
        w = view.T
        return op.mat1.idx, lambda f: Weight(w)
    read = constant_weight(ctx, op)
    return None if read is None else (op.x.idx, read)


def _own(ctx, instructions: list, j: int):
    """Node ``j``'s own run, as the chain would build it."""
    instr = instructions[j]
    name = node_name(instr)
    outer, ctx.current_node = ctx.current_node, name
    try:
        return BUILDERS[name](instr.op, ctx)
    finally:
        ctx.current_node = outer


def _norm_block(ctx, runner, instructions, i, claimed):
    norm = instructions[i].op
    x, out, eps = norm.x.idx, norm.out.idx, float(norm.eps)
    nw = None if norm.weight is None else norm.weight.idx
    if nw is not None and nw >= ctx.num_constants:
        return None
    kept = kept_slots(ctx)
    members = readers_after(instructions, i, out, kept)
    if not members or any(j in claimed or j > i + WINDOW for j in members):
        return None
    weights = [_weight(ctx, instructions, j) for j in members]
    if any(w is None or w[0] != out for w in weights) or len(members) > 3:
        return None
    outs = [instructions[j].op.out.idx for j in members]
    if kept & set(outs):
        return None  # the LM head keeps its own route (its last-row variant)
    swiglu = _swiglu_after(ctx, instructions, members, outs, kept, claimed) if len(members) == 2 else None
    heads = None if swiglu else _heads_after(ctx, instructions, i, members, outs, kept, claimed)
    epilogue = "swiglu" if swiglu else ""
    reads = [w[1] for w in weights]
    own_norm = _own(ctx, instructions, i)
    own = {j: _own(ctx, instructions, j) for j in members}
    stashes = [ctx.scratch_slot() for _ in ([epilogue] if swiglu else members)]
    fused = ctx.scratch_slot()
    rotary = None if heads is None else heads.rotary
    block = MadeAtFirstCall(runner, lambda f: Block(tuple(read(f) for read in reads),
                                                    (None if nw is None else f[nw], eps), epilogue, rotary))

    position = None if heads is None else heads.position

    def first(f):
        xs = f[x]
        b, launch = block.get(f)
        if b is None or not b.takes(xs):
            f[fused] = False
            own_norm(f)
            return
        f[fused] = True
        for slot, y in zip(stashes, launch(xs) if position is None else launch(xs, position=f[position])):
            f[slot] = y

    if swiglu:
        silu, multiply, silu_run, multiply_run = swiglu
        later = {j: _unless_fused(fused, own[j]) for j in members}
        later[silu] = _unless_fused(fused, silu_run)
        later[multiply] = _hand_on(fused, stashes[0], instructions[multiply].op.out.idx, multiply_run)
    elif heads is not None:
        later = {j: _unless_fused(fused, own[j]) for j in members}
        for stash, (j, out, run), between in zip(stashes, heads.ends, heads.between):
            later.update({k: own_k and _unless_fused(fused, own_k) for k, own_k in between.items()})
            later[j] = _hand_on(fused, stash, out, run)
    else:
        later = {j: _hand_on(fused, stash, o, own[j]) for j, stash, o in zip(members, stashes, outs)}
    return first, later


class _Heads(NamedTuple):
    """q, k and v split into heads, RoPE after the first ones: the kernel's
    ``rotary``, the slot of the position array it reads, per product the
    node that takes the kernel's output (``(index, out slot, its own
    run)``) and the nodes between, each with its own run."""

    rotary: Rotary
    position: int
    ends: list[tuple[int, int, object]]
    between: list[dict[int, object]]


def _heads_after(ctx, instructions, i, members, outs, kept, claimed) -> _Heads | None:
    """Where each product's output is split into heads of one size (a
    reshape to ``[B, T, H, D]`` then a transpose to ``[B, H, T, D]``,
    nothing else reading either) and the first ones' heads then go through
    RoPE (``fusion.plan_rope``'s group, whole heads, at an input's position,
    unscaled, the same tables for each): the kernel writes what the last of
    those nodes would. None otherwise."""
    ends, between, ropes, sizes = [], [], [], []
    for j, out in zip(members, outs):
        split = _head_split(ctx, instructions, j, out, kept)
        if split is None:
            return None
        r, heads, size = split
        pair = try_fuse_pair(ctx, instructions, r)
        runs = ({r: _own(ctx, instructions, r), r + 1: _own(ctx, instructions, r + 1)} if pair is None
                else {r: pair[1], r + 1: _nothing})
        g = readers_after(instructions, r + 1, heads, kept)  # a RoPE group reads its x three times
        rope = plan_rope(ctx, instructions, g[0]) if g else None
        if rope is not None and rope.x == heads:
            span = range(g[0], g[0] + len(GROUP))
            if len(ropes) < len(ends) or not set(g) <= set(span) or claimed.keys() & set(span):
                return None  # a rotated product after one that is not, or a group already claimed
            ropes.append(rope)
            runs.update({k: None for k in span[1:]})
            ends.append((g[0], rope.out, rope.run))
        else:
            ends.append((r + 1, heads, runs.pop(r + 1)))
        between.append(runs)
        sizes.append(size)
    if not ropes:
        return None
    first = ropes[0]
    if first.freqs is None or any(size != first.dims for size in sizes):
        return None
    for rope, (g, _, _) in zip(ropes, ends):
        if (rope.dims != first.dims or rope.positions != first.positions or rope.freqs is None
                or rope.scale != 1.0 or not mx.array_equal(rope.freqs, first.freqs).item()
                or any(_written_between(instructions, i, g, table) for table in rope.tables)):
            return None
    position = ctx.position_array_of(first.positions)
    if position is None:
        return None
    return _Heads(Rotary(first.dims, first.freqs, len(ropes)), position, ends, between)


def _head_split(ctx, instructions, j, out, kept) -> tuple[int, int, int] | None:
    """``(reshape index, heads slot, head size)`` where product ``j``'s
    output is split into heads by a reshape to ``[B, T, H, D]`` then a
    transpose to ``[B, H, T, D]``, nothing else reading either; else None."""
    readers = readers_after(instructions, j, out, kept)
    if not readers or len(readers) != 1 or node_name(instructions[readers[0]]) != "ReshapeNode":
        return None
    r = readers[0]
    if r + 1 >= len(instructions) or node_name(instructions[r + 1]) != "TransposeNode":
        return None
    reshape, transpose = instructions[r].op, instructions[r + 1].op
    if (transpose.x.idx != reshape.out.idx or int_list(transpose.perm) != [0, 2, 1, 3]
            or len(reshape.shape or []) != 4 or readers_after(instructions, r, reshape.out.idx, kept) != [r + 1]):
        return None
    size = ctx.static_int(reshape.shape[3])
    return None if size is None else (r, transpose.out.idx, size)


def _nothing(f):
    """A node whose work the group's run or its first node did."""


def _swiglu_after(ctx, instructions, members, outs, kept, claimed):
    """``(silu, multiply, silu_run, multiply_run)`` when the two products'
    outputs feed ``silu(a) * b`` alone (``fusion.plan_swiglu``'s pattern),
    else None."""
    for a, b in ((0, 1), (1, 0)):
        readers = readers_after(instructions, members[a], outs[a], kept)
        if not readers or len(readers) != 1 or node_name(instructions[readers[0]]) != "SiluNode":
            continue
        silu = readers[0]
        found = plan_swiglu(ctx, instructions, silu)
        if found is None:
            return None
        silu_run, multiply, multiply_run = found
        mul = instructions[multiply].op
        if {mul.a.idx, mul.b.idx} != {instructions[silu].op.out.idx, outs[b]}:
            return None
        if readers_after(instructions, members[b], outs[b], kept) != [multiply] or {silu, multiply} & claimed.keys():
            return None
        return silu, multiply, silu_run, multiply_run
    return None


def _product_add(ctx, runner, instructions, i, claimed):
    weight = _weight(ctx, instructions, i)
    if weight is None:
        return None
    x, read = weight
    out = instructions[i].op.out.idx
    readers = readers_after(instructions, i, out, kept_slots(ctx))
    if not readers or len(readers) != 1 or readers[0] in claimed:
        return None
    a = readers[0]
    add = instructions[a].op
    if node_name(instructions[a]) != "AddNode" or add.a.idx == add.b.idx or out not in (add.a.idx, add.b.idx):
        return None
    residual = add.b.idx if add.a.idx == out else add.a.idx
    if _written_between(instructions, i - 1, a, residual):
        return None  # the residual must hold its value from the product on
    own_product, own_add = _own(ctx, instructions, i), _own(ctx, instructions, a)
    stash = ctx.scratch_slot()
    block = MadeAtFirstCall(runner, lambda f: Block((read(f),), None, "add"))

    def first(f):
        xs, r = f[x], f[residual]
        b, launch = block.get(f)
        if b is None or not b.takes(xs) or r is None or r.dtype != xs.dtype or r.shape != (*xs.shape[:-1], b.rows):
            f[stash] = None
            own_product(f)
            return
        f[stash] = launch(xs, r)[0]

    def add_run(f):
        y = f[stash]
        if y is None:
            own_add(f)
        else:
            f[add.out.idx], f[stash] = y, None

    return first, {a: add_run}


def _unless_fused(fused: int, own):
    def run(f):
        if not f[fused]:
            own(f)

    return run


def _hand_on(fused: int, stash: int, out: int, own):
    def run(f):
        if f[fused]:
            f[out], f[stash] = f[stash], None
        else:
            own(f)

    return run
