"""The CPU's exp, attention and SwiGLU (fastmath.py) against float64 numpy."""

import mlx.core as mx
import numpy as np
import pytest

from llm_executorch_mlx.runtime.cpu import fastmath


def test_exp_is_accurate_to_float32_over_its_whole_range():
    x = np.concatenate([np.linspace(-87, 88, 200_001), np.random.default_rng(0).normal(0, 5, 50_000)])
    got = np.array(fastmath.exp(mx.array(x.astype(np.float32)))).astype(np.float64)
    want = np.exp(x.astype(np.float32).astype(np.float64))
    assert np.max(np.abs(got - want) / want) < 2e-7  # mx.exp itself: 3e-6


def test_exp_of_masked_scores_is_negligible_and_nan_stays_nan():
    got = np.array(fastmath.exp(mx.array([-np.inf, -1e4, np.nan, 0.0], dtype=mx.float32)))
    assert got[0] < 1e-37 and got[1] < 1e-37 and np.isnan(got[2]) and got[3] == 1.0


# (1, 3, 3, 128, 256) fills a padding bucket exactly, the others do not.
@pytest.mark.parametrize("shape", [(3,), (2, 5, 7), (1, 3, 3, 128, 300), (1, 3, 3, 128, 256)])
def test_exp_keeps_any_shape(shape):
    x = np.random.default_rng(1).normal(size=shape).astype(np.float32)
    got = fastmath.exp(mx.array(x))
    assert got.shape == shape
    np.testing.assert_allclose(np.array(got), np.exp(x), rtol=1e-6)


def reference_attention(q, k, v, scale, visible=None, additive=None):
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = q @ k.swapaxes(-1, -2) * scale
    if additive is not None:
        s = s + additive
    if visible is not None:
        s = np.where(visible, s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("Hq,Hkv,T,S", [(9, 3, 6, 20), (4, 4, 1, 33), (8, 2, 128, 300)])
def test_attention_matches_softmax_attention_with_grouped_heads(Hq, Hkv, T, S):
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, Hq, T, 16)).astype(np.float32)
    k, v = (rng.standard_normal((1, Hkv, S, 16)).astype(np.float32) for _ in range(2))
    causal = np.arange(S)[None, :] <= np.arange(S - T, S)[:, None]
    band = causal & (np.arange(S)[None, :] > np.arange(S - T, S)[:, None] - 4)
    additive = rng.standard_normal((1, Hq, T, S)).astype(np.float32)
    cases = [
        (None, None, None),
        ("causal", causal, None),
        (mx.array(band[None, None]), band, None),
        (mx.array(additive), None, additive),
    ]
    for mask, visible, add in cases:
        got = fastmath.attention(mx.array(q), mx.array(k), mx.array(v), 0.25, mask)
        want = reference_attention(q, k, v, 0.25, visible, add)
        np.testing.assert_allclose(np.array(got), want, atol=2e-6)


@pytest.mark.parametrize("S", [40, 500])  # softmax kernel; exp route (> 8192 scores)
def test_attention_on_bfloat16_normalises_in_float32(S):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 4, 5, 16)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, S, 16)).astype(np.float32) for _ in range(2))
    half = [mx.array(a).astype(mx.bfloat16) for a in (q, k, v)]
    got = fastmath.attention(*half, 0.25, "causal")
    assert got.dtype == mx.bfloat16
    rounded = [np.array(a.astype(mx.float32)) for a in half]
    visible = np.arange(S)[None, :] <= np.arange(S - 5, S)[:, None]
    np.testing.assert_allclose(
        np.array(got.astype(mx.float32)), reference_attention(*rounded, 0.25, visible), atol=3e-2
    )


@pytest.mark.parametrize("shape", [(1, 1, 33), (2, 7, 33), (2, 64, 80)])  # one kernel; the exp path
def test_swiglu_is_silu_of_gate_times_up(shape):
    rng = np.random.default_rng(4)
    gate = rng.normal(0, 4, shape).astype(np.float32)
    up = rng.standard_normal(shape).astype(np.float32)
    g = gate.astype(np.float64)
    want = g / (1 + np.exp(-g)) * up
    np.testing.assert_allclose(np.array(fastmath.swiglu(mx.array(gate), mx.array(up))), want, rtol=1e-5, atol=1e-6)
