"""Addmm, norms, RoPE, attention and convolution nodes against torch eager."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from opgraph import OpGraph
from test_ops_shape import Values, close, executor_with_values, rand, run_graph, stray_tid

from llm_executorch_mlx.runtime.pte._schema import mlx_delegate as md
from llm_executorch_mlx.runtime.errors import PteError
from llm_executorch_mlx.runtime.cpu.fastmath import rms_norm as compiled_rms_norm

T = torch.from_numpy


def run_one(cls, inputs, fields, constants=()):
    """``cls(out=..., **fields(xs, v))`` on inputs then constants; one output."""
    g = OpGraph()
    v = Values(g)
    xs = [g.input(a) for a in inputs] + [g.constant(c) for c in constants]
    out = g.temp()
    g.node(cls, out=out, **fields(xs, v))
    g.output(out)
    return run_graph(g, inputs, v.pairs)[0]


def close_f(got, want):
    close(got, want, rtol=1e-5, atol=1e-5)


# -- addmm and norms ------------------------------------------------------------


@pytest.mark.parametrize("alpha, beta", [(1.0, 1.0), (0.5, 2.0)])
def test_addmm(alpha, beta):
    a, b, bias = rand(3, 4), rand(4, 5), rand(5)
    got = run_one(md.AddmmNodeT, [a, b, bias],
                  lambda xs, v: dict(mat1=xs[0], mat2=xs[1], bias=xs[2], alpha=alpha, beta=beta))
    close_f(got, torch.addmm(T(bias), T(a), T(b), alpha=alpha, beta=beta))


@pytest.mark.parametrize("rows", [(2, 3), (1, 3), (3,)])  # [1, T, K] runs as one batched node
def test_addmm_without_bias_is_a_matmul(rows):
    a, b = rand(*rows, 4), rand(4, 5)
    got = run_one(md.AddmmNodeT, [a, b], lambda xs, v: dict(mat1=xs[0], mat2=xs[1], alpha=3.0))
    close_f(got, T(a) @ T(b))


def test_addmm_without_bias_follows_a_changing_weight_across_calls():
    # [1, T, K] inputs run against a kept [1, K, N] view of the last weight.
    g = OpGraph()
    a, b, out = g.input(rand(1, 3, 4)), g.input(rand(4, 5)), g.temp()
    g.node(md.AddmmNodeT, out=out, mat1=a, mat2=b)
    g.output(out)
    ex = executor_with_values(g, [])
    for a_, b_ in [(rand(1, 3, 4), rand(4, 5)) for _ in range(3)]:
        close_f(np.array(ex.execute([a_, b_])[0]), T(a_) @ T(b_))


@pytest.mark.parametrize("rows", [(2, 3), (1, 1)])  # MLX's fallback; compiled for few rows
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm(weighted, rows):
    x, w = rand(*rows, 16), rand(16)
    got = run_one(md.RMSNormNodeT, [x], lambda xs, v: dict(
        x=xs[0], weight=xs[1] if weighted else None, eps=1e-5), constants=[w] if weighted else [])
    close_f(got, F.rms_norm(T(x), (16,), T(w) if weighted else None, eps=1e-5))


def test_rms_norm_of_bfloat16_rows_with_a_float32_weight_follows_mlx_promotion():
    # The few-row compiled norm is for fp32; MLX normalises bf16 rows, then
    # promotes to the weight's fp32 (compute_dtype native keeps such pairs).
    x, w = mx.array(rand(1, 1, 16)).astype(mx.bfloat16), mx.array(rand(16))
    got = compiled_rms_norm(1e-5)(x, w, 1e-5)
    want = mx.fast.rms_norm(x, w, 1e-5)
    assert got.dtype == want.dtype == mx.float32
    np.testing.assert_array_equal(np.array(got), np.array(want))


@pytest.mark.parametrize("weight, bias", [(True, True), (True, False), (False, False)])
def test_layer_norm(weight, bias):
    x, w, b = rand(2, 3, 16), rand(16), rand(16)
    consts = [c for c, on in ((w, weight), (b, bias)) if on]

    def fields(xs, v):
        it = iter(xs[1:])
        return dict(x=xs[0], weight=next(it) if weight else None, bias=next(it) if bias else None, eps=1e-5)

    got = run_one(md.LayerNormNodeT, [x], fields, constants=consts)
    want = F.layer_norm(T(x), (16,), T(w) if weight else None, T(b) if bias else None, eps=1e-5)
    close_f(got, want)


# -- RoPE ----------------------------------------------------------------------


def torch_rope(x, dims, traditional, base, scale, offset, freqs=None):
    """Hand-written RoPE over the last dim of ``x`` (B, H, T, D); ``offset`` is
    an int or a (B,) tensor of per-example start positions."""
    B, _, L, _ = x.shape
    offset = torch.as_tensor(offset, dtype=torch.float32).reshape(-1, 1, 1)  # (B or 1, 1, 1)
    positions = (torch.arange(L, dtype=torch.float32) + offset) * scale  # (B, 1, L)
    half = dims // 2
    inv_freq = 1.0 / freqs if freqs is not None else base ** (-torch.arange(half) / half)
    theta = positions[..., None] * inv_freq  # (B, 1, L, half)
    cos, sin = theta.cos(), theta.sin()
    if traditional:
        x1, x2 = x[..., 0:dims:2], x[..., 1:dims:2]
        rotated = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)
    else:
        x1, x2 = x[..., :half], x[..., half:dims]
        rotated = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)
    return torch.cat([rotated, x[..., dims:]], -1)


def rope_offset(g, v, kind, value):
    o = md.VidOrTidT()
    if kind == "vid":
        o.vid, o.isVid = v(value).vid, True
    else:
        o.tid = g.input(np.array(value, np.int32))
    return o


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("kind, offset", [
    ("vid", 5), ("tensor", 3), ("tensor", [2, 7]),  # scalar tensor, then one per batch row
])
@pytest.mark.parametrize("dims, use_freqs", [(16, False), (8, False), (16, True)])
def test_rope(traditional, kind, offset, dims, use_freqs):
    x = rand(2, 3, 4, 16)
    freqs = np.linspace(1.0, 50.0, dims // 2).astype(np.float32)
    g = OpGraph()
    v = Values(g)
    xi, out = g.input(x), g.temp()
    o = rope_offset(g, v, kind, offset)
    g.node(md.RopeNodeT, x=xi, out=out, dims=dims, offset=o, traditional=traditional,
           base=10000.0, scale=0.5, freqs=g.constant(freqs) if use_freqs else None)
    g.output(out)
    inputs = [x] + ([] if kind == "vid" else [np.array(offset, np.int32)])
    (got,) = run_graph(g, inputs, v.pairs)
    want = torch_rope(T(x), dims, traditional, 10000.0, 0.5, offset, T(freqs) if use_freqs else None)
    close(got, want, rtol=1e-5, atol=2e-5)


# -- attention -------------------------------------------------------------------


def sdpa_inputs(hq=4, hkv=2, tq=5, tk=5, d=8):
    return rand(2, hq, tq, d), rand(2, hkv, tk, d), rand(2, hkv, tk, d)


def torch_sdpa(q, k, v, mask=None, causal=False):
    return F.scaled_dot_product_attention(
        T(q), T(k), T(v), attn_mask=None if mask is None else T(mask),
        is_causal=causal, scale=0.3, enable_gqa=True,
    )


@pytest.mark.parametrize("hq, hkv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa(hq, hkv, causal):
    q, k, v = sdpa_inputs(hq, hkv)
    got = run_one(md.SdpaNodeT, [q, k, v], lambda xs, _: dict(
        q=xs[0], k=xs[1], v=xs[2], scale=0.3, causal=causal))
    close_f(got, torch_sdpa(q, k, v, causal=causal))


def test_sdpa_causal_aligns_lower_right():
    # MLX's causal mask lines the last query up with the last key (decode with
    # a cache), unlike torch's is_causal: compare with that mask spelled out.
    q, k, v = sdpa_inputs(tq=2, tk=6)
    got = run_one(md.SdpaNodeT, [q, k, v], lambda xs, _: dict(
        q=xs[0], k=xs[1], v=xs[2], scale=0.3, causal=True))
    mask = np.tril(np.ones((2, 6), bool), k=4)
    close_f(got, torch_sdpa(q, k, v, mask=mask))


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "additive_fp16", "per_head"])
def test_sdpa_explicit_mask(mask_kind):
    q, k, v = sdpa_inputs(tq=3, tk=7)
    if mask_kind == "bool":
        mask = rng_mask((3, 7))
    elif mask_kind == "per_head":
        mask = rng_mask((2, 4, 3, 7))
    else:
        mask = np.where(rng_mask((1, 1, 3, 7)), 0.0, -1e4).astype(np.float32)
        if mask_kind == "additive_fp16":  # cast to q's dtype by the runtime
            mask = mask.astype(np.float16)
    got = run_one(md.SdpaNodeT, [q, k, v, mask], lambda xs, _: dict(
        q=xs[0], k=xs[1], v=xs[2], mask=xs[3], scale=0.3))
    close_f(got, torch_sdpa(q, k, v, mask=mask.astype(np.float32) if mask.dtype == np.float16 else mask))


def rng_mask(shape):
    m = np.random.default_rng(1).random(shape) < 0.7
    m[..., 0] = True  # every query sees a key
    return m


def test_sdpa_causal_with_mask_fails_at_build():
    q, k, v = sdpa_inputs()
    with pytest.raises(PteError, match="SdpaNode: causal and an explicit mask"):
        run_one(md.SdpaNodeT, [q, k, v, rng_mask((5, 5))], lambda xs, _: dict(
            q=xs[0], k=xs[1], v=xs[2], mask=xs[3], scale=0.3, causal=True))


# -- convolutions ------------------------------------------------------------------
# MLX convolves channels-last: x (N, *spatial, C_in), w (C_out, *kernel, C_in/groups);
# torch has channels first. Transposed convs take w (C_out, *kernel, C_in) in MLX
# and (C_in, C_out, *kernel) in torch.


def to_last(t):
    return t.movedim(1, -1)


def to_first(a):
    return T(a).movedim(-1, 1)


CONVS = [
    # node, spatial dims, node fields, torch fn, torch kwargs
    (md.Conv1DNodeT, 1, dict(stride=2, padding=1, dilation=2, groups=2), F.conv1d,
     dict(stride=2, padding=1, dilation=2, groups=2)),
    (md.Conv2DNodeT, 2, dict(strideH=2, strideW=1, paddingH=1, paddingW=0, dilationH=1, dilationW=2, groups=1),
     F.conv2d, dict(stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=1)),
    (md.Conv3DNodeT, 3, dict(strideD=1, strideH=2, strideW=1, paddingD=1, paddingH=0, paddingW=1, dilationW=2),
     F.conv3d, dict(stride=(1, 2, 1), padding=(1, 0, 1), dilation=(1, 1, 2), groups=1)),  # MLX: groups in 1D/2D only
]


@pytest.mark.parametrize("cls, nd, fields, fn, kwargs", CONVS, ids=["1d", "2d", "3d"])
def test_conv(cls, nd, fields, fn, kwargs):
    groups = kwargs["groups"]
    x = rand(2, 4, *[7] * nd)  # torch layout
    w = rand(6, 4 // groups, *[3] * nd)
    got = run_one(cls, [np.ascontiguousarray(to_last(T(x)).numpy())], lambda xs, v: dict(
        x=xs[0], w=xs[1], **fields), constants=[np.ascontiguousarray(to_last(T(w)).numpy())])
    close_f(got, to_last(fn(T(x), T(w), **kwargs)))


CONV_TRANSPOSES = [
    (md.ConvTranspose1DNodeT, 1, dict(stride=2, padding=1, dilation=1, outputPadding=1),
     F.conv_transpose1d, dict(stride=2, padding=1, output_padding=1)),
    (md.ConvTranspose2DNodeT, 2, dict(strideH=2, strideW=1, paddingH=0, paddingW=1, dilationH=1, dilationW=2,
                                      outputPaddingH=1, outputPaddingW=0),
     F.conv_transpose2d, dict(stride=(2, 1), padding=(0, 1), dilation=(1, 2), output_padding=(1, 0))),
    (md.ConvTranspose3DNodeT, 3, dict(strideD=2, strideH=1, strideW=1, paddingD=1, outputPaddingD=1),
     F.conv_transpose3d, dict(stride=(2, 1, 1), padding=(1, 0, 0), output_padding=(1, 0, 0))),
]


@pytest.mark.parametrize("cls, nd, fields, fn, kwargs", CONV_TRANSPOSES, ids=["1d", "2d", "3d"])
def test_conv_transpose(cls, nd, fields, fn, kwargs):
    x = rand(2, 4, *[5] * nd)
    w = rand(4, 3, *[3] * nd)  # torch: (C_in, C_out, *kernel)
    w_mlx = np.ascontiguousarray(T(w).movedim(0, -1).numpy())  # (C_out, *kernel, C_in)
    got = run_one(cls, [np.ascontiguousarray(to_last(T(x)).numpy())], lambda xs, v: dict(
        x=xs[0], w=xs[1], **fields), constants=[w_mlx])
    close_f(got, to_last(fn(T(x), T(w), **kwargs)))


def test_missing_rope_offset_and_bad_slot_fail_at_build():
    with pytest.raises(PteError, match="RopeNode: offset is missing"):
        run_one(md.RopeNodeT, [rand(1, 1, 2, 4)], lambda xs, v: dict(x=xs[0], dims=4))
    with pytest.raises(PteError, match="LayerNormNode: tensor slot 50 out of range"):
        run_one(md.LayerNormNodeT, [rand(2, 4)], lambda xs, v: dict(x=xs[0], weight=stray_tid(50)))


def test_scale_default_matches_head_dim():
    # a typical export: scale = 1/sqrt(D), GQA, causal prefill
    q, k, v = sdpa_inputs(hq=8, hkv=2, tq=6, tk=6, d=16)
    s = 1 / math.sqrt(16)
    got = run_one(md.SdpaNodeT, [q, k, v], lambda xs, _: dict(q=xs[0], k=xs[1], v=xs[2], scale=s, causal=True))
    want = F.scaled_dot_product_attention(T(q), T(k), T(v), is_causal=True, enable_gqa=True)
    close_f(got, want)
