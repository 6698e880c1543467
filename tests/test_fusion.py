"""The load-time rewrites: Hugging Face's rotate-half RoPE into mx.fast.rope,
silu times up into one SwiGLU, a residual add into the product before it.

A hand-built program spells RoPE the way transformers' exports do; fused or
not, it must compute the rotate-half formula (numpy reference), and it is
fused only when nothing else reads the group's intermediates. The exported
models' parity tests (test_parity.py) cover the same rewrite end to end.
"""

import mlx.core as mx
import numpy as np
import pytest

from llm_executorch_mlx.runtime import cpu
from llm_executorch_mlx.runtime.pte._schema import mlx_delegate as md
from opgraph import OpGraph

H, T, D = 3, 5, 8
BASE = 10000.0


def reference(x, positions, inv_freq, scale):
    angles = positions[:, None] * inv_freq[None, :]
    emb = np.concatenate([angles, angles], axis=-1)
    cos, sin = np.cos(emb) * scale, np.sin(emb) * scale
    rotated = np.concatenate([-x[..., D // 2 :], x[..., : D // 2]], axis=-1)
    return x * cos + rotated * sin


def rope_program(x, positions, inv_freq, scale, read_intermediate=False):
    g = OpGraph()
    xs, pos = g.input(x), g.input(positions)
    inv, sc = g.constant(inv_freq), g.constant(np.array(scale, np.float32))
    p1, p2, pf, m, e, c, s, c4, s4 = (g.temp() for _ in range(9))
    g.node(md.ExpandDimsNodeT, x=pos, out=p1, axis=0)
    g.node(md.ExpandDimsNodeT, x=p1, out=p2, axis=2)
    g.node(md.AsTypeNodeT, x=p2, out=pf, scalarType=6)
    g.node(md.MultiplyNodeT, a=pf, b=inv, out=m)
    g.node(md.ConcatenateNodeT, tensors=[m, m], out=e, axis=-1)
    g.node(md.CosNodeT, x=e, out=c)
    g.node(md.MultiplyNodeT, a=c, b=sc, out=c)
    g.node(md.SinNodeT, x=e, out=s)
    g.node(md.MultiplyNodeT, a=s, b=sc, out=s)
    g.node(md.ExpandDimsNodeT, x=c, out=c4, axis=1)
    g.node(md.ExpandDimsNodeT, x=s, out=s4, axis=1)
    a, x1, x2, r, b, y = (g.temp() for _ in range(6))
    g.node(md.MultiplyNodeT, a=xs, b=c4, out=a)
    g.node(md.SliceNodeT, x=xs, out=x1, axis=g.iov(3), start=g.iov(0), stop=g.iov(D // 2), step=1)
    g.node(md.SliceNodeT, x=xs, out=x2, axis=g.iov(3), start=g.iov(D // 2), stop=g.iov(2**63 - 1), step=1)
    g.node(md.NegNodeT, x=x2, out=x2)
    g.node(md.ConcatenateNodeT, tensors=[x2, x1], out=r, axis=-1)
    g.node(md.MultiplyNodeT, a=r, b=s4, out=b)
    g.node(md.AddNodeT, a=a, b=b, out=y)
    g.output(y)
    if read_intermediate:  # a later node still needs x's first half
        g.output(x1)
    return g


@pytest.mark.parametrize("scale", [1.0, 0.7])
@pytest.mark.parametrize("length", [T, 1])  # a decode step's one position: a rotation matrix
def test_rotate_half_rope_is_fused_and_exact(scale, length):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, H, length, D)).astype(np.float32)
    positions = np.arange(11, 11 + length, dtype=np.int64)
    inv_freq = (1.0 / BASE ** (np.arange(0, D, 2) / D)).astype(np.float32)
    g = rope_program(x, positions, inv_freq, scale)
    ex = g.executor()
    assert ex.node_names.count("RopeFused") == 1
    assert "NegNode" not in ex.node_names
    (y,) = [np.array(o) for o in ex.execute([x, positions])]
    np.testing.assert_allclose(y, reference(x, positions, inv_freq, scale), atol=1e-5)


def test_group_whose_intermediate_is_read_later_stays_unfused():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, H, T, D)).astype(np.float32)
    positions = np.arange(T, dtype=np.int64)
    inv_freq = (1.0 / BASE ** (np.arange(0, D, 2) / D)).astype(np.float32)
    g = rope_program(x, positions, inv_freq, 1.0, read_intermediate=True)
    ex = g.executor()
    assert "RopeFused" not in ex.node_names
    y, x1 = [np.array(o) for o in ex.execute([x, positions])]
    np.testing.assert_allclose(y, reference(x, positions, inv_freq, 1.0), atol=1e-5)
    np.testing.assert_array_equal(x1, x[..., : D // 2])


def swiglu_program(gate, up, silu_read_later=False):
    g = OpGraph()
    gs, us = g.input(gate), g.input(up)
    s, other, y = g.temp(), g.temp(), g.temp()
    g.node(md.SiluNodeT, x=gs, out=s)
    g.node(md.NegNodeT, x=us, out=other)  # unrelated work between the two
    g.node(md.MultiplyNodeT, a=s, b=us, out=y)
    g.output(y)
    g.output(other)
    if silu_read_later:
        g.output(s)
    return g


def silu(x):
    return x / (1 + np.exp(-x))


@pytest.mark.parametrize("silu_read_later", [False, True])
def test_silu_times_up_runs_as_one_swiglu_only_when_nothing_else_reads_the_silu(silu_read_later):
    rng = np.random.default_rng(2)
    gate, up = (rng.standard_normal((1, 4, 24)).astype(np.float32) for _ in range(2))
    ex = swiglu_program(gate, up, silu_read_later).executor()
    assert ("SwiGLUFused" in ex.node_names) is not silu_read_later
    outs = [np.array(o) for o in ex.execute([gate, up])]
    np.testing.assert_allclose(outs[0], silu(gate) * up, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(outs[1], -up)
    if silu_read_later:
        np.testing.assert_allclose(outs[2], silu(gate), rtol=1e-5, atol=1e-6)


def residual_program(x, w, h, product_read_later=False):
    """``h + x @ W.T``: a layer's output projection and its residual add."""
    g = OpGraph()
    xs, hs = g.input(x), g.input(h)
    wt, p, y = g.temp(), g.temp(), g.temp()
    g.node(md.TransposeNodeT, x=g.constant(w), out=wt, perm=[1, 0])
    g.node(md.AddmmNodeT, mat1=xs, mat2=wt, out=p, alpha=1.0, beta=1.0)
    g.node(md.AddNodeT, a=hs, b=p, out=y)
    g.output(y)
    if product_read_later:
        g.output(p)
    return g


@pytest.mark.parametrize("product_read_later", [False, True])
@pytest.mark.parametrize("rows", [1, 4])
def test_a_residual_add_is_done_by_the_product_only_when_nothing_else_reads_it(product_read_later, rows):
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((1, rows, 96)).astype(np.float32)
    w = rng.standard_normal((64, 96)).astype(np.float32)
    h = (50 * rng.standard_normal((1, rows, 64))).astype(np.float32)
    ex = residual_program(x, w, h, product_read_later).executor()
    assert ("ResidualAddFused" in ex.node_names) is not product_read_later
    outs = [np.array(o) for o in ex.execute([x, h])]
    np.testing.assert_allclose(outs[0], h + x @ w.T, rtol=1e-5, atol=1e-4)
    # rounded once, as the separate add: the same bits as adding the product the graph computes
    product = cpu.kernels(build=True).extension.gemv(mx.array(x), mx.array(w).T)
    np.testing.assert_array_equal(outs[0], np.array(mx.add(mx.array(h), product)))
    if product_read_later:
        np.testing.assert_array_equal(outs[1], np.array(product))


def test_an_add_of_values_no_product_wrote_stays_the_add_node():
    g = OpGraph()
    x, h = g.input(np.ones((1, 1, 8), np.float32)), g.input(np.full((1, 1, 8), 2.0, np.float32))
    n, y = g.temp(), g.temp()
    g.node(md.NegNodeT, x=x, out=n)
    g.node(md.AddNodeT, a=h, b=n, out=y)
    g.output(y)
    ex = g.executor()
    assert "ResidualAddFused" not in ex.node_names and "AddNode" in ex.node_names
    np.testing.assert_array_equal(np.array(ex.execute([np.ones((1, 1, 8), np.float32),
                                                        np.full((1, 1, 8), 2.0, np.float32)])[0]), np.ones((1, 1, 8)))
