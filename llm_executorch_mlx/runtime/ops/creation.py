"""Nodes creating tensors: ranges, fills, triangles, random bits.

A node whose sizes and values are all literals makes its tensor once, at load;
the closure then hands out that (immutable) array.
"""

from __future__ import annotations

import math
from functools import lru_cache

import mlx.core as mx

from ..errors import PteError
from . import op
from .elementwise import unary

MAX_ALLOCATION_BYTES = 4 * 1024**3  # the C++ runtime's bound on a created tensor


def check_allocation(name: str, shape, itemsize: int) -> None:
    """The C++ runtime's guard: every dimension positive, at most 4 GiB."""
    for d in shape:
        if d <= 0:
            raise PteError(f"{name}: invalid dimension {d}")
    if math.prod(shape) * itemsize > MAX_ALLOCATION_BYTES:
        raise PteError(f"{name}: allocation exceeds 4GB limit")


def _const_or_run(o, make, static_args):
    """``run`` for ``f[o] = make(*args)``: built now when every arg is known."""
    if static_args is not None:
        const = make(*static_args)
        return lambda f: f.__setitem__(o, const)
    return None


@op("ARangeNode")
def build_arange(n, ctx):
    o = ctx.out(n.out)
    dtype = None if n.scalarType is None else ctx.dtype(n.scalarType)
    itemsize = 4 if dtype is None else dtype.size

    def make(start, stop, step):
        if step == 0:
            raise PteError("ARangeNode: step must not be zero")
        span = stop - start
        numel = -(-span // step) if (span > 0) == (step > 0) and span else 0
        check_allocation("ARangeNode", [numel], itemsize)
        if dtype is None:
            return mx.arange(start, stop, step)  # int32
        return mx.arange(start, stop, step, dtype=dtype)

    fields = (n.start, n.stop, n.step)
    statics = [ctx.static_int(x) if x is not None else None for x in fields]
    if None not in statics:
        return _const_or_run(o, make, statics)
    start, stop, step = (ctx.int_(x) for x in fields)

    def run(f):
        f[o] = make(f[start], f[stop], f[step])

    return run


@op("FullNode")
def build_full(n, ctx):
    o = ctx.out(n.out)
    dtype = ctx.dtype(n.scalarType)
    shape = ctx.ints(n.shape)
    v = ctx.float_(n.v)

    def make(dims, value):
        check_allocation("FullNode", dims, dtype.size)
        return mx.full(dims, value, dtype=dtype)

    if not n.v.isVid and all(not d.isVid for d in n.shape or []):
        return _const_or_run(o, make, (shape(None), ctx.extra[v - ctx.num_tensors - ctx.num_values]))

    def run(f):
        f[o] = make(shape(f), f[v])

    return run
