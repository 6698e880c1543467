"""Shape and indexing nodes against torch eager."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from opgraph import OpGraph

from llm_executorch_mlx.runtime.pte._schema import mlx_delegate as md
from llm_executorch_mlx.runtime.errors import PteError
from llm_executorch_mlx.runtime.pte.graph import decode_graph, encode_graph
from llm_executorch_mlx.runtime.interp.interpreter import GraphExecutor

INT64_MAX = 2**63 - 1
rng = np.random.default_rng(0)
iov = OpGraph.iov


def ivs(*values):
    return [iov(v) for v in values]


def rand(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def executor_with_values(g: OpGraph, vids) -> GraphExecutor:
    """An executor whose inputs are ``g``'s tensors, then the values ``vids``."""
    graph, constants = g.build()
    for vid in vids:
        slot = md.SlotVariantT()
        slot.idx, slot.slotType = vid.idx, md.SlotType.IntValueSlot
        graph.inputMap.append(slot)
    return GraphExecutor(decode_graph(encode_graph(graph)), constants)


def run_graph(g: OpGraph, tensors, values=()) -> list[np.ndarray]:
    """Run ``g`` on its tensor inputs plus ``(vid, int)`` scalar inputs."""
    ex = executor_with_values(g, [vid for vid, _ in values])
    outs = ex.execute(list(tensors) + [v for _, v in values])
    return [np.array(o) for o in outs]


class Values:
    """Makes dynamic ints: ``v(3)`` is an IntOrVid read from a scalar input."""

    def __init__(self, g: OpGraph):
        self.g, self.pairs = g, []

    def __call__(self, value: int):
        vid = self.g.value()
        self.pairs.append((vid, value))
        return iov(vid)


def run_node(cls, inputs, fields, dynamic=None):
    """One node ``cls(x=inputs[0], ..., out)``; ``fields(g, xs, v)`` gives the rest."""
    g = OpGraph()
    v = Values(g)
    xs = [g.input(a) for a in inputs]
    out = g.temp()
    g.node(cls, out=out, **fields(g, xs, v))
    g.output(out)
    return run_graph(g, inputs, v.pairs)[0]


def close(got, want, rtol=1e-6, atol=1e-6):
    want = want.numpy() if isinstance(want, torch.Tensor) else want
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


# -- one input, fields fixed or dynamic ---------------------------------------

