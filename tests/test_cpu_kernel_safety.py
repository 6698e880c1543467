"""The CPU kernels (runtime/cpu/*.cpp) when something goes wrong: a chunk
of shared work that throws, NaN and infinity among their inputs, a KV pool
that something else still holds."""

import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from llm_executorch_mlx.runtime import cpu

# Runs in a child, so that a thread left waiting hangs the child, not the suite.
THROWING_CHUNKS = r"""
import mlx.core as mx
from llm_executorch_mlx.runtime.cpu import extension

ext = extension.build().module

def raised(run):
    try:
        run()
    except RuntimeError as error:
        return str(error)
    return None

# the stream thread alone runs the job (nothing helps): its chunk 3 of 16 throws
print(raised(lambda: mx.eval(ext.debug_throwing_job(16, 3))))
# the host helps: every chunk throws, whichever thread runs it
job = ext.debug_throwing_job(64, -1)
print(raised(lambda: (ext.submit_helping([job]), ext.wait_helping(job))))
# the error reaches the graph's output through the ops that read the failed one
job = ext.debug_throwing_job(64, 40)
out = ext.gemv(ext.gemv(job.reshape(1, 1, 64), mx.ones((64, 8))), mx.ones((8, 8)))
print(raised(lambda: (ext.submit_helping([out]), ext.wait_helping(out))))
# and the stream runs the next job as before (no chunk 8 to throw)
print(ext.debug_throwing_job(8, 8).tolist())
"""


