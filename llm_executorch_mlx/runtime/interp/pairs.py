"""Load-time rewrites of two adjacent nodes into one MLX node.

On MLX's CPU backend every node costs a few microseconds whatever its size:
the host allocates its output and queues tasks to the CPU stream's thread,
which may have to be woken, and frees buffers the host allocated. A small
model's decode step is about a thousand nodes around a couple of hundred
matrix-vector products, so the nodes themselves are a good part of the step.

Exported transformers split heads after the q, k and v projections with a
``reshape`` then a ``transpose`` (``[B, T, H*D] -> [B, H, T, D]``) and merge
them after attention with a ``transpose`` then a ``reshape``. When the
transpose moves only axes of size 1, as it does for a decode step's single
position, it keeps the elements in order, and the pair is one reshape of
the pair's input. Otherwise both nodes run as exported.

A pair is fused only in the main chain, when nothing after it reads the
first node's output and the caller does not receive it. (Not kept: the
output projection's product and the residual add as one ``mx.addmm``. BLAS
then accumulates the product into the residual, rounding every partial sum
at the residual's scale: 60x the error of the separate add at a residual of
100.)
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ..errors import PteError
from ..pte.graph import node_name
from .fusion import kept_slots, read_before_written
from .ops.shape import int_list

PAIRS = {("ReshapeNode", "TransposeNode"), ("TransposeNode", "ReshapeNode")}


def try_fuse_pair(ctx, instructions: list, i: int):
    """``(name, run)`` for ``instructions[i]`` and ``[i + 1]`` of the main
    chain as one node, or None when they are not a fusable pair."""
    if i + 1 >= len(instructions):
        return None
    names = (node_name(instructions[i]), node_name(instructions[i + 1]))
    if names not in PAIRS:
        return None
    first, second = instructions[i].op, instructions[i + 1].op
    try:
        between = first.out.idx
        if second.x.idx != between or between in kept_slots(ctx):
            return None
        if between != second.out.idx and read_before_written(instructions[i + 2 :], {between}):
            return None
        if names == ("ReshapeNode", "TransposeNode"):
            return _reshape_transpose(ctx, first, second)
        return _transpose_reshape(ctx, first, second)
    except (AttributeError, TypeError, IndexError, PteError):
        return None  # a malformed node: its own builder will say what is wrong


@functools.lru_cache(maxsize=1024)
def _keeps_order(shape: tuple, perm: tuple) -> bool:
    """Whether ``perm`` is a permutation of ``shape``'s axes that moves only
    axes of size 1, so the transpose keeps the elements in row-major order.
    (Cached: a program sees a few shapes, and this runs in every call.)"""
    ndim = len(shape)
    if sorted(p % ndim if -ndim <= p < ndim else -1 for p in perm) != list(range(ndim)):
        return False  # not a permutation: the exported nodes report it
    moved = [p % ndim for p in perm if shape[p] != 1]
    return moved == sorted(moved)


@functools.lru_cache(maxsize=1024)
def _split_heads_shape(size: int, wanted: tuple, perm: tuple) -> list[int] | None:
    """The one reshape of ``size`` elements that equals reshaping them to
    ``wanted`` then transposing by ``perm``, or None when there is none."""
    shape = _resolved(size, wanted)
    if shape is None or not _keeps_order(shape, perm):
        return None
    return [shape[p] for p in perm]


def _reshape_transpose(ctx, reshape, transpose):
    x, out = ctx.t(reshape.x), ctx.out(transpose.out)
    ctx.out(reshape.out)
    shape_of = ctx.ints(reshape.shape)
    perm = tuple(int_list(transpose.perm))

    def run(f):
        X, wanted = f[x], shape_of(f)
        split = _split_heads_shape(X.size, tuple(wanted), perm)
        if split is not None:
            f[out] = X.reshape(split)
        else:
            f[out] = mx.transpose(mx.reshape(X, wanted), perm)

    return "ReshapeTransposeFused", run


def _transpose_reshape(ctx, transpose, reshape):
    if ctx.fixed_constant(ctx.t(transpose.x)) is not None:
        return None  # a weight's transpose is already made once, at load
    x, out = ctx.t(transpose.x), ctx.out(reshape.out)
    ctx.out(transpose.out)
    shape_of = ctx.ints(reshape.shape)
    perm = tuple(int_list(transpose.perm))

    def run(f):
        X = f[x]
        if _keeps_order(X.shape, perm):
            f[out] = mx.reshape(X, shape_of(f))
        else:
            f[out] = mx.reshape(mx.transpose(X, perm), shape_of(f))

    return "TransposeReshapeFused", run


def _resolved(size: int, shape: tuple) -> tuple | None:
    """``shape`` with a ``-1`` worked out for ``size`` elements; None when it
    cannot be (MLX then reports the bad reshape itself)."""
    if shape.count(-1) > 1 or any(s < -1 for s in shape):
        return None
    if -1 not in shape:
        return shape
    known = 1
    for s in shape:
        known *= s if s != -1 else 1
    if known == 0 or size % known:
        return None
    return tuple(size // known if s == -1 else s for s in shape)