# id, node, fields (v makes a dynamic int), input shape, torch reference
UNARY = [
    ("expand_dims", md.ExpandDimsNodeT, lambda v: dict(axis=1), (2, 3), lambda t: t.unsqueeze(1)),
    ("expand_dims_neg", md.ExpandDimsNodeT, lambda v: dict(axis=-1), (2, 3), lambda t: t.unsqueeze(-1)),
    ("tile", md.TileNodeT, lambda v: dict(reps=ivs(2, 1, 3)), (2, 3, 4), lambda t: t.tile(2, 1, 3)),
    ("tile_dyn", md.TileNodeT, lambda v: dict(reps=[v(2), iov(3)]), (2, 3), lambda t: t.tile(2, 3)),
    ("squeeze_all", md.SqueezeNodeT, lambda v: dict(), (2, 1, 3, 1), lambda t: t.squeeze()),
    ("squeeze_dims", md.SqueezeNodeT, lambda v: dict(dims=[1, 0, -1]), (2, 1, 3, 1),
     lambda t: t.squeeze((1, 0, -1))),
    ("squeeze_non_one_noop", md.SqueezeNodeT, lambda v: dict(dims=[0]), (2, 3), lambda t: t.squeeze(0)),
    ("broadcast_to", md.BroadcastToNodeT, lambda v: dict(shape=ivs(3, 2, 4)), (2, 1),
     lambda t: t.expand(3, 2, 4)),
    ("broadcast_to_minus_one", md.BroadcastToNodeT, lambda v: dict(shape=ivs(4, -1, 3)), (2, 1),
     lambda t: t.expand(4, -1, 3)),
    ("broadcast_to_dyn", md.BroadcastToNodeT, lambda v: dict(shape=[iov(2), v(-1), v(4)]), (3, 1),
     lambda t: t.expand(2, 3, 4)),
    ("pad_constant", md.PadNodeT, lambda v: dict(padWidth=ivs(1, 0, 2, 3), mode="constant",
                                                  constantValue=1.5), (2, 3),
     lambda t: F.pad(t, (2, 3, 1, 0), value=1.5)),
    ("pad_edge", md.PadNodeT, lambda v: dict(padWidth=ivs(0, 0, 1, 2, 2, 1), mode="edge"), (2, 3, 4),
     lambda t: F.pad(t, (2, 1, 1, 2), mode="replicate")),
    ("pad_dyn", md.PadNodeT, lambda v: dict(padWidth=[v(2), iov(1)], mode="constant"), (3,),
     lambda t: F.pad(t, (2, 1))),
    ("reshape", md.ReshapeNodeT, lambda v: dict(shape=ivs(3, -1, 2)), (2, 3, 4),
     lambda t: t.reshape(3, -1, 2)),
    ("reshape_dyn", md.ReshapeNodeT, lambda v: dict(shape=[v(4), iov(-1)]), (2, 3, 4),
     lambda t: t.reshape(4, -1)),
    ("transpose", md.TransposeNodeT, lambda v: dict(perm=[2, 0, 1]), (2, 3, 4),
     lambda t: t.permute(2, 0, 1)),
    ("as_strided", md.AsStridedNodeT, lambda v: dict(shape=ivs(3, 2), strides=ivs(4, 1), offset=2),
     (4, 4), lambda t: t.as_strided((3, 2), (4, 1), 2)),
    ("as_strided_dyn", md.AsStridedNodeT, lambda v: dict(shape=[v(2), iov(3)], strides=[v(1), v(2)]),
     (4, 4), lambda t: t.as_strided((2, 3), (1, 2))),
    ("contiguous", md.ContiguousNodeT, lambda v: dict(), (2, 3), lambda t: t),
    ("slice_step", md.SliceNodeT, lambda v: dict(axis=iov(1), start=iov(1), stop=iov(INT64_MAX), step=2),
     (3, 7), lambda t: t[:, 1::2]),
    ("slice_negative", md.SliceNodeT, lambda v: dict(axis=iov(-1), start=iov(-4), stop=iov(-1)),
     (2, 3, 7), lambda t: t[..., -4:-1]),
    ("slice_clamped", md.SliceNodeT, lambda v: dict(axis=iov(0), start=iov(-100), stop=iov(100)),
     (3, 2), lambda t: t[-100:100]),
    ("slice_dyn", md.SliceNodeT, lambda v: dict(axis=v(-2), start=v(1), stop=v(3)), (2, 5, 3),
     lambda t: t[:, 1:3]),
    ("slice_dyn_start", md.SliceNodeT, lambda v: dict(axis=iov(2), start=v(-3), stop=iov(INT64_MAX)),
     (2, 3, 7), lambda t: t[:, :, -3:]),
    ("roll", md.RollNodeT, lambda v: dict(shift=ivs(1, -2), axes=[0, 2]), (2, 3, 4),
     lambda t: t.roll((1, -2), (0, 2))),
    ("roll_dyn", md.RollNodeT, lambda v: dict(shift=[v(2)], axes=[-1]), (2, 5), lambda t: t.roll(2, -1)),
    ("flip", md.FlipNodeT, lambda v: dict(axes=[0, -1]), (2, 3, 4), lambda t: t.flip((0, -1))),
    ("sort", md.SortNodeT, lambda v: dict(axis=-1), (3, 5), lambda t: t.sort(-1).values),
    ("sort_axis0", md.SortNodeT, lambda v: dict(axis=0), (4, 3), lambda t: t.sort(0).values),
    ("argsort", md.ArgsortNodeT, lambda v: dict(axis=1), (3, 5), lambda t: t.argsort(1)),
    ("repeat", md.RepeatNodeT, lambda v: dict(repeats=iov(2), axis=1), (2, 3),
     lambda t: t.repeat_interleave(2, 1)),
    ("repeat_dyn", md.RepeatNodeT, lambda v: dict(repeats=v(3), axis=-2), (2, 3),
     lambda t: t.repeat_interleave(3, -2)),
]


