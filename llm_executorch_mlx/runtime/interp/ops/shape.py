"""Shape and indexing nodes: views, slices, gathers, scatters, sorts.

Semantics follow ExecuTorch's MLX interpreter (``exec_<name>`` in
MLXInterpreter.h). MLX's Python API has no strided ``slice``/``slice_update``,
``gather`` or ``scatter_add_axis``; indexing with slices reaches the same C++
ops, and gathers/scatters are spelled with index grids.
"""

from __future__ import annotations

from itertools import accumulate

import mlx.core as mx

from ...errors import PteError
from ..int32 import clamp_int32
from .table import op

_ALL = slice(None)


# -- helpers (int_list and text serve the other op modules too) --------------


def int_list(values) -> list[int]:
    """A schema int vector (decoded as a numpy array, or absent) as Python ints."""
    return [] if values is None else [int(v) for v in values]


def text(value) -> str:
    """A schema string (decoded as bytes) as ``str``."""
    return value.decode() if isinstance(value, bytes) else value or ""


def _static_ints(ctx, iovs) -> list[int] | None:
    """The literals of an ``IntOrVid`` list, or None when any is dynamic."""
    values = [ctx.static_int(x) for x in iovs or []]
    return None if None in values else values


def _normalize_axis(axis: int, rank: int, what: str) -> int:
    if not -rank <= axis < rank:
        raise PteError(f"{what}: axis {axis} out of range for {rank} dimensions")
    return axis + rank if axis < 0 else axis


# More dimensions than any array has (MLX's shapes are int32 vectors, but an
# axis this far out is a corrupt file, and `(_ALL,) * axis` would exhaust memory).
_MAX_AXIS = 64


def _axis_key(axis: int, node: str) -> tuple[tuple, tuple]:
    """Index pieces ``head, tail`` that put a slice at ``axis`` (negative from
    the end): ``a[head + (s,) + tail]``; MLX rejects an axis past the rank."""
    if not -_MAX_AXIS <= axis < _MAX_AXIS:
        raise PteError(f"{node}: axis {axis} is out of range for any tensor")
    if axis >= 0:
        return (_ALL,) * axis, ()
    return (Ellipsis,), (_ALL,) * (-axis - 1)


def _unary(n, ctx, fn, *args):
    x, out = ctx.t(n.x), ctx.out(n.out)

    def run(f):
        f[out] = fn(f[x], *args)

    return run


def _with_ints(n, ctx, iovs, fn):
    """``out = fn(x, ints)``, the ints fixed at load when all are literal."""
    x, out = ctx.t(n.x), ctx.out(n.out)
    const = _static_ints(ctx, iovs)
    if const is not None:

        def run(f):
            f[out] = fn(f[x], const)

    else:
        get = ctx.ints(iovs)

        def run(f):
            f[out] = fn(f[x], get(f))

    return run


# -- views and reshapes --------------------------------------------------------


@op("ExpandDimsNode")
def build_expand_dims(n, ctx):
    return _unary(n, ctx, mx.expand_dims, n.axis)


@op("TransposeNode")
def build_transpose(n, ctx):
    perm = int_list(n.perm)
    weight = ctx.fixed_constant(ctx.t(n.x))
    if weight is None:
        return _unary(n, ctx, mx.transpose, perm)
    # A weight's transpose (every linear layer has one) is a view made once
    # here, not an op in every call's graph: in the frame every call starts
    # from, or set by a run where another node shares its slot.
    try:
        view = mx.transpose(weight, perm)
    except ValueError as e:
        raise PteError(f"{ctx.current_node}: {e}") from None
    mx.eval(view)
    out = ctx.out(n.out)
    if ctx.preset(out, view):
        return None

    def run(f):
        f[out] = view

    return run


@op("ContiguousNode")
def build_contiguous(n, ctx):
    return _unary(n, ctx, mx.contiguous, False)


@op("FlipNode")
def build_flip(n, ctx):
    return _unary(n, ctx, mx.flip, int_list(n.axes))


@op("ReshapeNode")
def build_reshape(n, ctx):
    return _with_ints(n, ctx, n.shape, mx.reshape)  # MLX infers a -1 itself


@op("TileNode")
def build_tile(n, ctx):
    return _with_ints(n, ctx, n.reps, mx.tile)


@op("BroadcastToNode")
def build_broadcast_to(n, ctx):
    const = _static_ints(ctx, n.shape)
    if const is not None and -1 not in const:
        return _with_ints(n, ctx, n.shape, mx.broadcast_to)

    def keep_minus_one(x, shape):
        # torch expand: -1 keeps the input's size, dims aligned from the right
        lead = len(shape) - x.ndim
        shape = [
            x.shape[i - lead] if s == -1 and 0 <= i - lead < x.ndim else s
            for i, s in enumerate(shape)
        ]
        return mx.broadcast_to(x, shape)

    return _with_ints(n, ctx, n.shape, keep_minus_one)


