"""Products of bf16 weights with activations rounded to bf16 (``gemv``'s
``bf16_x``, runtime/cpu/gemv.cpp; ``-o bf16_activations``), against torch's
own bf16 rounding and float64 sums.

The route's contract: each product is x rounded to bf16 (to nearest, ties
to even, as torch rounds it) times the bf16 weight, summed in fp32; so the
reference is that product summed in float64, within fp32's accumulation
error. A build without AVX512_BF16 refuses the route in one line.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

from llm_executorch_mlx.runtime import cpu


@pytest.fixture(scope="module")
def kernel():
    found = cpu.kernels(build=True)
    assert found.products.on, found.products.why
    return found.extension


def bf16_weight(rng, n, k) -> tuple[mx.array, torch.Tensor]:
    """A [N, K] bf16 weight as MLX and torch hold it (the same bits)."""
    w = torch.tensor(rng.standard_normal((n, k)).astype(np.float32)).to(torch.bfloat16)
    return mx.array(w.view(torch.int16).numpy()).view(mx.bfloat16), w


def reference(x: np.ndarray, w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """x rounded to bf16 by torch, times w, in float64; and the bound fp32
    sums of those terms stay within."""
    xr = torch.tensor(x).to(torch.bfloat16).double()
    terms = xr.abs() @ w.double().abs().T
    return (xr @ w.double().T).numpy(), terms.numpy() * x.shape[-1] * 2.0**-24


def bf16_dot_here(kernel) -> bool:
    return kernel.limits()["bf16_dot"]


@pytest.mark.parametrize("M, K, N", [(1, 576, 1536), (2, 72, 13), (3, 100, 37), (4, 64, 6), (5, 576, 49),
                                     (17, 1536, 576), (128, 576, 200), (35, 96, 56), (9, 64, 40), (20, 72, 40)])
def test_rounded_products_equal_torch_rounding_in_float64(kernel, M, K, N):
    rng = np.random.default_rng(M * 1000 + K)
    wm, w = bf16_weight(rng, N, K)
    x = rng.standard_normal((1, M, K)).astype(np.float32)
    if not bf16_dot_here(kernel):
        with pytest.raises(ValueError, match="no bf16 dot products"):
            kernel.gemv(mx.array(x), wm.T, bf16_x=True)
        return
    y = np.array(kernel.gemv(mx.array(x), wm.T, bf16_x=True))[0]
    want, bound = reference(x[0], w)
    assert np.all(np.abs(y - want) <= bound), np.abs(y - want).max()
    # and it is the rounded x's product, not the exact one's, wherever they differ
    exact = x[0].astype(np.float64) @ w.double().numpy().T
    assert np.abs(y - exact).max() > np.abs(y - want).max()


def test_grouped_strided_and_non_finite_rows(kernel):
    """gemvs of one x (a layer's q, k, v), an x whose rows are strided, and a
    row holding NaN or inf: NaN in, NaN out, the other rows untouched."""
    if not bf16_dot_here(kernel):
        return  # the refusal is test_rounded_products_equal_torch_rounding_in_float64's
    rng = np.random.default_rng(9)
    weights = [bf16_weight(rng, n, 96) for n in (64, 16, 16)]
    wide = rng.standard_normal((4, 192)).astype(np.float32)
    x = mx.array(wide)[:, ::2]  # rows of 96, every other value
    ys = kernel.gemvs(x, [wm.T for wm, _ in weights], bf16_x=True)
    for y, (_, w) in zip(ys, weights):
        want, bound = reference(wide[:, ::2], w)
        assert np.all(np.abs(np.array(y) - want) <= bound)
    for rows in (4, 20):  # 20: a tile of 16 rows (AMX's, where built) and 4 more
        bad = rng.standard_normal((rows, 96)).astype(np.float32)
        bad[1, 5], bad[rows - 2, 7] = np.nan, np.inf
        y = np.array(kernel.gemv(mx.array(bad), weights[0][0].T, bf16_x=True))
        assert np.isnan(y[1]).all() and not np.isfinite(y[rows - 2]).any()
        assert np.isfinite(np.delete(y, [1, rows - 2], axis=0)).all()


def test_the_route_takes_bf16_weights_only(kernel):
    w = mx.ones((32, 8))  # [K, N], fp32
    with pytest.raises(ValueError, match="bf16_x rounds x for bfloat16 weights only|no bf16 dot products"):
        kernel.gemv(mx.ones((1, 32)), w, bf16_x=True)