@pytest.mark.parametrize("cls, fields, shape, ref", [c[1:] for c in UNARY], ids=[c[0] for c in UNARY])
def test_unary(cls, fields, shape, ref):
    x = rand(*shape)
    got = run_node(cls, [x], lambda g, xs, v: dict(x=xs[0], **fields(v)))
    close(got, ref(torch.from_numpy(x)))


def test_dynamic_slice_follows_each_call():
    g = OpGraph()
    v = Values(g)
    x = rand(2, 6)
    xi, out = g.input(x), g.temp()
    g.node(md.SliceNodeT, x=xi, out=out, axis=iov(1), start=v(0), stop=v(0))
    g.output(out)
    ex = executor_with_values(g, [vid for vid, _ in v.pairs])
    for start, stop in [(1, 4), (2, 6), (-2, 6)]:
        close(np.array(ex.execute([x, start, stop])[0]), x[:, start:stop])


# -- several inputs --------------------------------------------------------------


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_take_along_axis(axis):
    x = rand(3, 4, 5)
    idx = rng.integers(0, x.shape[axis], size=(3, 4, 5)).astype(np.int32)
    got = run_node(md.TakeAlongAxisNodeT, [x, idx],
                   lambda g, xs, v: dict(x=xs[0], indices=xs[1], axis=axis))
    close(got, torch.take_along_dim(torch.from_numpy(x), torch.from_numpy(idx).long(), axis))


def take_index(kind, value):
    i = md.IntOrVidOrTidT()
    i.kind = kind
    if kind == 0:
        i.literal = value
    elif kind == 1:
        i.vid = value
    elif kind == 2:
        i.tid = value
    return i


@pytest.mark.parametrize("index, axis", [(2, 1), (-1, -1), (0, 0)])
def test_take_scalar(index, axis):
    x = rand(3, 4, 5)
    want = torch.from_numpy(x).select(axis, index)
    got = run_node(md.TakeNodeT, [x], lambda g, xs, v: dict(x=xs[0], index=take_index(0, index), axis=axis))
    close(got, want)

    def dynamic(g, xs, v):
        return dict(x=xs[0], index=take_index(1, v(index).vid), axis=axis)

    close(run_node(md.TakeNodeT, [x], dynamic), want)


def test_take_tensor_and_out_of_range():
    x, idx = rand(3, 4, 5), np.array([3, 0, 3], np.int32)
    got = run_node(md.TakeNodeT, [x, idx], lambda g, xs, v: dict(x=xs[0], index=take_index(2, xs[1]), axis=1))
    close(got, torch.from_numpy(x).index_select(1, torch.from_numpy(idx)))
    with pytest.raises(PteError, match="TakeNode.*index 4 out of range"):
        run_node(md.TakeNodeT, [x], lambda g, xs, v: dict(x=xs[0], index=take_index(0, 4), axis=1))


def test_gather_multi_index():
    # what aten.index.Tensor with two index tensors exports: x[i0, :, i2]
    x = rand(4, 5, 6)
    i0, i2 = np.array([3, 0, 1], np.int64), np.array([[5], [2]], np.int64)
    got = run_node(md.GatherNodeT, [x, i0, i2], lambda g, xs, v: dict(
        x=xs[0], indices=[xs[1], xs[2]], axes=[0, 2], sliceSizes=[1, 5, 1]))
    want = torch.from_numpy(x)[torch.from_numpy(i0), :, torch.from_numpy(i2)]  # (2, 3, 5)
    close(got, want.reshape(2, 3, 1, 5, 1))


def test_gather_wide_slice():
    x = rand(5, 6)
    i0 = np.array([0, 3], np.int32)
    got = run_node(md.GatherNodeT, [x, i0], lambda g, xs, v: dict(
        x=xs[0], indices=[xs[1]], axes=[0], sliceSizes=[2, 4]))
    t = torch.from_numpy(x)
    close(got, torch.stack([t[i : i + 2, :4] for i in i0]))