@op("SqueezeNode")
def build_squeeze(n, ctx):
    dims = int_list(n.dims)
    if not dims:
        return _unary(n, ctx, mx.squeeze)

    def squeeze_ones(x):
        # torch: squeezing a dim that is not 1 is a no-op, not an error
        rank = x.ndim
        ones = [d for d in dims if -rank <= d < rank and x.shape[d] == 1]
        return mx.squeeze(x, ones) if ones else x

    return _unary(n, ctx, squeeze_ones)


@op("AsStridedNode")
def build_as_strided(n, ctx):
    x, out = ctx.t(n.x), ctx.out(n.out)
    shape, strides, offset = ctx.ints(n.shape), ctx.ints(n.strides), int(n.offset)

    def run(f):
        f[out] = mx.as_strided(f[x], shape(f), strides(f), offset)

    return run


@op("PadNode")
def build_pad(n, ctx):
    mode = text(n.mode)
    if mode not in ("constant", "edge"):
        raise PteError(f"{ctx.current_node}: unsupported pad mode {mode!r}")
    widths = n.padWidth or []
    if len(widths) % 2:
        raise PteError(f"{ctx.current_node}: pad_width has odd length {len(widths)}")
    # a float32 scalar, cast to x's dtype by MLX (as ExecuTorch does)
    value = mx.array(float(n.constantValue) if mode == "constant" else 0.0)

    def pad(x, flat):
        return mx.pad(x, list(zip(flat[::2], flat[1::2])), mode, value)

    const = _static_ints(ctx, widths)
    if const is None:
        return _with_ints(n, ctx, widths, pad)
    pairs = list(zip(const[::2], const[1::2]))
    return _unary(n, ctx, lambda x: mx.pad(x, pairs, mode, value))


# -- slicing ---------------------------------------------------------------


@op("SliceNode")
def build_slice(n, ctx):
    if n.step == 0:
        raise PteError(f"{ctx.current_node}: step must not be 0")
    x, out, step = ctx.t(n.x), ctx.out(n.out), n.step
    axis, start, stop = (ctx.static_int(v) for v in (n.axis, n.start, n.stop))
    if None not in (axis, start, stop):
        head, tail = _axis_key(axis, ctx.current_node)
        key = head + (slice(start, stop, step),) + tail

        def run(f):
            f[out] = f[x][key]

        return run

    axis, start, stop = ctx.int_(n.axis), ctx.int_(n.start), ctx.int_(n.stop)
    name = ctx.current_node

    def run(f):
        head, tail = _axis_key(f[axis], name)
        f[out] = f[x][head + (slice(f[start], f[stop], step),) + tail]

    return run


@op("SliceUpdateNode")
def build_slice_update(n, ctx):
    if n.step < 1:
        raise PteError(f"{ctx.current_node}: step must be >= 1, got {n.step}")
    name, step = ctx.current_node, n.step
    dst, upd, out = ctx.t(n.dst), ctx.t(n.update), ctx.out(n.out)
    axis, start, stop = ctx.int_(n.axis), ctx.int_(n.start), ctx.int_(n.stop)

    def run(f):
        d = f[dst]
        ax = _normalize_axis(f[axis], d.ndim, name)
        size = d.shape[ax]
        lo, hi = f[start], f[stop]
        lo = min(max(lo + size if lo < 0 else lo, 0), size)
        hi = min(max(hi + size if hi < 0 else hi, 0), size)
        if lo == hi:
            f[out] = d
            return
        y = mx.array(d)  # a new handle: assignment rebinds it, not d
        y[(_ALL,) * ax + (slice(lo, hi, step),)] = f[upd]
        f[out] = y

    return run


