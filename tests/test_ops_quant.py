"""Quantized matmuls, dequantization and gathered matmuls against torch eager.

Weights are quantized with ``mx.quantize``; the references unpack them in
torch (affine: ``q * scale + bias`` per group; mxfp4: e2m1 codes times a
power-of-two e8m0 scale) and multiply in fp32.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from opgraph import OpGraph
from test_ops_shape import Values, close, iov, rand, run_graph

from llm_executorch_mlx.runtime.pte._schema import mlx_delegate as md

T = torch.from_numpy
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize(w: np.ndarray, group_size: int, bits: int, mode: str):
    """``mx.quantize`` as numpy arrays: ``[wq, scales]`` plus biases when affine."""
    return [np.array(a) for a in mx.quantize(mx.array(w), group_size=group_size, bits=bits, mode=mode)]


def torch_dequantize(wq, scales, biases, group_size, bits, mode):
    packed = T(wq.astype(np.int64))
    shifts = bits * torch.arange(32 // bits)
    q = ((packed[..., None] >> shifts) & (2**bits - 1)).flatten(-2)  # little end first
    if mode == "affine":
        per_elem = lambda a: T(a).repeat_interleave(group_size, -1)  # noqa: E731
        return q * per_elem(scales) + per_elem(biases)
    sign = 1 - 2 * ((q >> 3) & 1)
    scale = 2.0 ** (T(scales.astype(np.int64)) - 127).float()
    return sign * E2M1[q & 7] * scale.repeat_interleave(group_size, -1)


def run_one(cls, inputs, constants, fields, values=None):
    g = OpGraph()
    v = Values(g)
    xs = [g.input(a) for a in inputs]
    cs = [None if c is None else g.constant(c) for c in constants]
    out = g.temp()
    g.node(cls, out=out, **fields(xs, cs, v))
    g.output(out)
    return run_graph(g, inputs, v.pairs)[0]


def close_q(got, want):
    close(got, want, rtol=1e-4, atol=1e-4)


QUANT = [  # mode, group size, bits
    ("affine", 32, 4), ("affine", 64, 8), ("affine", 32, 2), ("mxfp4", 32, 4),
]


@pytest.mark.parametrize("mode, group_size, bits", QUANT)
@pytest.mark.parametrize("transpose", [True, False])
def test_quantized_matmul(mode, group_size, bits, transpose):
    x = rand(2, 3, 64)
    w = rand(16, 64) if transpose else rand(64, 64)  # quantized along its last dim
    wq, scales, *biases = quantize(w, group_size, bits, mode)
    bias = biases[0] if biases else None
    got = run_one(md.QuantizedMatmulNodeT, [x], [wq, scales, bias], lambda xs, cs, v: dict(
        x=xs[0], w=cs[0], scales=cs[1], biases=cs[2], groupSize=group_size, bits=bits,
        mode=mode, transpose=transpose))
    w_ref = torch_dequantize(wq, scales, bias, group_size, bits, mode)
    close_q(got, T(x) @ (w_ref.T if transpose else w_ref))


# mxfp4 leaves out dtype None: it dequantizes to bf16, which numpy cannot hold
@pytest.mark.parametrize("mode, group_size, bits, dtype", [
    q + (dtype,) for q in QUANT for dtype in (None, 6) if q[0] == "affine" or dtype
])
def test_dequantize(mode, group_size, bits, dtype):
    w = rand(8, 128)
    wq, scales, *biases = quantize(w, group_size, bits, mode)
    bias = biases[0] if biases else None
    got = run_one(md.DequantizeNodeT, [], [wq, scales, bias], lambda xs, cs, v: dict(
        w=cs[0], scales=cs[1], biases=cs[2], groupSize=group_size, bits=bits, mode=mode, dtype=dtype))
    assert got.dtype == np.float32
    close(got, torch_dequantize(wq, scales, bias, group_size, bits, mode), rtol=1e-6, atol=1e-6)


def test_dequantize_to_fp16():
    w = rand(4, 64)
    wq, scales, bias = quantize(w, 64, 4, "affine")
    got = run_one(md.DequantizeNodeT, [], [wq, scales, bias], lambda xs, cs, v: dict(
        w=cs[0], scales=cs[1], biases=cs[2], groupSize=64, bits=4, mode="affine", dtype=5))
    assert got.dtype == np.float16
    close(got.astype(np.float32), torch_dequantize(wq, scales, bias, 64, 4, "affine"), rtol=1e-3, atol=1e-3)


def flag(v, kind):
    """``sorted_indices_flag``: absent, a literal, or a dynamic value."""
    return {"absent": None, "literal": iov(1), "dynamic": v(1)}[kind]


@pytest.mark.parametrize("flag_kind", ["absent", "literal", "dynamic"])
@pytest.mark.parametrize("with_lhs", [False, True])
def test_gather_mm(flag_kind, with_lhs):
    a, b = rand(3 if with_lhs else 4, 2, 8), rand(4, 8, 5)
    rhs = np.array([0, 1, 1, 3], np.int32)  # sorted, as the flag may claim
    lhs = np.array([2, 0, 1, 1], np.int32)
    inputs = [a, b, rhs] + ([lhs] if with_lhs else [])
    got = run_one(md.GatherMmNodeT, inputs, [], lambda xs, cs, v: dict(
        a=xs[0], b=xs[1], rhsIndices=xs[2], lhsIndices=xs[3] if with_lhs else None,
        sortedIndices=False, sortedIndicesFlag=flag(v, flag_kind)))
    a_rows = T(a)[T(lhs).long()] if with_lhs else T(a)
    want = a_rows @ T(b)[T(rhs).long()]
    close_q(got, want)


@pytest.mark.parametrize("flag_kind", ["absent", "dynamic"])
def test_gather_qmm(flag_kind):
    x, w = rand(4, 1, 64), rand(3, 16, 64)  # one row per token, 3 experts
    wq, scales, bias = quantize(w, 32, 4, "affine")
    rhs = np.array([0, 2, 2, 1], np.int32)
    got = run_one(md.GatherQmmNodeT, [x, rhs], [wq, scales, bias], lambda xs, cs, v: dict(
        x=xs[0], w=cs[0], scales=cs[1], biases=cs[2], rhsIndices=xs[1], transpose=True,
        groupSize=32, bits=4, mode="affine", sortedIndicesFlag=flag(v, flag_kind)))
    experts = torch_dequantize(wq, scales, bias, 32, 4, "affine")[T(rhs).long()]  # (4, 16, 64)
    close_q(got, T(x) @ experts.transpose(-1, -2))