@pytest.mark.parametrize("cls, ref", [(md.ConcatenateNodeT, torch.cat), (md.StackNodeT, torch.stack)])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concatenate_stack(cls, ref, axis):
    xs_np = [rand(2, 3, 4) for _ in range(3)]
    got = run_node(cls, xs_np, lambda g, xs, v: dict(tensors=xs, axis=axis))
    close(got, ref([torch.from_numpy(a) for a in xs_np], axis))


def split_graph(x, sizes, n_out, axis):
    g = OpGraph()
    v = Values(g)
    xi = g.input(x)
    outs = [g.temp() for _ in range(n_out)]
    g.node(md.SplitNodeT, x=xi, outs=outs, sizes=sizes(v), axis=axis)
    for o in outs:
        g.output(o)
    return run_graph(g, [x], v.pairs)


@pytest.mark.parametrize("sizes, torch_sizes, axis", [
    (lambda v: ivs(2), 2, 1),
    (lambda v: [v(2)], 2, -1),
    (lambda v: ivs(1, 3, 1), [1, 3, 1], 1),
    (lambda v: [iov(2), v(3)], [2, 3], 1),
    (lambda v: ivs(3), 3, 0),
])
def test_split(sizes, torch_sizes, axis):
    x = rand(3, 5)
    want = torch.from_numpy(x).split(torch_sizes, axis)
    got = split_graph(x, sizes, len(want), axis)
    for a, b in zip(got, want):
        close(a, b)


def test_split_output_count_mismatch():
    with pytest.raises(PteError, match="SplitNode: 3 chunks for 2 outputs"):
        split_graph(rand(3, 5), lambda v: ivs(2), 2, 1)
    with pytest.raises(PteError, match="SplitNode: 3 sizes for 2 outputs"):
        split_graph(rand(3, 5), lambda v: ivs(1, 1, 3), 2, 1)


# -- updates -------------------------------------------------------------------


def torch_slice_update(dst, upd, axis, start, stop, step):
    y = torch.from_numpy(dst).clone()
    index = [slice(None)] * y.ndim
    index[axis] = slice(start, stop, step)
    y[tuple(index)] = torch.from_numpy(upd)
    return y


@pytest.mark.parametrize("axis, start, stop, step, upd_shape", [
    (1, 1, 5, 2, (4, 2)),
    (-1, -3, INT64_MAX, 1, (4, 3)),
    (0, 1, 3, 1, (1,)),  # broadcast update
    (1, 2, 2, 1, (4, 0)),  # empty range: dst unchanged
    (0, -100, 100, 1, (4, 6)),  # clamped to the whole axis
])
@pytest.mark.parametrize("dynamic", [False, True])
def test_slice_update(axis, start, stop, step, upd_shape, dynamic):
    dst, upd = rand(4, 6), rand(*upd_shape)

    def fields(g, xs, v):
        val = v if dynamic else iov
        return dict(dst=xs[0], update=xs[1], axis=val(axis), start=val(start), stop=val(stop), step=step)

    got = run_node(md.SliceUpdateNodeT, [dst, upd], fields)
    close(got, torch_slice_update(dst, upd, axis, start, stop, step))


def test_slice_update_in_place_leaves_other_readers_alone():
    # out == dst on a temp, and the input it was copied from still reads the same
    x, upd = rand(3, 4), rand(3, 1)
    g = OpGraph()
    xi, ui = g.input(x), g.input(upd)
    buf, before = g.temp(), g.temp()
    g.node(md.ContiguousNodeT, x=xi, out=buf)
    g.node(md.SliceUpdateNodeT, dst=buf, update=ui, out=buf, axis=iov(1), start=iov(2), stop=iov(3))
    g.node(md.SliceUpdateNodeT, dst=xi, update=ui, out=before, axis=iov(1), start=iov(0), stop=iov(1))
    g.output(buf)
    g.output(xi)
    got, x_after = run_graph(g, [x, upd])
    close(got, torch_slice_update(x, upd, 1, 2, 3, 1))
    close(x_after, x)


