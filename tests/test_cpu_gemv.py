"""The extension's few-row product (``gemv``, runtime/cpu/gemv.cpp), its
SwiGLU (``silu_mul``, swiglu.cpp) and RMSNorm (``rms_norm``, rms_norm.cpp)
against numpy, and the host thread's share
of the product (``submit_helping``/``wait_helping``,
which a method's ``submit``/``wait`` call for every decode step on the CPU,
runtime/steps.py)."""

import dataclasses
import json

import mlx.core as mx
import numpy as np
import pytest

from llm_executorch_mlx.runtime import cpu, steps
from llm_executorch_mlx.runtime.plan import Plan
from llm_executorch_mlx.runtime.interp.ops import nn


@pytest.fixture(scope="module")
def kernels():
    found = cpu.kernels(build=True)
    assert found.products.on, found.products.why
    return found


@pytest.fixture(scope="module")
def kernel(kernels):
    return kernels.extension


def weight(rng, N, K):
    return rng.standard_normal((N, K)).astype(np.float32)


@pytest.mark.parametrize(
    "K, N",
    [
        (576, 576),  # SmolLM q and o
        (576, 192),  # k and v
        (1536, 576),  # down: a chunk of four rows
        (576, 49152),  # the LM head: thousands of chunks
        (576, 200),  # chunks of 24 rows, the last one 8: a pass's group of 6 or 3 and a tail
        (13, 7),  # K not a multiple of 8, N not of 4
        (5, 1),
    ],
)
@pytest.mark.parametrize("M", [1, 3, 4, 7, 16, 32, 128])  # a decode step's row; a short chunk's; a prefill chunk's
def test_matches_numpy_for_a_row_major_weight(kernel, K, N, M):
    rng = np.random.default_rng(K + N + M)
    W, x = weight(rng, N, K), rng.standard_normal((1, M, K)).astype(np.float32)
    y = kernel.gemv(mx.array(x), mx.array(W).T)  # the exported linear: x @ W^T
    assert y.shape == (1, M, N)
    np.testing.assert_allclose(np.array(y), x @ W.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("M", [1, 3, 16, 32])
def test_products_of_one_x_are_each_gemv(kernel, dtype, M):
    """gemvs (a layer's q, k, v as one op) computes each product exactly as
    gemv alone does, for weights of different widths."""
    rng = np.random.default_rng(M)
    Ws = [mx.array(weight(rng, N, 576)).astype(dtype) for N in (576, 192, 192)]
    x = mx.array(rng.standard_normal((1, M, 576)).astype(np.float32))
    ys = kernel.gemvs(x, [W.T for W in Ws])
    assert [y.shape for y in ys] == [(1, M, 576), (1, M, 192), (1, M, 192)]
    for y, W in zip(ys, Ws):
        np.testing.assert_array_equal(np.array(y), np.array(kernel.gemv(x, W.T)))
        np.testing.assert_allclose(np.array(y), np.array(x) @ np.array(W.astype(mx.float32)).T, rtol=1e-5, atol=1e-4)


def test_other_layouts_and_a_strided_row_are_read_as_they_are(kernel):
    rng = np.random.default_rng(3)
    W = weight(rng, 40, 24)
    column_major = mx.contiguous(mx.array(W).T)  # [K, N] contiguous: W's columns
    every_other = mx.array(rng.standard_normal((1, 48)).astype(np.float32))[:, ::2]
    rows_apart = mx.array(rng.standard_normal((5, 30)).astype(np.float32))[::2, 3:27]  # 3 rows, strided
    for x in (mx.array(rng.standard_normal((24,)).astype(np.float32)), every_other, rows_apart):
        y = kernel.gemv(x, column_major)
        np.testing.assert_allclose(np.array(y), np.array(x) @ W.T, rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_refused_with_the_reason(kernel):
    x, w = mx.zeros((1, 8)), mx.zeros((8, 4))
    with pytest.raises(ValueError, match="float32"):
        kernel.gemv(x.astype(mx.bfloat16), w)
    with pytest.raises(ValueError, match="M <= 128 rows"):
        kernel.gemv(mx.zeros((129, 8)), w)
    with pytest.raises(ValueError, match="in its last two axes"):
        kernel.gemv(mx.zeros((2, 2, 8)), w)
    with pytest.raises(ValueError, match=r"w \[K, N\]"):
        kernel.gemv(x, mx.zeros((7, 4)))
    with pytest.raises(ValueError, match="one or more weights"):
        kernel.gemvs(x, [])
    with pytest.raises(ValueError, match="all float32 or all bfloat16"):
        kernel.gemvs(x, [w, w.astype(mx.bfloat16)])


class _AddmmNode:
    """The fields of an ``AddmmNode`` the builder reads: ``mat1 @ mat2``, no bias."""

    def __init__(self):
        slot = lambda i: type("Slot", (), {"idx": i})()  # noqa: E731
        self.mat1, self.mat2, self.out = slot(0), slot(1), slot(2)
        self.bias, self.alpha, self.beta = None, 1.0, 1.0


class _Context:
    def __init__(self, kernels):
        self.plan = Plan(True, kernels)

    def t(self, slot):
        return slot if slot is None else slot.idx

    t_opt = out = t


@pytest.mark.parametrize("x, w", [
    # a fuzzed fp32 file's (tests/fuzzing.py, llama-fp32 seed 112 mutant 15):
    # a weight of one row against x's 64 columns
    ((1, 3, 64), (1, 128)),
    ((1, 1, 64), (128, 64)),
    ((1, 3, 0), (0, 8)),
])
def test_a_product_whose_shapes_do_not_fit_meets_mlx_s_own_check(kernels, x, w):
    """The node never hands the GEMV a weight it would refuse (a corrupt
    program's): MLX's matmul says what is wrong, or computes what it can."""
    run = nn.build_addmm(_AddmmNode(), _Context(kernels))
    frame = [mx.ones(x), mx.ones(w), None]
    if x[-1] == 0:  # nothing to sum: zeros, as MLX's product gives
        run(frame)
        assert frame[2].shape == (1, 3, 8) and not mx.any(frame[2]).item()
        return
    with pytest.raises(ValueError, match=r"^\[matmul\] Last dimension of first input"):
        run(frame)


def layer_chain(rng, layers, K=96, N=256):
    """A decode step's shape in small: per layer an up product, an
    element-wise op, a down product and a residual add."""
    x = rng.standard_normal((1, 1, K)).astype(np.float32)
    ups = [weight(rng, N, K) * K**-0.5 for _ in range(layers)]
    downs = [weight(rng, K, N) * N**-0.5 for _ in range(layers)]
    return x, ups, downs


def run_chain(product, x, ups, downs):
    h = x
    for up, down in zip(ups, downs):
        h = h + product(mx.tanh(product(h, up.T)), down.T)
    return h


def numpy_chain(x, ups, downs):
    h = x.astype(np.float64)
    for up, down in zip(ups, downs):
        h = h + np.tanh(h @ up.T) @ down.T
    return h


@pytest.mark.parametrize("helped", [False, True])
def test_a_step_submitted_with_the_host_helping_computes_the_same(kernel, helped):
    rng = np.random.default_rng(7)
    x, ups, downs = layer_chain(rng, 40)
    ups_mx, downs_mx = [mx.array(w) for w in ups], [mx.array(w) for w in downs]
    mx.eval(ups_mx, downs_mx)
    out = run_chain(kernel.gemv, mx.array(x), ups_mx, downs_mx)
    if helped:  # the decode loop's way: queued a slice at a time, then waited on
        kernel.submit_helping([out])
        kernel.wait_helping(out)
    else:  # the stream thread alone: no host thread helps
        mx.eval(out)
    np.testing.assert_allclose(np.array(out), numpy_chain(x, ups, downs), rtol=1e-4, atol=1e-4)


def test_steps_submit_and_wait_are_async_eval_and_a_wait(kernels, kernel):
    helped = Plan(True, kernels).steps
    assert helped != steps.PLAIN
    assert Plan(True, dataclasses.replace(kernels, products=cpu.Use(False, "off"))).steps == steps.PLAIN
    rng = np.random.default_rng(8)
    x, ups, downs = layer_chain(rng, 3)
    first = run_chain(kernel.gemv, mx.array(x), [mx.array(w) for w in ups], [mx.array(w) for w in downs])
    second = first * 2
    helped.submit(first, second)
    helped.wait(second)
    np.testing.assert_allclose(np.array(second), 2 * numpy_chain(x, ups, downs), rtol=1e-4, atol=1e-4)
    helped.wait(mx.zeros(3) + 1)  # never queued: returns, and reading it evaluates it


def test_results_do_not_depend_on_which_thread_ran_a_chunk(kernel):
    # each output is one thread's dot product in a fixed order: bit for bit
    # the same with the host helping and with the stream thread alone
    rng = np.random.default_rng(9)
    x, ups, downs = layer_chain(rng, 30, K=576, N=1536)
    ups_mx, downs_mx = [mx.array(w) for w in ups], [mx.array(w) for w in downs]
    mx.eval(ups_mx, downs_mx)
    alone = run_chain(kernel.gemv, mx.array(x), ups_mx, downs_mx)
    mx.eval(alone)
    for _ in range(3):
        helped = run_chain(kernel.gemv, mx.array(x), ups_mx, downs_mx)
        kernel.submit_helping([helped])
        kernel.wait_helping(helped)
        np.testing.assert_array_equal(np.array(helped), np.array(alone))


@pytest.mark.parametrize("few, fp32_rows", [
    (128, 128),  # the default where the extension is as fast as BLAS at 128 rows
    (4, 128),  # a limit that sends the first chunk to BLAS
    (128, 4),  # a machine where BLAS's sgemm measured faster from 4 rows of an fp32 weight
])
def test_a_model_runs_its_steps_and_short_chunks_with_it_and_long_ones_with_blas(kernel, exported, monkeypatch,
                                                                                 few, fp32_rows):
    from llm_executorch_mlx.runtime import load_program
    from llm_executorch_mlx.runtime.cpu import crossover
    from llm_executorch_mlx.text.generate import Timings, generate_tokens

    assert kernel.limits()["dense_rows"] == 128
    monkeypatch.setenv("LLM_PTE_COMPILED_STEPS", "0")  # counted: the calls each step makes from Python
    real_rows = Plan.dense_rows
    monkeypatch.setattr(Plan, "dense_rows", lambda plan, dtype: min(real_rows(plan, dtype), few))
    monkeypatch.setattr(crossover, "fp32_rows", lambda *args, **kw: fp32_rows)
    few = min(few, fp32_rows)
    rows = []
    real = kernel.gemv
    monkeypatch.setattr(kernel, "gemv", lambda x, w, **kw: rows.append(x.shape[:-1]) or real(x, w, **kw))
    together = kernel.gemvs  # a layer's q, k, v and its gate, up (grouping.py): one row count each
    monkeypatch.setattr(kernel, "gemvs", lambda x, ws, **kw: rows.extend([x.shape[:-1]] * len(ws)) or together(x, ws, **kw))
    _, pte = exported("llama")
    program = load_program(pte)
    assert program.prepare_cpu_kernels().products.on
    cache = program.new_cache(64)
    forward = program.load_method("forward", cache=cache)
    greedy = lambda logits, history: mx.argmax(logits, axis=-1)
    steps = list(generate_tokens(forward, cache, list(range(1, 12)), 0, 8, greedy, 4, Timings()))
    assert len(steps) == 4
    # chunks of 8 and 3 rows, then 3 decode steps (the 4th token is read, not
    # fed): every linear of a step or a chunk of at most `few` rows is the
    # extension's; a longer chunk's are BLAS's, its LM head included (one row)
    per_step = rows.count((1, 3)) + 1  # a chunk's LM head takes its last row only
    assert per_step >= 7 * program.metadata.n_caches
    assert rows.count((1, 8)) == (per_step - 1 if few >= 8 else 0)
    assert rows.count((1, 1)) == 3 * per_step + (2 if few >= 8 else 1)
    assert set(rows) == ({(1, 1), (1, 3), (1, 8)} if few >= 8 else {(1, 1), (1, 3)})


def test_a_helped_step_is_right_while_another_thread_runs_mlx_work(kernel):
    # MLX counts queued tasks across all threads' streams; a helped submit
    # paces itself on its own graph, so a busy neighbour neither stalls it
    # (benchmarks/bench_neighbour.py times that) nor mixes into either result
    import threading

    rng = np.random.default_rng(10)
    x, ups, downs = layer_chain(rng, 20)
    ups_mx, downs_mx = [mx.array(w) for w in ups], [mx.array(w) for w in downs]
    mx.eval(ups_mx, downs_mx)
    expected = numpy_chain(x, ups, downs)
    started, stop, sums = threading.Event(), threading.Event(), []

    def neighbour():  # long chains of small ops on its own (thread's default) stream
        while not stop.is_set():
            y = mx.zeros((64,))
            for _ in range(3000):
                y = y + 1
            started.set()
            mx.eval(y)
            sums.append(float(y.sum()))

    thread = threading.Thread(target=neighbour)
    thread.start()
    try:
        assert started.wait(60)
        done_before, steps = len(sums), 0
        # helped steps until the neighbour has finished two chains meanwhile
        while len(sums) < done_before + 2 or steps < 3:
            out = run_chain(kernel.gemv, mx.array(x), ups_mx, downs_mx)
            kernel.submit_helping([out])
            kernel.wait_helping(out)
            np.testing.assert_allclose(np.array(out), expected, rtol=1e-4, atol=1e-4)
            steps += 1
            assert steps < 10_000, "the neighbour thread never finished a chain"
    finally:
        stop.set()
        thread.join()
    assert sums and set(sums) == {64 * 3000.0}


@pytest.mark.parametrize("K, N", [(576, 576), (1536, 576), (13, 7)])
@pytest.mark.parametrize("M", [1, 5, 32])
def test_bf16_weights_are_widened_as_they_are_read(kernel, K, N, M):
    """A bf16 weight under fp32 compute (kept as stored, program.py): the
    product is the fp32 product of its widened values (widening is exact;
    the compiler may fuse a multiply-add differently in the tail)."""
    rng = np.random.default_rng(K * N)
    W = mx.array(weight(rng, N, K)).astype(mx.bfloat16)
    x = mx.array(rng.standard_normal((1, M, K)).astype(np.float32))
    y = kernel.gemv(x, W.T)
    np.testing.assert_allclose(np.array(y), np.array(kernel.gemv(x, W.astype(mx.float32).T)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.array(y), np.array(x) @ np.array(W.astype(mx.float32)).T, rtol=1e-5, atol=1e-4)


def test_widen_bf16_is_mlx_astype_for_any_view(kernel):
    """What a long chunk's products against bf16 weights multiply with BLAS:
    exactly MLX's widening, for the weight's rows as stored, a transposed
    view, slices and a length that is not a multiple of the vector width."""
    w = mx.array(np.random.default_rng(11).standard_normal((37, 53)).astype(np.float32)).astype(mx.bfloat16)
    for view in (w, w.T, w[:, 3:40], w[::2], w[1:]):
        widened = kernel.widen_bf16(view)
        assert widened.dtype == mx.float32 and widened.shape == view.shape
        assert mx.array_equal(widened, view.astype(mx.float32)).item()
    with pytest.raises(ValueError, match="2-D bfloat16"):
        kernel.widen_bf16(w.astype(mx.float32))


@pytest.mark.parametrize("shape", [(1, 1, 1536), (1, 7, 13), (3,), (2, 130, 96)])
def test_silu_mul_matches_float64(kernel, shape):
    """A SwiGLU's silu(gate) * up (swiglu.cpp): against float64 numpy, for a
    decode step's row, odd lengths (the padded tail) and saturating gates."""
    rng = np.random.default_rng(len(shape))
    gate = rng.standard_normal(shape).astype(np.float32) * 6
    up = rng.standard_normal(shape).astype(np.float32)
    gate.flat[:3] = [100.0, -100.0, 0.0]
    ours = np.array(kernel.silu_mul(mx.array(gate), mx.array(up)))
    g = gate.astype(np.float64)
    np.testing.assert_allclose(ours, g / (1 + np.exp(-g)) * up, rtol=2e-6, atol=1e-30)


def test_silu_mul_reads_views_and_refuses_other_inputs(kernel):
    rng = np.random.default_rng(12)
    gate = mx.array(rng.standard_normal((5, 8)).astype(np.float32)).T  # a transposed view
    up = mx.array(rng.standard_normal((8, 5)).astype(np.float32))
    reference = np.array(gate) / (1 + np.exp(-np.array(gate, dtype=np.float64))) * np.array(up)
    np.testing.assert_allclose(np.array(kernel.silu_mul(gate, up)), reference, rtol=2e-6)
    with pytest.raises(ValueError, match="one shape"):
        kernel.silu_mul(up, up[:, :4])
    with pytest.raises(ValueError, match="float32"):
        kernel.silu_mul(up.astype(mx.bfloat16), up)


def rms_norm_float64(x, w, eps):
    x = np.asarray(x, np.float64)
    y = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    return y if w is None else y * np.asarray(w, np.float64)


@pytest.mark.parametrize("shape", [(1, 1, 576), (128, 576), (1, 7, 13), (5,), (2, 3, 1)])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_matches_float64(kernel, shape, weighted):
    """An RMSNorm (rms_norm.cpp): against float64 numpy and MLX's own op, for
    a decode step's row, a prefill chunk's rows, widths that are not whole
    vectors, and rows of large and tiny magnitude."""
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape).astype(np.float32)
    x.reshape(-1, shape[-1])[0] *= 1e4
    x.reshape(-1, shape[-1])[-1] *= 1e-4
    w = rng.standard_normal(shape[-1]).astype(np.float32) if weighted else None
    ours = kernel.rms_norm(mx.array(x), None if w is None else mx.array(w), 1e-5)
    assert ours.shape == x.shape and ours.dtype == mx.float32
    np.testing.assert_allclose(np.array(ours), rms_norm_float64(x, w, 1e-5), rtol=2e-6, atol=1e-6)
    mlx = mx.fast.rms_norm(mx.array(x), None if w is None else mx.array(w), 1e-5)
    np.testing.assert_allclose(np.array(ours), np.array(mlx), rtol=1e-5, atol=1e-6)


def test_rms_norm_reads_views_and_refuses_other_inputs(kernel):
    rng = np.random.default_rng(13)
    x = mx.array(rng.standard_normal((24, 5)).astype(np.float32)).T  # a transposed view, rows of 24
    pair = mx.array(rng.standard_normal((24, 2)).astype(np.float32))
    w = pair[:, 1]  # a strided weight
    np.testing.assert_allclose(np.array(kernel.rms_norm(x, w, 1e-6)), rms_norm_float64(np.array(x), np.array(w), 1e-6),
                               rtol=2e-6, atol=1e-6)
    with pytest.raises(ValueError, match="float32"):
        kernel.rms_norm(x.astype(mx.bfloat16), w, 1e-6)
    with pytest.raises(ValueError, match="one value per entry"):
        kernel.rms_norm(x, w[:4], 1e-6)
    with pytest.raises(ValueError, match="last axis"):
        kernel.rms_norm(mx.array(1.0), None, 1e-6)


def test_the_norm_node_runs_as_one_op_where_the_extension_is(kernels, tmp_path):
    """On the CPU with the extension, an RMSNorm node's route is its one op
    (not MLX's three or ten nodes), equal to the MLX-op route within
    rounding; other dtypes keep MLX's op."""
    x, w = mx.array(np.random.default_rng(3).standard_normal((1, 1, 64)).astype(np.float32)), mx.ones((64,))
    rms_norm = Plan(True, kernels).rms_norm(1e-5)
    with_extension = rms_norm(x, w, 1e-5)
    dot = tmp_path / "norm.dot"
    mx.export_to_dot(str(dot), with_extension)
    assert '"RmsNorm"' in dot.read_text() and "Square" not in dot.read_text()
    np.testing.assert_allclose(np.array(with_extension), np.array(mx.fast.rms_norm(x, w, 1e-5)), rtol=1e-5)
    bf16 = rms_norm(x.astype(mx.bfloat16), w, 1e-5)
    assert bf16.dtype == mx.float32  # MLX's own op and promotion for other dtypes


def test_the_fp32_crossover_is_measured_once_and_kept(kernels, monkeypatch, tmp_path):
    """The first explicit use times the extension against BLAS and keeps the
    most rows it should take; later processes read that back, and without an
    optimized BLAS (or before any measurement) it takes every chunk it can."""
    from llm_executorch_mlx.runtime.cpu import crossover

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(crossover, "_measured", {})
    args = ("ext.so", kernels.extension, "libblas.so", 128)
    assert crossover.fp32_rows(*args, measure=False) is None  # not measured yet: nothing written
    assert not list(tmp_path.rglob("dense-rows-*"))
    rows = crossover.fp32_rows(*args, measure=True)
    assert rows in (32, 64, 128)
    (kept,) = tmp_path.rglob("dense-rows-*.json")
    record = json.loads(kept.read_text())
    assert record["rows"] == rows and set(record["ms"]) <= {"128", "64"}
    ours, blas = record["ms"]["128"]["ours"], record["ms"]["128"]["blas"]
    assert (rows == 128) == (ours <= blas * crossover.BLAS_MARGIN)
    kept.write_text(json.dumps(dict(record, rows=64)))  # as another process finds it
    monkeypatch.setattr(crossover, "_measured", {})
    assert crossover.fp32_rows(*args, measure=True) == 64
    assert crossover.fp32_rows("ext.so", kernels.extension, None, 128, measure=True) == 128


def products(kernel, rng, x, K, N):
    """A product of each route add_to_product folds into: fp32 and bf16
    weights [K, N], and 4-bit weights as stored and interleaved."""
    w = mx.array(rng.standard_normal((K, N)).astype(np.float32))
    q = mx.quantize(mx.array(rng.standard_normal((N, K)).astype(np.float32)), group_size=32, bits=4)
    return {
        "fp32": lambda: kernel.gemv(x, w),
        "bf16": lambda: kernel.gemv(x, w.astype(mx.bfloat16)),
        "4-bit": lambda: kernel.quantized_gemv(x, *q, 32, 4, interleaved=False),
        "4-bit interleaved": lambda: kernel.quantized_gemv(
            x, *kernel.interleave_quantized(*q, 32, 4), 32, 4, interleaved=True),
    }


@pytest.mark.parametrize("M", [1, 5])
@pytest.mark.parametrize("route", ["fp32", "bf16", "4-bit", "4-bit interleaved"])
def test_a_residual_the_product_adds_is_the_separate_add_exactly(kernel, M, route):
    """The product's op adds the residual after its dot products, rounding
    the sum once as mx.add does: bit-identical, contiguous or not."""
    rng = np.random.default_rng(M)
    K, N = 512, 192
    x = mx.array(rng.standard_normal((1, M, K)).astype(np.float32))
    product = products(kernel, rng, x, K, N)[route]
    residual = mx.array(100 * rng.standard_normal((1, M, N)).astype(np.float32))
    strided = mx.swapaxes(mx.array(np.array(residual).transpose(0, 2, 1).copy()), 1, 2)
    for h in (residual, strided):
        fused = kernel.add_to_product(product(), h)
        assert fused is not None
        np.testing.assert_array_equal(np.array(fused), np.array(mx.add(product(), h)))


def test_add_to_product_declines_what_its_op_cannot_add(kernel):
    rng = np.random.default_rng(3)
    x = mx.array(rng.standard_normal((1, 1, 64)).astype(np.float32))
    w = mx.array(rng.standard_normal((64, 32)).astype(np.float32))
    h = mx.array(rng.standard_normal((1, 1, 32)).astype(np.float32))
    computed = kernel.gemv(x, w)
    mx.eval(computed)
    declined = {
        "computed already": (computed, h),
        "not a product": (x[..., :32] * 2, h),
        "an addend to broadcast": (kernel.gemv(x, w), h[0, 0]),
        "an fp16 addend": (kernel.gemv(x, w), h.astype(mx.float16)),
        "one of several products": (kernel.gemvs(x, [w, w])[0], h),
        "adding already": (kernel.add_to_product(kernel.gemv(x, w), h), h),
    }
    for why, (product, addend) in declined.items():
        assert kernel.add_to_product(product, addend) is None, why