@op("IndexCopyNode")
def build_index_copy(n, ctx):
    name, axis = ctx.current_node, n.axis
    dst, upd, indices, out = ctx.t(n.dst), ctx.t(n.update), ctx.t(n.indices), ctx.out(n.out)

    def run(f):
        d, u, ix = f[dst], f[upd], f[indices]
        if ix.ndim != 1:
            raise PteError(f"{name}: indices must be 1D, got shape {tuple(ix.shape)}")
        if ix.dtype != mx.int64:
            raise PteError(f"{name}: expected int64 indices, got {ix.dtype}")
        ax = _normalize_axis(axis, d.ndim, name)
        size = d.shape[ax]
        pos = []
        for i in ix.tolist():  # a host read, as in ExecuTorch
            j = i + size if i < 0 else i
            if not 0 <= j < size:
                raise PteError(f"{name}: index {i} out of range for axis {ax} of size {size}")
            pos.append(j)
        # Each run of consecutive positions becomes one slice update; later
        # runs win where positions repeat.
        head, y, i = (_ALL,) * ax, mx.array(d), 0
        while i < len(pos):
            j = i + 1
            while j < len(pos) and pos[j] == pos[i] + (j - i):
                j += 1
            part = u if i == 0 and j == u.shape[ax] else u[head + (slice(i, j),)]
            y[head + (slice(pos[i], pos[j - 1] + 1),)] = part
            i = j
        f[out] = y

    return run


@op("SplitNode")
def build_split(n, ctx):
    name, axis = ctx.current_node, n.axis
    x = ctx.t(n.x)
    outs = [ctx.out(t) for t in n.outs or []]
    sizes = n.sizes or []
    if not sizes:
        raise PteError(f"{name}: sizes is empty")

    def emit(f, parts):
        if len(parts) != len(outs):
            raise PteError(f"{name}: {len(parts)} chunks for {len(outs)} outputs")
        for o, p in zip(outs, parts):
            f[o] = p

    if len(sizes) == 1:  # one size: chunks of that size, the last maybe shorter
        chunk, const = ctx.int_(sizes[0]), ctx.static_int(sizes[0])
        if const is not None and const <= 0:
            raise PteError(f"{name}: split size must be positive, got {const}")

        def run(f):
            a, s = f[x], f[chunk]
            if s <= 0:
                raise PteError(f"{name}: split size must be positive, got {s}")
            emit(f, mx.split(a, list(range(s, a.shape[axis], s)), axis))

        return run

    if len(sizes) != len(outs):
        raise PteError(f"{name}: {len(sizes)} sizes for {len(outs)} outputs")
    const = _static_ints(ctx, sizes)
    if const is not None:
        cuts = list(accumulate(const[:-1]))

        def run(f):
            emit(f, mx.split(f[x], cuts, axis))

        return run
    get = ctx.ints(sizes)

    def run(f):
        emit(f, mx.split(f[x], list(accumulate(get(f)[:-1])), axis))

    return run


# -- taking and gathering ------------------------------------------------------


@op("TakeAlongAxisNode")
def build_take_along_axis(n, ctx):
    x, idx, out, axis = ctx.t(n.x), ctx.t(n.indices), ctx.out(n.out), n.axis

    def run(f):
        f[out] = mx.take_along_axis(f[x], f[idx], axis)

    return run


@op("TakeNode")
def build_take(n, ctx):
    name, axis, x, out = ctx.current_node, n.axis, ctx.t(n.x), ctx.out(n.out)
    index = n.index
    if index is None:
        raise PteError(f"{name}: index is missing")
    if index.kind == 2:
        idx = ctx.t(index.tid)
        # a bf16 program computing in fp32 may hold its tied embedding's table
        # in bf16 (program.py): the rows it gathers are widened
        widened = ctx.dtype_map.get(mx.bfloat16, mx.bfloat16) == mx.float32

        def run(f):
            a = f[x]
            rows = mx.take(a, f[idx], _normalize_axis(axis, a.ndim, name))
            f[out] = rows.astype(mx.float32) if widened and rows.dtype == mx.bfloat16 else rows

        return run
    if index.kind == 1:
        slot = ctx.v(index.vid)
    elif index.kind == 0:
        slot = ctx.literal(clamp_int32(index.literal))
    else:
        raise PteError(f"{name}: invalid index kind {index.kind}")

    def run(f):
        a, i = f[x], f[slot]
        ax = _normalize_axis(axis, a.ndim, name)
        size = a.shape[ax]
        if not -size <= i < size:
            raise PteError(f"{name}: index {i} out of range for a dimension of size {size}")
        f[out] = mx.take(a, i + size if i < 0 else i, ax)

    return run