@pytest.mark.parametrize("indices, axis", [
    ([4, 0, 1], 0),  # runs [4], [0, 1]
    ([-1, 1], 1),
    ([2, 3, 4], 0),  # one run: a single slice update
    ([], 0),
])
def test_index_copy(indices, axis):
    dst = rand(5, 3)
    shape = list(dst.shape)
    shape[axis] = len(indices)
    upd, idx = rand(*shape), np.array(indices, np.int64)
    got = run_node(md.IndexCopyNodeT, [dst, upd, idx],
                   lambda g, xs, v: dict(dst=xs[0], update=xs[1], indices=xs[2], axis=axis))
    positions = torch.from_numpy(idx) % dst.shape[axis]
    want = torch.from_numpy(dst).index_copy(axis, positions, torch.from_numpy(upd))
    close(got, want)


def test_index_copy_repeated_positions_last_write_wins():
    dst, upd, idx = rand(4, 2), rand(3, 2), np.array([1, 2, 1], np.int64)
    got = run_node(md.IndexCopyNodeT, [dst, upd, idx],
                   lambda g, xs, v: dict(dst=xs[0], update=xs[1], indices=xs[2], axis=0))
    want = dst.copy()
    want[[1, 2]] = upd[:2]
    want[1] = upd[2]
    close(got, want)


@pytest.mark.parametrize("idx, match", [
    (np.array([5], np.int64), "IndexCopyNode: index 5 out of range"),
    (np.array([1], np.int32), "IndexCopyNode: expected int64 indices"),
])
def test_index_copy_bad_indices(idx, match):
    with pytest.raises(PteError, match=match):
        run_node(md.IndexCopyNodeT, [rand(5, 3), rand(1, 3), idx],
                 lambda g, xs, v: dict(dst=xs[0], update=xs[1], indices=xs[2], axis=0))


@pytest.mark.parametrize("axis, idx_shape", [(1, (3, 4)), (0, (5, 5)), (-1, (3, 2))])
def test_scatter_add(axis, idx_shape):
    x = rand(3, 5)
    idx = rng.integers(0, x.shape[axis], size=idx_shape).astype(np.int64)  # with repeats
    src = rand(*idx_shape)
    got = run_node(md.ScatterAddNodeT, [x, idx, src],
                   lambda g, xs, v: dict(x=xs[0], indices=xs[1], updates=xs[2], axis=axis))
    want = torch.from_numpy(x).scatter_add(axis, torch.from_numpy(idx), torch.from_numpy(src))
    close(got, want)


# -- partitions -------------------------------------------------------------------


@pytest.mark.parametrize("cls", [md.PartitionNodeT, md.ArgPartitionNodeT])
@pytest.mark.parametrize("kth, axis, dynamic", [(2, -1, False), (0, 0, True), (4, 1, False)])
def test_partition(cls, kth, axis, dynamic):
    x = rand(5, 6)
    got = run_node(cls, [x], lambda g, xs, v: dict(x=xs[0], kth=(v if dynamic else iov)(kth), axis=axis))
    t = torch.from_numpy(x)
    if cls is md.ArgPartitionNodeT:
        got = torch.take_along_dim(t, torch.from_numpy(got.astype(np.int64)), axis).numpy()
    got_t = torch.from_numpy(got).movedim(axis, -1)
    pivot = torch.from_numpy(x).sort(axis).values.movedim(axis, -1)[..., kth : kth + 1]
    close(got_t[..., kth : kth + 1].numpy(), pivot)
    assert (got_t[..., :kth] <= pivot).all() and (got_t[..., kth + 1 :] >= pivot).all()
    close(got_t.sort(-1).values.numpy(), t.movedim(axis, -1).sort(-1).values)


# -- invalid programs ------------------------------------------------------------


def build_one(cls, shape=(2, 3), **fields):
    g = OpGraph()
    x, out = g.input(rand(*shape)), g.temp()
    g.node(cls, x=x, out=out, **fields)
    g.output(out)
    g.executor()


def stray_tid(idx):
    t = md.TidT()
    t.idx = idx
    return t


