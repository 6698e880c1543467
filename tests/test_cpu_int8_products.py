"""The int8-activation products (``runtime/cpu/quantized_int8.h``: the
``int8_activations`` route) against numpy's integer math: x rounded to int8
per group exactly as llama.cpp's Q8_0 rounds it (d = max|x| / 127, to the
nearest, ties to even), the int8 values times the stored 4- or 8-bit values
summed exactly in int64, then scaled, plus each group's bias times the
rounded x's sum: the dequantized weights times the rounded x. The kernel
sums the same integers and differs only by fp32 rounding of the scaled
sums. Also: the layout's lookups, NaN in giving NaN out, and the
refusals. Every vector variant runs these too (test_cpu_vector_variants.py).
"""

import mlx.core as mx
import numpy as np
import pytest

from llm_executorch_mlx.runtime import cpu


@pytest.fixture(scope="module")
def kernel():
    found = cpu.kernels(build=True)
    assert found.products.on, found.products.why
    assert found.extension.limits()["int8_bits"], "x86 builds have integer dot products"
    return found.extension


def stored_values(q, bits) -> np.ndarray:
    """MLX's packed values, least-significant bits first in uint32 words."""
    words = np.array(q).astype(np.uint64)
    shifts = np.arange(32 // bits, dtype=np.uint64) * bits
    return ((words[..., None] >> shifts) & ((1 << bits) - 1)).reshape(words.shape[0], -1).astype(np.int64)


def int8_reference(x, q, scales, biases, bits, group) -> np.ndarray:
    """y[m, n] = sum_g s[n, g] d[m, g] (q[n, g] . xq[m, g]) + b[n, g] d[m, g] sum(xq[m, g])."""
    M, K = x.shape
    xg = x.reshape(M, K // group, group)
    top = np.abs(xg).max(-1, keepdims=True)
    inverse = np.divide(np.float32(127), top, out=np.zeros_like(top), where=top > 0)
    xq = np.rint(xg * inverse).astype(np.int64)  # numpy rounds ties to even, as the CPU does
    d = (top / np.float32(127))[..., 0].astype(np.float64)
    v = stored_values(q, bits).reshape(-1, K // group, group)
    dots = np.einsum("mgk,ngk->mng", xq, v)  # exact
    s, b = np.array(scales, dtype=np.float64), np.array(biases, dtype=np.float64)
    return (dots * d[:, None, :] * s[None]).sum(-1) + (d * xq.sum(-1)) @ b.T


def quantized(rng, N, K, bits, group):
    return mx.quantize(mx.array(rng.standard_normal((N, K)).astype(np.float32)), group_size=group, bits=bits)


def symmetric(rng, N, K, bits, group, scale=1.0):
    """A weight as torchao's symmetric exports and GGUF's Q4_0 / Q8_0 store
    it: b = -2^(bits-1) s, so w = s (q - 2^(bits-1))."""
    words = mx.array(rng.integers(0, 2**32, (N, K * bits // 32), dtype=np.uint64).astype(np.uint32))
    scales = (rng.uniform(0.5, 2, (N, K // group)) * scale).astype(np.float32)
    return words, mx.array(scales), mx.array(-np.float32(2 ** (bits - 1)) * scales)


def as_laid(stored, laid, bits):
    """The stored (w, scales, biases) as the int8 layout holds them: scales
    and biases rounded to fp16 where it chose fp16 (numpy's rounding), the
    biases -2^(bits-1) s where it dropped them as symmetric."""
    w, scales, biases = stored
    dtype = np.float16 if laid[1].dtype == mx.float16 else np.float32
    s = np.array(scales).astype(dtype).astype(np.float32)
    b = (-np.float32(2 ** (bits - 1)) * s if laid[2].size == 0
         else np.array(biases).astype(dtype).astype(np.float32))
    return w, s, b


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int8_products_match_integer_math(kernel, group):
    """Odd row counts of x (a decode step's 1, tails of the 4-row tiles,
    two and three 16-row tiles, which AMX takes in the amx build, past a
    128-row chunk)
    against weights of one, three and eight blocks of rows; K of several
    groups, odd and even counts; every width the build takes."""
    lanes = kernel.limits()["interleave_lanes"]
    rng = np.random.default_rng(group)
    for bits, N, K in ((bits, N, K) for bits in list(kernel.limits()["int8_bits"])
                       for N, K in ((lanes, 256), (3 * lanes, 768), (8 * lanes, 384))):
        stored = quantized(rng, N, K, bits, group)
        laid = kernel.interleave_quantized(*stored, group, bits, int8=True)
        assert [a.shape for a in laid] == [a.shape for a in stored]
        for M in (1, 2, 3, 5, 9, 32, 48, 130):
            x = (rng.standard_normal((M, K)) * rng.uniform(0.01, 10, (M, 1))).astype(np.float32)
            y = np.array(kernel.quantized_gemv(mx.array(x)[None], *laid, group, bits, int8=True))[0]
            ref = int8_reference(x, *as_laid(stored, laid, bits), bits, group)
            np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * np.abs(ref).max() + 1e-6,
                                       err_msg=f"{bits} bits, N={N} K={K} M={M}")


@pytest.mark.parametrize("bits", [4, 8])
def test_scales_are_stored_as_small_as_they_stay_exact_enough(kernel, bits):
    """Symmetric weights lose their biases (b derived from s bit for bit),
    scales in fp16's normal range are stored in fp16 and out of it kept in
    fp32; the products are integer math on the values the layout holds."""
    lanes = kernel.limits()["interleave_lanes"]
    rng = np.random.default_rng(bits)
    cases = {"symmetric": symmetric(rng, 2 * lanes, 256, bits, 32, 0.01),
             "tiny scales": symmetric(rng, 2 * lanes, 256, bits, 32, 1e-6),
             "affine": quantized(rng, 2 * lanes, 256, bits, 32)}
    x = rng.standard_normal((35, 256)).astype(np.float32)  # two tiles of 16 rows (AMX's, where built) and three more
    for name, stored in cases.items():
        laid = kernel.interleave_quantized(*stored, 32, bits, int8=True)
        assert (laid[2].size == 0) == (name != "affine"), name
        assert laid[1].dtype == (mx.float32 if name == "tiny scales" else mx.float16), name
        y = np.array(kernel.quantized_gemv(mx.array(x), *laid, 32, bits, int8=True))
        ref = int8_reference(x, *as_laid(stored, laid, bits), bits, 32)
        np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * np.abs(ref).max(), err_msg=name)
        if name == "tiny scales":  # fp32 kept: the file's own weights
            exact = int8_reference(x, *stored, bits, 32)
            np.testing.assert_allclose(y, exact, rtol=0, atol=1e-5 * np.abs(exact).max())
        rows = kernel.take_interleaved(*laid, mx.array([0, lanes + 3]), 32, bits, int8=True)
        w, s, b = as_laid(stored, laid, bits)
        np.testing.assert_array_equal(np.array(rows), np.array(mx.dequantize(w, mx.array(s), mx.array(b), 32, bits))[[0, lanes + 3]])


def test_every_x86_build_takes_4_and_8_bits(kernel):
    """With VNNI's u8 x s8 sums as stored; without it (vpmaddubsw, whose
    int16 pair sums would saturate on 8-bit values) 8-bit weights are offset
    to signed values, which the AVX2 and AVX-512 variants check against the
    same integer math (test_cpu_vector_variants.py)."""
    assert list(kernel.limits()["int8_bits"]) == [4, 8]


def test_strided_x_and_several_products_of_one_x(kernel):
    """x a transposed view (the kernel reads its strides), and one x against
    three weights as one job equal to each alone."""
    lanes = kernel.limits()["interleave_lanes"]
    rng = np.random.default_rng(5)
    weights = [kernel.interleave_quantized(*quantized(rng, N, 256, 4, 32), 32, 4, int8=True)
               for N in (lanes, 4 * lanes, 2 * lanes)]
    x = mx.array(rng.standard_normal((256, 7)).astype(np.float32)).T
    together = kernel.quantized_gemvs(x, *map(list, zip(*weights)), 32, 4, int8=True)
    for weight, y in zip(weights, together):
        alone = kernel.quantized_gemv(mx.array(np.array(x)), *weight, 32, 4, int8=True)
        np.testing.assert_array_equal(np.array(y), np.array(alone))


def test_a_lookup_in_the_int8_layout_is_mlx_dequantize(kernel):
    """A tied embedding's rows read from the layout its LM head multiplies:
    MLX's dequantization of the scales and biases the layout holds."""
    lanes = kernel.limits()["interleave_lanes"]
    rng = np.random.default_rng(9)
    for bits in list(kernel.limits()["int8_bits"]):
        stored = quantized(rng, 3 * lanes, 256, bits, 64)
        laid = kernel.interleave_quantized(*stored, 64, bits, int8=True)
        ids = mx.array([[0, 3 * lanes - 1], [lanes + 1, -1]])
        rows = kernel.take_interleaved(*laid, ids, 64, bits, int8=True)
        w, s, b = as_laid(stored, laid, bits)
        expected = np.array(mx.dequantize(w, mx.array(s), mx.array(b), 64, bits))[np.array(ids)]
        np.testing.assert_array_equal(np.array(rows), expected)


def test_nan_in_gives_nan_out(kernel):
    """As MLX's products: a NaN or an infinity in x makes its row's outputs
    NaN (or infinite), never finite numbers."""
    lanes = kernel.limits()["interleave_lanes"]
    rng = np.random.default_rng(3)
    laid = kernel.interleave_quantized(*quantized(rng, lanes, 128, 4, 32), 32, 4, int8=True)
    x = rng.standard_normal((35, 128)).astype(np.float32)  # two tiles of 16 rows (AMX's, where built) and three more
    x[0, 5], x[2, 100], x[33, 7] = np.nan, np.inf, np.nan
    y = np.array(kernel.quantized_gemv(mx.array(x), *laid, 32, 4, int8=True))
    bad = [0, 2, 33]
    assert not np.isfinite(y[bad]).any(axis=1).any() and np.isfinite(np.delete(y, bad, axis=0)).all()


def test_refusals_name_the_problem(kernel):
    lanes = kernel.limits()["interleave_lanes"]
    rng = np.random.default_rng(1)
    with pytest.raises(ValueError, match=f"multiple of {lanes} rows"):
        kernel.interleave_quantized(*quantized(rng, lanes + 1, 256, 4, 32), 32, 4, int8=True)
    laid = kernel.interleave_quantized(*quantized(rng, lanes, 256, 4, 32), 32, 4, int8=True)
    with pytest.raises(ValueError, match="x must be float32"):
        kernel.quantized_gemv(mx.zeros((2, 256), dtype=mx.float16), *laid, 32, 4, int8=True)
    with pytest.raises(ValueError, match="K 128"):
        kernel.quantized_gemv(mx.zeros((2, 128)), *laid, 32, 4, int8=True)
