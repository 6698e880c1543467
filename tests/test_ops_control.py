"""If, Scan and MetalKernel nodes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from opgraph import OpGraph
from test_ops_shape import Values, close, executor_with_values, iov, rand, run_graph

from llm_executorch_mlx.runtime.pte._schema import mlx_delegate as md
from llm_executorch_mlx.runtime.errors import PteError, UnsupportedNodeError

T = torch.from_numpy


def if_graph(cond):
    """``out = flip(x) if cond else x.T``; ``cond(v)`` gives the IntOrVid."""
    g = OpGraph()
    v = Values(g)
    x, out = g.input(rand(3, 3)), g.temp()
    then_chain, else_chain = g.new_chain(), g.new_chain()
    g.node(md.FlipNodeT, chain=then_chain, x=x, out=out, axes=[0])
    g.node(md.TransposeNodeT, chain=else_chain, x=x, out=out, perm=[1, 0])
    g.node(md.IfNodeT, cond=cond(v), thenChainIdx=then_chain, elseChainIdx=else_chain)
    g.output(out)
    return g, v


def test_if_dynamic_condition_picks_a_branch_per_call():
    g, v = if_graph(lambda v: v(0))
    ex = executor_with_values(g, [vid for vid, _ in v.pairs])
    x = rand(3, 3)
    for cond in (1, 0, -3, 0):
        (got,) = ex.execute([x, cond])
        close(np.array(got), T(x).flip(0) if cond else T(x).T)


@pytest.mark.parametrize("cond", [0, 2])
def test_if_literal_condition(cond):
    g, _ = if_graph(lambda v: iov(cond))
    x = rand(3, 3)
    (got,) = run_graph(g, [x])
    close(got, T(x).flip(0) if cond else T(x).T)


def test_if_chain_out_of_range_fails_at_build():
    g = OpGraph()
    g.node(md.IfNodeT, cond=iov(1), thenChainIdx=7, elseChainIdx=0)
    with pytest.raises(PteError, match="IfNode: instruction chain 7 out of range"):
        g.executor()


def test_scan_carries_a_running_sum():
    # h_t = h_{t-1} + x[:, t]; the outputs stack each h_t along the scan axis
    xs, h0 = rand(2, 5, 3), rand(2, 3)
    g = OpGraph()
    x, h = g.input(xs), g.input(h0)
    carry, step, ys = g.temp(), g.temp(), g.temp()
    body = g.new_chain()
    g.node(md.AddNodeT, chain=body, a=carry, b=step, out=carry)
    g.node(md.IdCopyNodeT, chain=body, x=carry, out=ys)
    g.node(md.IdCopyNodeT, x=h, out=carry)
    g.node(md.ScanNodeT, originals=[x], sliced=[step], outputs=[ys], carry=[carry],
           bodyChainIdx=body, scanAxis=1)
    g.output(ys)
    g.output(carry)
    got_ys, got_h = run_graph(g, [xs, h0])
    want = T(h0)[:, None] + T(xs).cumsum(1)
    close(got_ys, want, rtol=1e-5, atol=1e-5)
    close(got_h, want[:, -1], rtol=1e-5, atol=1e-5)


def test_scan_two_sequences_on_axis_0():
    a_np, b_np = rand(4, 2, 3), rand(4, 3, 2)
    g = OpGraph()
    a, b = g.input(a_np), g.input(b_np)
    a_t, b_t, out1, out2 = g.temp(), g.temp(), g.temp(), g.temp()
    body = g.new_chain()
    g.node(md.TransposeNodeT, chain=body, x=b_t, out=out1, perm=[1, 0])
    g.node(md.FlipNodeT, chain=body, x=a_t, out=out2, axes=[-1])
    g.node(md.ScanNodeT, originals=[a, b], sliced=[a_t, b_t], outputs=[out1, out2], carry=[],
           bodyChainIdx=body, scanAxis=0)
    g.output(out1)
    g.output(out2)
    got1, got2 = run_graph(g, [a_np, b_np])
    close(got1, T(b_np).transpose(1, 2))
    close(got2, T(a_np).flip(-1))


def test_scan_needs_matching_sliced_slots():
    g = OpGraph()
    x, body = g.input(rand(2, 3)), g.new_chain()
    g.node(md.ScanNodeT, originals=[x], sliced=[], outputs=[], carry=[], bodyChainIdx=body)
    with pytest.raises(PteError, match="ScanNode: needs as many sliced slots"):
        g.executor()


def test_metal_kernel_is_unsupported_and_named():
    g = OpGraph()
    x, out = g.input(rand(4)), g.temp()
    g.node(md.MetalKernelNodeT, name="tq_dequant", source="out[0] = inp[0];", inputs=[x],
           outputs=[out], grid=[iov(1)] * 3, threadgroup=[iov(1)] * 3)
    g.output(out)
    with pytest.raises(UnsupportedNodeError, match="MetalKernelNode 'tq_dequant' runs custom Metal code"):
        g.executor()