def test_a_chunk_that_throws_reaches_the_caller_and_leaves_no_thread_waiting():
    try:
        done = subprocess.run([sys.executable, "-c", THROWING_CHUNKS], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("a thread waited for ever on a chunk that threw")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "chunk 3 threw"
    assert lines[1].startswith("chunk ") and lines[1].endswith(" threw")
    assert lines[2] == "chunk 40 threw"
    assert lines[3] == str([float(c) for c in range(8)])


@pytest.fixture(scope="module")
def ext():
    found = cpu.kernels(build=True)
    assert found.products.on and found.attention.on, (found.products.why, found.attention.why)
    return found.extension


def spoil(a: mx.array, value: float, at: tuple) -> mx.array:
    """a with `value` at index `at`."""
    spoilt = np.array(a)
    spoilt[at] = value
    return mx.array(spoilt)


def quantized(rng, N, K, group, bits):
    return mx.quantize(mx.array(rng.standard_normal((N, K)).astype(np.float32)), group_size=group, bits=bits)


def sdpa(q, k, v, scale, causal):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal" if causal else None)


# Each case: (ours, MLX's own op), both functions of one input spoilt with a
# NaN or an infinity (the activations; a quantized weight's scales where
# there are none), and whether the kernel rounds x per group (below).
def cases(ext, rng):
    x = mx.array(rng.standard_normal((1, 3, 128)).astype(np.float32))
    w = mx.array(rng.standard_normal((128, 40)).astype(np.float32))
    q4 = quantized(rng, 32, 128, 32, 4)
    lanes, int8_bits = ext.limits()["interleave_lanes"], ext.limits()["int8_bits"]
    yield "gemv fp32", x, lambda x: ext.gemv(x, w), lambda x: x @ w, False
    yield "gemv bf16", x, lambda x: ext.gemv(x, w.astype(mx.bfloat16)), lambda x: x @ w.astype(mx.bfloat16).astype(
        mx.float32), False
    for bits in (4, 8):
        qw = quantized(rng, 32, 128, 32, bits)
        mlx = lambda x, qw=qw, bits=bits: mx.quantized_matmul(x, *qw, True, 32, bits)  # noqa: E731
        yield f"quantized {bits}-bit", x, lambda x, qw=qw, bits=bits: ext.quantized_gemv(x, *qw, 32, bits), mlx, True
        if lanes:
            laid = ext.interleave_quantized(*qw, 32, bits)
            yield (f"interleaved {bits}-bit", x,
                   lambda x, laid=laid, bits=bits: ext.quantized_gemv(x, *laid, 32, bits, interleaved=True), mlx, True)
        if bits in int8_bits:
            laid = ext.interleave_quantized(*qw, 32, bits, int8=True)
            yield (f"int8 {bits}-bit", x,
                   lambda x, laid=laid, bits=bits: ext.quantized_gemv(x, *laid, 32, bits, int8=True), mlx, True)
    k, v = (mx.array(rng.standard_normal((1, 2, 80, 16)).astype(np.float32)) for _ in range(2))
    for T in (3, 64):  # a few queries row by row; from 64 the tiled path
        q = mx.array(rng.standard_normal((1, 4, T, 16)).astype(np.float32))
        yield f"attention T={T}", q, lambda q: ext.attention(q, k, v, 0.25, True), lambda q: sdpa(q, k, v, 0.25,
                                                                                                  True), False
    q = mx.array(rng.standard_normal((1, 4, 2, 16)).astype(np.float32))
    step = mx.array(rng.standard_normal((1, 2, 2, 16)).astype(np.float32))

    def written(pool, new):
        return mx.concatenate([pool[:, :, :30], new, pool[:, :, 32:]], axis=2)

    yield ("update_and_attend (queries)", q, lambda q: ext.update_and_attend(q, step, step, k, v, 30, 0.25)[0],
           lambda q: sdpa(q, written(k, step)[:, :, :32], written(v, step)[:, :, :32], 0.25, True), False)
    yield ("update_and_attend (keys)", step, lambda s: ext.update_and_attend(q, s, step, k, v, 30, 0.25)[0],
           lambda s: sdpa(q, written(k, s)[:, :, :32], written(v, step)[:, :, :32], 0.25, True), False)
    norm_w = mx.array(rng.standard_normal(128).astype(np.float32))
    yield "rms_norm", x, lambda x: ext.rms_norm(x, norm_w, 1e-5), lambda x: mx.fast.rms_norm(x, norm_w, 1e-5), False
    up = mx.array(rng.standard_normal((1, 3, 128)).astype(np.float32))
    yield "silu_mul", x, lambda g: ext.silu_mul(g, up), lambda g: g * mx.sigmoid(g) * up, False
    q4w, q4s, q4b = q4
    yield ("dequantize", q4s, lambda s: ext.dequantize(q4w, s, q4b, 32, 4),
           lambda s: mx.dequantize(q4w, s, q4b, 32, 4), False)
    if lanes:
        ids = mx.array([1, 0, 1])  # the spoilt row, another, the spoilt one again
        for int8 in [False] + [True] * (4 in int8_bits):
            yield (f"take_interleaved int8={int8}", q4s,
                   lambda s, int8=int8: ext.take_interleaved(*ext.interleave_quantized(q4w, s, q4b, 32, 4, int8=int8),
                                                             ids, 32, 4, int8=int8),
                   lambda s: mx.dequantize(q4w, s, q4b, 32, 4)[ids], False)
    yield "widen_bf16", w, lambda w: ext.widen_bf16(w.astype(mx.bfloat16)), lambda w: w.astype(mx.bfloat16).astype(
        mx.float32), False


CASES = ["gemv fp32", "gemv bf16", "quantized 4-bit", "interleaved 4-bit", "int8 4-bit", "quantized 8-bit",
         "interleaved 8-bit", "int8 8-bit", "attention T=3", "attention T=64", "update_and_attend (queries)",
         "update_and_attend (keys)", "rms_norm", "silu_mul", "dequantize", "take_interleaved int8=False",
         "take_interleaved int8=True", "widen_bf16"]


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("name", CASES)
def test_every_kernel_gives_nan_and_infinity_where_mlx_does(ext, name, value):
    """NaN in, NaN out, as MLX's own op gives: in the same places, and
    nothing else spoilt. An infinity gives what MLX's op gives, except in
    the products that round x per group of the weights (quantized_dot.h,
    quantized_int8.h): a group with an infinity has no finite step, so
    their products come out NaN where MLX's are infinite."""
    found = {case[0]: case[1:] for case in cases(ext, np.random.default_rng(3))}
    if name not in found:  # an interleaved or int8 layout, which a build without integer dot products refuses
        assert not ext.limits()["interleave_lanes"] and not ext.limits()["int8_bits"], name
        with pytest.raises(ValueError, match="no interleaved layout"):
            ext.interleave_quantized(*quantized(np.random.default_rng(0), 32, 128, 32, 4), 32, 4)
        return
    a, ours, mlx, rounds_x = found[name]
    at = (0,) * (a.ndim - 2) + (1, min(5, a.shape[-1] - 1))  # one value of one row
    with mx.stream(mx.cpu):
        got, want = np.array(ours(spoil(a, value, at))), np.array(mlx(spoil(a, value, at)))
    assert np.isfinite(want).any() and (np.isnan(want).any() or not np.isnan(value))  # a case that spoils some
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_array_equal(np.isnan(got)[np.isnan(want)], True)
    infinite = np.isinf(want)
    np.testing.assert_array_equal(got[infinite] if not rounds_x else got[infinite & ~np.isnan(got)],
                                  want[infinite] if not rounds_x else want[infinite & ~np.isnan(got)])
    finite = np.isfinite(want)  # within the roughest route's rounding (int8)
    np.testing.assert_allclose(got[finite], want[finite], rtol=0, atol=0.05 * np.abs(want[finite]).max())


@pytest.mark.parametrize("holder", ["the pool itself", "a lazy reader", "a queued reader"])
def test_a_pool_something_else_holds_is_copied_and_the_step_is_still_right(ext, holder):
    """update_and_attend writes a pool in place only where MLX would donate
    it (attention.cpp's take_pools): an extra reference to the pool across a
    step keeps what it saw, and the step's pools and attention are right."""
    rng = np.random.default_rng(5)
    K, V = (mx.array(rng.standard_normal((1, 2, 16, 8)).astype(np.float32)) for _ in range(2))
    mx.eval(K, V)
    before = np.array(K).copy()
    q = mx.array(rng.standard_normal((1, 4, 1, 8)).astype(np.float32))
    k, v = (mx.array(rng.standard_normal((1, 2, 1, 8)).astype(np.float32)) for _ in range(2))
    if holder == "the pool itself":
        held, want_held = K, before
    else:
        held, want_held = K * 2, before * 2
        if holder == "a queued reader":  # queued before the step, computed on the stream before it
            mx.async_eval(held)
    out, K, V = ext.update_and_attend(q, k, v, K, V, 4, 0.5)  # the cache's names move on to the step's pools
    mx.eval(out, K, V)
    np.testing.assert_array_equal(np.array(held), want_held)
    want_K = before.copy()
    want_K[:, :, 4:5] = np.array(k)
    np.testing.assert_array_equal(np.array(K), want_K)
    with mx.stream(mx.cpu):
        reference = sdpa(q, K[:, :, :5], V[:, :, :5], 0.5, False)
    np.testing.assert_allclose(np.array(out), np.array(reference), atol=1e-6, rtol=1e-5)
