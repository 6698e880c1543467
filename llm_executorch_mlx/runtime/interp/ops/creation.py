"""Nodes creating tensors: ranges, fills, triangles, random bits.

A node whose sizes and fill value are all literals makes its tensor once, at
load; the closure then hands out that (immutable) array.
"""

from __future__ import annotations

import math
from functools import lru_cache

import mlx.core as mx
import numpy as np

from ...errors import PteError
from ...pte._schema import mlx_delegate as md
from .table import op
from .elementwise import unary

MAX_ALLOCATION_BYTES = 4 * 1024**3  # the C++ runtime's bound on a created tensor


def check_allocation(name: str, shape, itemsize: int) -> None:
    """The C++ runtime's guard: every dimension positive, at most 4 GiB."""
    for d in shape:
        if d <= 0:
            raise PteError(f"{name}: invalid dimension {d}")
    if math.prod(shape) * itemsize > MAX_ALLOCATION_BYTES:
        raise PteError(f"{name}: allocation exceeds 4GB limit")


def _field(ctx, field):
    """``(getter(frame) -> value, is_literal)`` for an IntOrVid, a FloatOrVid or
    a list of IntOrVid (a missing field raises ``PteError``)."""
    if isinstance(field, list):
        return ctx.ints(field), not any(x.isVid for x in field)
    is_int = not isinstance(field, md.FloatOrVidT)
    if field is not None and not field.isVid:
        value = ctx.static_int(field) if is_int else float(field.literal)
        return (lambda f: value), True
    slot = ctx.int_(field) if is_int else ctx.float_(field)
    return (lambda f: f[slot]), False


def _creator(ctx, n, make, *fields):
    """The closure writing ``make(*fields)`` to ``n.out``; a constant when every
    field is a literal (then ``make``'s errors surface at load)."""
    o = ctx.out(n.out)
    getters, literal = zip(*(_field(ctx, x) for x in fields))
    if all(literal):
        const = make(*(g(None) for g in getters))

        def run_const(f):
            f[o] = const

        return run_const

    def run(f):
        f[o] = make(*[g(f) for g in getters])

    return run


@op("ARangeNode")
def build_arange(n, ctx):
    dtype = None if n.scalarType is None else ctx.dtype(n.scalarType)
    itemsize = 4 if dtype is None else dtype.size

    def make(start, stop, step):
        if step == 0:
            raise PteError("ARangeNode: step must not be zero")
        span = stop - start
        numel = -(-span // step) if span and (span > 0) == (step > 0) else 0
        # The C++ guard rejects an empty range too.
        check_allocation("ARangeNode", [numel], itemsize)
        if dtype is None:
            return mx.arange(start, stop, step)  # int32, MLX's default for ints
        return mx.arange(start, stop, step, dtype=dtype)

    return _creator(ctx, n, make, n.start, n.stop, n.step)


@op("FullNode")
def build_full(n, ctx):
    dtype = ctx.dtype(n.scalarType)

    def make(shape, value):
        check_allocation("FullNode", shape, dtype.size)
        # mx.full ignores dtype for a Python float fill; an array fill keeps it.
        return mx.full(shape, mx.array(value, dtype=dtype))

    return _creator(ctx, n, make, n.shape, n.v)


@op("TriNode")
def build_tri(n, ctx):
    dtype, k = ctx.dtype(n.scalarType), n.k

    def make(rows, cols):
        check_allocation("TriNode", [rows, cols], dtype.size)
        return mx.tri(rows, cols, k, dtype=dtype)

    return _creator(ctx, n, make, n.n, n.m)


@op("FullLikeNode")
def build_full_like(n, ctx):
    x, o = ctx.t(n.x), ctx.out(n.out)
    dtype = None if n.scalarType is None else ctx.dtype(n.scalarType)  # None: x's
    value, _ = _field(ctx, n.v)

    def run(f):
        f[o] = mx.full_like(f[x], value(f), dtype=dtype)

    return run


@op("TrilNode", "TriuNode")
def build_tril_triu(n, ctx):
    fn, k = (mx.tril if ctx.current_node == "TrilNode" else mx.triu), n.k
    return unary(n, ctx, lambda x: fn(x, k))


# -- random bits --------------------------------------------------------------
# MLX's Python API has no random.bits; these give the bits of its RandomBits
# primitive (what the C++ runtime returns for the same key). Its kernel fills
# W words with threefry2x32 hashes: word c < W // 2 is the first hash of the
# counter (c, c + ceil(W / 2)), word c + ceil(W / 2) the second, and an odd
# W's middle word the first hash of (W // 2, 0).

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_BITS_DTYPES = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32}


def _threefry2x32(key, c0, c1):
    ks = (key[0], key[1], key[0] ^ key[1] ^ 0x1BD11BDA)
    x0, x1 = c0 + ks[0], c1 + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = ((x1 << r) | (x1 >> (32 - r))) ^ x0
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + (i + 1)
    return x0, x1


@lru_cache(maxsize=32)
def _odd_counters(half: int) -> tuple[mx.array, mx.array]:
    c0 = np.arange(half + 1, dtype=np.uint32)
    c1 = c0 + np.uint32(half + 1)
    c1[half] = 0
    return mx.array(c0), mx.array(c1)


def random_bits(shape: list[int], width: int, key: mx.array) -> mx.array:
    """MLX's ``random::bits(shape, width, key)``."""
    count = math.prod(shape)
    half, odd = divmod(-(-count * width // 4), 2)
    if odd:
        x0, x1 = _threefry2x32(key, *_odd_counters(half))
        words = mx.concatenate([x0, x1[:half]])
    else:
        # split(key, num) is bits((num, 2)) in MLX's kernel: the same words.
        words = mx.random.split(key, half).reshape(-1)
    return words.view(_BITS_DTYPES[width])[:count].reshape(shape)


def next_global_key() -> mx.array:
    """MLX's ``KeySequence::default_().next()``, which Python does not expose."""
    state = mx.random.state[0]
    mx.random.uniform(shape=(0,))  # the public way to advance the global key by one split
    return mx.random.split(state)[1]


@op("RandomBitsNode")
def build_random_bits(n, ctx):
    width = n.width
    if width not in _BITS_DTYPES:
        raise PteError(f"RandomBitsNode: width must be 1, 2 or 4, got {width}")
    o = ctx.out(n.out)
    seed = None if n.seed is None else ctx.v(n.seed)
    shape, literal = _field(ctx, n.shape)
    if literal:  # check once; 4 bytes (uint32) is the C++ guard's bound
        check_allocation("RandomBitsNode", shape(None), 4)
        dims_of = shape
    else:

        def dims_of(f):
            dims = shape(f)
            check_allocation("RandomBitsNode", dims, 4)
            return dims

    def run(f):
        dims = dims_of(f)
        # An int32 seed widens to uint64 with its sign, as in the C++ runtime.
        key = next_global_key() if seed is None else mx.random.key(f[seed] % 2**64)
        f[o] = random_bits(dims, width, key)

    return run