@pytest.mark.parametrize("cls, fields, match", [
    (md.SliceNodeT, dict(axis=iov(0), start=iov(0), stop=iov(1), step=0), "SliceNode: step must not be 0"),
    (md.PadNodeT, dict(padWidth=ivs(1, 1, 1, 1), mode="reflect"), "PadNode: unsupported pad mode 'reflect'"),
    (md.PadNodeT, dict(padWidth=ivs(1, 1, 1), mode="constant"), "PadNode: pad_width has odd length 3"),
    (md.RollNodeT, dict(shift=ivs(1, 2), axes=[0]), "RollNode: 2 shifts for 1 axes"),
    (md.RepeatNodeT, dict(repeats=iov(-1), axis=0), "RepeatNode: repeats must be non-negative"),
    (md.GatherNodeT, dict(indices=[], axes=[0], sliceSizes=[1, 3]), "GatherNode: 0 index tensors for 1 axes"),
    (md.TakeNodeT, dict(index=take_index(3, 0)), "TakeNode: invalid index kind 3"),
])
def test_invalid_fields_fail_at_build(cls, fields, match):
    with pytest.raises(PteError, match=match):
        build_one(cls, **fields)


def test_out_of_range_slot_fails_at_build():
    g = OpGraph()
    out = g.temp()
    g.node(md.ExpandDimsNodeT, x=stray_tid(99), out=out, axis=0)
    g.output(out)
    with pytest.raises(PteError, match="ExpandDimsNode: tensor slot 99 out of range"):
        g.executor()


def test_slice_update_bad_step_and_split_size_fail_at_build():
    g = OpGraph()
    x, out = g.input(rand(2, 3)), g.temp()
    g.node(md.SliceUpdateNodeT, dst=x, update=x, out=out, axis=iov(0), start=iov(0), stop=iov(1), step=0)
    g.output(out)
    with pytest.raises(PteError, match="SliceUpdateNode: step must be >= 1"):
        g.executor()
    with pytest.raises(PteError, match="SplitNode: split size must be positive"):
        split_graph(rand(3, 5), lambda v: ivs(0), 1, 1)



def test_transpose_of_a_weight_is_made_once_and_shared_by_every_call():
    w = rand(3, 5)
    g = OpGraph()
    wt = g.temp()
    g.node(md.TransposeNodeT, x=g.constant(w), out=wt, perm=[1, 0])
    g.output(wt)
    ex = g.executor()
    first, second = (ex.execute([])[0] for _ in range(2))
    assert first is second  # the same evaluated view, no op per call
    close(first, w.T)
    assert "TransposeNode" not in ex.node_names  # in the frame every call starts from


def test_transpose_of_a_weight_into_a_slot_another_node_writes_is_set_by_each_call():
    # a slot shared with a later node (slot reuse): the frame may not start
    # with the view, or a reader before the later writer would miss it
    w, x = rand(3, 5), rand(5, 3)
    g = OpGraph()
    xin, wt, summed = g.input(x), g.temp(), g.temp()
    g.node(md.TransposeNodeT, x=g.constant(w), out=wt, perm=[1, 0])
    g.node(md.AddNodeT, a=xin, b=wt, out=summed)
    g.node(md.AddNodeT, a=summed, b=summed, out=wt)  # wt's slot reused
    g.output(summed)
    g.output(wt)
    ex = g.executor()
    assert ex.node_names.count("TransposeNode") == 1
    for _ in range(2):
        s, doubled = ex.execute([x])
        close(s, x + w.T)
        close(doubled, 2 * (x + w.T))


def test_transpose_of_a_constant_an_init_chain_writes_sees_the_written_value():
    w = rand(3, 5)
    g = OpGraph()
    c, wt = g.constant(w), g.temp()
    init = g.new_chain()
    g.node(md.AddNodeT, chain=init, a=c, b=c, out=c)  # init doubles the constant
    g.node(md.TransposeNodeT, x=c, out=wt, perm=[1, 0])
    g.output(wt)
    ex = g.executor(init_chain=init)
    close(ex.execute([])[0], 2 * w.T)