@op("GatherNode")
def build_gather(n, ctx):
    name = ctx.current_node
    x, out = ctx.t(n.x), ctx.out(n.out)
    indices = [ctx.t(t) for t in n.indices or []]
    axes, sizes = int_list(n.axes), int_list(n.sliceSizes)
    rank = len(sizes)
    if len(indices) != len(axes):
        raise PteError(f"{name}: {len(indices)} index tensors for {len(axes)} axes")
    if len(set(axes)) != len(axes) or any(not 0 <= a < rank for a in axes):
        raise PteError(f"{name}: axes {axes} invalid for slice_sizes of rank {rank}")
    if any(s <= 0 for s in sizes):
        raise PteError(f"{name}: slice_sizes {sizes} must be positive")
    which = {a: k for k, a in enumerate(axes)}
    ranges = [mx.arange(s) for s in sizes]

    def run(f):
        # out[i..., s...] = x[idx_a[i...] + s_a on indexed axes a, s_d elsewhere]
        a = f[x]
        if a.ndim != rank:
            raise PteError(f"{name}: slice_sizes has {rank} entries, input has {a.ndim} dims")
        idx = mx.broadcast_arrays(*(f[i] for i in indices)) if indices else []
        lead = idx[0].ndim if idx else 0
        grid = []
        for d, r in enumerate(ranges):
            r = r.reshape((1,) * (lead + d) + (-1,) + (1,) * (rank - d - 1))
            k = which.get(d)
            grid.append(r if k is None else idx[k].reshape(idx[k].shape + (1,) * rank) + r)
        f[out] = a[tuple(grid)]

    return run


@op("ScatterAddNode")
def build_scatter_add(n, ctx):
    name, axis = ctx.current_node, n.axis
    x, idx, upd, out = ctx.t(n.x), ctx.t(n.indices), ctx.t(n.updates), ctx.out(n.out)

    def run(f):
        # MLX's scatter_add_axis, spelled as a scatter-add over a full index
        # grid: indices and updates broadcast together, then with the input
        # on every axis but ``axis``.
        a, i, u = f[x], f[idx], f[upd].astype(f[x].dtype)
        ax = _normalize_axis(axis, a.ndim, name)
        if i.ndim != a.ndim:
            raise PteError(f"{name}: indices have {i.ndim} dims, input has {a.ndim}")
        if u.ndim > i.ndim:
            u = mx.squeeze(u, list(range(u.ndim - i.ndim)))
        i, u = mx.broadcast_arrays(i, u)
        a_shape, shape = list(a.shape), list(i.shape)
        for d in range(a.ndim):
            if d != ax and a_shape[d] != shape[d]:
                if 1 not in (a_shape[d], shape[d]):
                    raise PteError(f"{name}: indices {shape} do not broadcast with input {a_shape}")
                a_shape[d] = shape[d] = max(a_shape[d], shape[d])
        a, i, u = mx.broadcast_to(a, a_shape), mx.broadcast_to(i, shape), mx.broadcast_to(u, shape)
        grid = tuple(
            i if d == ax else mx.arange(s).reshape((-1,) + (1,) * (a.ndim - d - 1))
            for d, s in enumerate(shape)
        )
        f[out] = a.at[grid].add(u)

    return run


# -- joining and repeating ----------------------------------------------------


def _joiner(fn):
    def build(n, ctx):
        tensors, out, axis = [ctx.t(t) for t in n.tensors or []], ctx.out(n.out), n.axis

        def run(f):
            f[out] = fn([f[t] for t in tensors], axis)

        return run

    return build


op("ConcatenateNode")(_joiner(mx.concatenate))
op("StackNode")(_joiner(mx.stack))


@op("RepeatNode")
def build_repeat(n, ctx):
    name, axis = ctx.current_node, n.axis
    x, out, reps = ctx.t(n.x), ctx.out(n.out), ctx.int_(n.repeats)
    const = ctx.static_int(n.repeats)
    if const is not None and const < 0:
        raise PteError(f"{name}: repeats must be non-negative, got {const}")

    def run(f):
        r = f[reps]
        if r < 0:
            raise PteError(f"{name}: repeats must be non-negative, got {r}")
        f[out] = mx.repeat(f[x], r, axis)

    return run


@op("RollNode")
def build_roll(n, ctx):
    axes = tuple(int_list(n.axes))
    if len(axes) != len(n.shift or []):
        raise PteError(f"{ctx.current_node}: {len(n.shift or [])} shifts for {len(axes)} axes")
    return _with_ints(n, ctx, n.shift, lambda x, shift: mx.roll(x, tuple(shift), axes))


# -- sorting ---------------------------------------------------------------


@op("SortNode")
def build_sort(n, ctx):
    return _unary(n, ctx, mx.sort, n.axis)


@op("ArgsortNode")
def build_argsort(n, ctx):
    return _unary(n, ctx, mx.argsort, n.axis)


def _partitioner(fn):
    def build(n, ctx):
        x, out, kth, axis = ctx.t(n.x), ctx.out(n.out), ctx.int_(n.kth), n.axis

        def run(f):
            f[out] = fn(f[x], f[kth], axis)

        return run

    return build


op("PartitionNode")(_partitioner(mx.partition))
op("ArgPartitionNode")(_partitioner(mx.argpartition))
