"""The extension's quantized product (``quantized_gemv``, runtime/cpu/
quantized_rows.h) and the quantized matmul node's CPU routes, against MLX's
own ``quantized_matmul`` and against numpy on weights dequantized by hand
from MLX's packing (4 and 8 bits, groups of 32, 64 and 128, 1 to 16 rows,
strided rows), with and without the extension.

Tolerance: the kernel sums in another order than MLX, which the tests allow
1e-5 of sqrt(K) * max|x| * max|w| for (the size of one product's fp32
rounding); and on x86 it takes integer dot products of the weights with x
rounded to int16 per group, each value within 2^-16 of its group's largest
|x|, so an output may differ by up to max|x| * sum_k |w_k| / 65534 more
(``rounding_bound``).
"""

import mlx.core as mx
import numpy as np
import pytest

from llm_executorch_mlx.runtime import PteError, cpu
from llm_executorch_mlx.runtime.interp.layout import interleavable_quantized
from llm_executorch_mlx.runtime.interp.ops import quant
from llm_executorch_mlx.runtime.plan import Layout, Plan


@pytest.fixture(scope="module")
def kernel():
    found = cpu.kernels(build=True)
    assert found.products.on, found.products.why
    return found.extension


def quantized(rng, N, K, bits, group):
    w = mx.array(rng.standard_normal((N, K)).astype(np.float32))
    return mx.quantize(w, group_size=group, bits=bits)


def by_hand(q, scales, biases, bits, group) -> np.ndarray:
    """MLX's affine dequantization written out in numpy: values packed
    least-significant bits first into uint32 words."""
    words = np.array(q).astype(np.uint64)
    per_word = 32 // bits
    shifts = np.arange(per_word, dtype=np.uint64) * bits
    values = (words[..., None] >> shifts) & ((1 << bits) - 1)
    values = values.reshape(words.shape[0], -1).astype(np.float32)
    s = np.repeat(np.array(scales), group, axis=1)
    b = np.repeat(np.array(biases), group, axis=1)
    return values * s + b


def rounding_bound(x, w_hand):
    """The most x's int16 rounding can move an output (quantized_dot.h)."""
    return np.abs(x).max() * np.abs(w_hand).sum(axis=1).max() / 65534


def tolerance(x, w_hand):
    return 1e-5 * np.sqrt(x.shape[-1]) * np.abs(x).max() * np.abs(w_hand).max() + rounding_bound(x, w_hand)


CASES = [
    (bits, group, N, K)
    for bits in (4, 8)
    for group in (32, 64, 128)
    for N, K in ((576, 576), (192, 576), (576, 1536), (7, 256), (1, 128))
    if K % group == 0
]


@pytest.mark.parametrize("bits, group, N, K", CASES)
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 11, 16])
def test_matches_numpy_and_mlx_on_the_stored_weights(kernel, bits, group, N, K, M):
    rng = np.random.default_rng(bits * 1000 + group + N + K + M)
    q, scales, biases = quantized(rng, N, K, bits, group)
    x = rng.standard_normal((1, M, K)).astype(np.float32)
    y = kernel.quantized_gemv(mx.array(x), q, scales, biases, group, bits)
    assert y.shape == (1, M, N) and y.dtype == mx.float32
    w_hand = by_hand(q, scales, biases, bits, group)
    np.testing.assert_allclose(np.array(y), x @ w_hand.T, rtol=0, atol=tolerance(x, w_hand))
    ref = mx.quantized_matmul(mx.array(x), q, scales, biases, True, group, bits)
    np.testing.assert_allclose(np.array(y), np.array(ref), rtol=0, atol=tolerance(x, w_hand))


@pytest.mark.parametrize("bits, group", [(4, 32), (8, 64), (4, 128)])
@pytest.mark.parametrize("M", [1, 5, 16])
def test_several_products_of_one_x_equal_each_alone(kernel, bits, group, M):
    """``quantized_gemvs``: x prepared once, the products one job; each output
    is exactly the single product's (the same rows, the same sums)."""
    rng = np.random.default_rng(bits + group + M)
    weights = [quantized(rng, N, 768, bits, group) for N in (576, 192, 200)]
    x = mx.array(rng.standard_normal((1, M, 768)).astype(np.float32))
    together = kernel.quantized_gemvs(x, *map(list, zip(*weights)), group, bits)
    assert len(together) == 3
    for (q, scales, biases), y in zip(weights, together):
        alone = kernel.quantized_gemv(x, q, scales, biases, group, bits)
        assert y.shape == alone.shape == (1, M, q.shape[0])
        np.testing.assert_array_equal(np.array(y), np.array(alone))
        w_hand = by_hand(q, scales, biases, bits, group)
        np.testing.assert_allclose(np.array(y), np.array(x) @ w_hand.T, rtol=0, atol=tolerance(np.array(x), w_hand))


def test_products_of_one_x_take_weights_of_the_same_k_only(kernel):
    rng = np.random.default_rng(3)
    a, b = quantized(rng, 8, 256, 4, 32), quantized(rng, 8, 512, 4, 32)
    x = mx.array(rng.standard_normal((1, 1, 256)).astype(np.float32))
    with pytest.raises(ValueError, match=r"needs x \[\.\.\., K\]"):
        kernel.quantized_gemvs(x, [a[0], b[0]], [a[1], b[1]], [a[2], b[2]], 32, 4)


def test_a_strided_row_is_read_as_it_is(kernel):
    rng = np.random.default_rng(5)
    q, scales, biases = quantized(rng, 64, 256, 4, 32)
    wide = mx.array(rng.standard_normal((2, 512)).astype(np.float32))
    x = wide[:, ::2]  # two rows, every other column
    y = kernel.quantized_gemv(x, q, scales, biases, 32, 4)
    w_hand = by_hand(q, scales, biases, 4, 32)
    np.testing.assert_allclose(np.array(y), np.array(x) @ w_hand.T, rtol=0, atol=tolerance(np.array(x), w_hand))


@pytest.mark.parametrize("args, message", [
    (lambda q, s, b, x: (x, q, s, b, 32, 3), "bits must be 4 or 8"),
    (lambda q, s, b, x: (x, q, s, b, 16, 4), "group_size must be 32, 64 or 128"),
    (lambda q, s, b, x: (x[..., :128], q, s, b, 32, 4), r"needs x \[\.\.\., K\]"),
    (lambda q, s, b, x: (mx.concatenate([x] * 17, axis=1), q, s, b, 32, 4), "at most 16 rows"),
    (lambda q, s, b, x: (x.astype(mx.bfloat16), q, s, b, 32, 4), "must be float32"),
    # no columns: the row count divided by them (SIGFPE) before it was refused
    (lambda q, s, b, x: (x[..., :0], q, s, b, 32, 4), "at most 16 rows"),
    (lambda q, s, b, x: (x, q, s, b[:4], 32, 4), r"scales \(8,8\), biases \(4,8\)"),
])
def test_bad_inputs_are_refused_with_the_reason(kernel, args, message):
    rng = np.random.default_rng(9)
    q, scales, biases = quantized(rng, 8, 256, 4, 32)
    x = mx.array(rng.standard_normal((1, 1, 256)).astype(np.float32))
    with pytest.raises(ValueError, match=message):
        kernel.quantized_gemv(*args(q, scales, biases, x))


class _Node:
    """The fields of a ``QuantizedMatmulNode`` the builder reads."""

    def __init__(self, group, bits):
        slot = lambda i: type("Slot", (), {"idx": i})()  # noqa: E731
        self.x, self.w, self.scales, self.biases, self.out = (slot(i) for i in range(5))
        self.transpose, self.groupSize, self.bits, self.mode = True, group, bits, b"affine"


class _Context:
    current_node = "QuantizedMatmulNode"

    def __init__(self, kernels, layouts=None):
        self.plan = Plan(True, kernels)
        self.layouts = layouts or {}

    def t(self, slot):
        return slot.idx

    def fixed_constant(self, slot):
        return None  # the frame's arrays come at run time: the load-time shape check is test_fuzz's

    t_opt = out = t


@pytest.mark.parametrize("with_extension", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 4, 16, 17, 37])
@pytest.mark.parametrize("last_row", [False, True])
def test_every_cpu_route_of_the_node_equals_mlx(kernel, with_extension, rows, last_row):
    """The node's routes: the quantized GEMV (up to 16 rows), a dequantized
    weight and BLAS (more), MLX's own op (no extension), and the LM head's
    last-row variant, which during a prefill chunk computes only the last row."""
    kernels = cpu.kernels(build=True)
    if not with_extension:
        kernels = cpu.CpuKernels(kernels.attention, cpu.Use(False, "off for the test"), kernels.blas)
    node = _Node(32, 4)
    run = (quant.build_quantized_matmul_last_row if last_row else quant.build_quantized_matmul)(node, _Context(kernels))
    rng = np.random.default_rng(rows)
    q, scales, biases = quantized(rng, 96, 256, 4, 32)
    x = mx.array(rng.standard_normal((1, rows, 256)).astype(np.float32))
    frame = [x, q, scales, biases, None]
    run(frame)
    expected = mx.quantized_matmul(x[:, -1:] if last_row else x, q, scales, biases, True, 32, 4)
    w_hand = by_hand(q, scales, biases, 4, 32)
    assert frame[4].shape == expected.shape
    np.testing.assert_allclose(np.array(frame[4]), np.array(expected), rtol=0, atol=tolerance(np.array(x), w_hand))


@pytest.mark.parametrize("operands, message", [
    # a fuzzed 4-bit file's (tests/fuzzing.py, llama-4w seed 107 mutant 181):
    # biases computed at load to half the scales' rows
    (lambda x, q, s, b: (x, q, s, b[:48]), "Scales and biases should have the same shape"),
    (lambda x, q, s, b: (x[..., :128], q, s, b), "Last dimension of first input"),
    (lambda x, q, s, b: (x, q, s[:, :4], b[:, :4]), "shapes of the weight and scales are incompatible"),
])
@pytest.mark.parametrize("last_row", [False, True])
def test_operands_the_gemv_would_refuse_meet_mlx_s_own_checks(kernel, operands, message, last_row):
    """Shapes that do not fit together (a corrupt program's) never reach the
    extension, whose refusal would not name the node: MLX's quantized matmul
    says what is wrong."""
    node = _Node(32, 4)
    build = quant.build_quantized_matmul_last_row if last_row else quant.build_quantized_matmul
    run = build(node, _Context(cpu.kernels(build=True)))
    rng = np.random.default_rng(5)
    x = mx.array(rng.standard_normal((1, 3, 256)).astype(np.float32))
    frame = [*operands(x, *quantized(rng, 96, 256, 4, 32)), None]
    with pytest.raises(ValueError, match=message) as refused:
        run(frame)
        mx.eval(frame[4])
    assert str(refused.value).startswith("[quantized_matmul]")


def test_rows_in_more_axes_than_two_are_a_blas_product(kernel):
    """x [2, 3, K]: six rows the GEMV does not take as they lie (it reads the
    last two axes), computed from the dequantized weight instead."""
    run = quant.build_quantized_matmul(_Node(32, 4), _Context(cpu.kernels(build=True)))
    rng = np.random.default_rng(6)
    q, scales, biases = quantized(rng, 96, 256, 4, 32)
    x = mx.array(rng.standard_normal((2, 3, 256)).astype(np.float32))
    frame = [x, q, scales, biases, None]
    run(frame)
    w_hand = by_hand(q, scales, biases, 4, 32)
    np.testing.assert_allclose(np.array(frame[4]), np.array(x) @ w_hand.T, rtol=0,
                               atol=tolerance(np.array(x), w_hand))


@pytest.mark.parametrize("bits, group, N, K", CASES)
def test_dequantize_matches_numpy_and_mlx(kernel, bits, group, N, K):
    rng = np.random.default_rng(bits + group + N + K)
    q, scales, biases = quantized(rng, N, K, bits, group)
    ours = kernel.dequantize(q, scales, biases, group, bits)
    np.testing.assert_allclose(np.array(ours), by_hand(q, scales, biases, bits, group), rtol=1e-6, atol=1e-6)
    # one rounding apart at most: a fused multiply-add where MLX rounds the product first
    np.testing.assert_allclose(np.array(ours), np.array(mx.dequantize(q, scales, biases, group, bits)),
                               rtol=1e-6, atol=1e-6)


# -- the interleaved layout (cpu/quantized_interleaved.h) ---------------------


@pytest.fixture(scope="module")
def lanes(kernel):
    rows = kernel.limits()["interleave_lanes"]
    assert rows in (8, 16), "x86 builds have integer dot products, hence the interleaved layout"
    return rows


INTERLEAVED_CASES = [
    (bits, group, N, K)
    for bits in (4, 8)
    for group in (32, 64, 128)
    for N, K in ((576, 576), (192, 1536), (16, 256), (48, 384))
    if K % group == 0 and K % max(group, 256 // bits) == 0
]


@pytest.mark.parametrize("bits, group, N, K", INTERLEAVED_CASES)
@pytest.mark.parametrize("M", [1, 2, 3, 16, 33, 128])
def test_interleaved_products_match_numpy_and_mlx(kernel, lanes, bits, group, N, K, M):
    """The same products from the interleaved weights, up to 128 rows; the
    same tolerance (x rounded to int16 per group as in the stored layout)."""
    rng = np.random.default_rng(7 * bits + group + N + K + M)
    stored = quantized(rng, N, K, bits, group)
    interleaved = kernel.interleave_quantized(*stored, group, bits)
    assert [a.shape for a in interleaved] == [a.shape for a in stored]
    assert [a.dtype for a in interleaved] == [a.dtype for a in stored]
    x = rng.standard_normal((1, M, K)).astype(np.float32)
    y = kernel.quantized_gemv(mx.array(x), *interleaved, group, bits, interleaved=True)
    w_hand = by_hand(*stored, bits, group)
    assert y.shape == (1, M, N)
    np.testing.assert_allclose(np.array(y), x @ w_hand.T, rtol=0, atol=tolerance(x, w_hand))
    ref = mx.quantized_matmul(mx.array(x), *stored, True, group, bits)
    np.testing.assert_allclose(np.array(y), np.array(ref), rtol=0, atol=tolerance(x, w_hand))


@pytest.mark.parametrize("bits, group, N, K", INTERLEAVED_CASES)
def test_interleaved_dequantize_is_the_transposed_weight(kernel, lanes, bits, group, N, K):
    rng = np.random.default_rng(bits + group + N + K)
    stored = quantized(rng, N, K, bits, group)
    w_t = kernel.dequantize(*kernel.interleave_quantized(*stored, group, bits), group, bits, interleaved=True)
    assert w_t.shape == (K, N)
    np.testing.assert_allclose(np.array(w_t), by_hand(*stored, bits, group).T, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.array(w_t), np.array(mx.dequantize(*stored, group, bits)).T, rtol=1e-6, atol=1e-6)


def test_several_interleaved_products_of_one_x_equal_each_alone(kernel, lanes):
    rng = np.random.default_rng(11)
    weights = [kernel.interleave_quantized(*quantized(rng, N, 512, 4, 32), 32, 4) for N in (576, 192, 2 * lanes)]
    x = mx.array(rng.standard_normal((1, 20, 512)).astype(np.float32))
    together = kernel.quantized_gemvs(x, *map(list, zip(*weights)), 32, 4, interleaved=True)
    for weight, y in zip(weights, together):
        alone = kernel.quantized_gemv(x, *weight, 32, 4, interleaved=True)
        np.testing.assert_array_equal(np.array(y), np.array(alone))


def test_interleaving_takes_whole_blocks_of_rows_only(kernel, lanes):
    rng = np.random.default_rng(13)
    stored = quantized(rng, lanes + 1, 256, 4, 32)
    with pytest.raises(ValueError, match=f"multiple of {lanes} rows"):
        kernel.interleave_quantized(*stored, 32, 4)
    x = mx.array(rng.standard_normal((1, 129, 256)).astype(np.float32))
    ok = kernel.interleave_quantized(*quantized(rng, lanes, 256, 4, 32), 32, 4)
    with pytest.raises(ValueError, match="at most 128 rows"):
        kernel.quantized_gemv(x, *ok, 32, 4, interleaved=True)


@pytest.mark.parametrize("rows", [1, 16, 17, 128, 129])
@pytest.mark.parametrize("last_row", [False, True])
@pytest.mark.parametrize("batch", [1, 2])
def test_the_node_reads_interleaved_weights_on_every_route(kernel, lanes, rows, last_row, batch):
    """A node whose weight program.py interleaved: the GEMV up to 128 rows,
    the interleaved weight dequantized for BLAS above, the last-row LM head."""
    node = _Node(32, 4)
    build = quant.build_quantized_matmul_last_row if last_row else quant.build_quantized_matmul
    run = build(node, _Context(cpu.kernels(build=True), layouts={node.w.idx: Layout.INTERLEAVED}))
    rng = np.random.default_rng(rows)
    stored = quantized(rng, 96, 256, 4, 32)
    x = mx.array(rng.standard_normal((batch, rows, 256)).astype(np.float32))
    frame = [x, *kernel.interleave_quantized(*stored, 32, 4), None]
    run(frame)
    expected = mx.quantized_matmul(x[:, -1:] if last_row else x, *stored, True, 32, 4)
    assert frame[4].shape == expected.shape
    np.testing.assert_allclose(np.array(frame[4]), np.array(expected), rtol=0,
                               atol=tolerance(np.array(x), by_hand(*stored, 4, 32)))


def test_an_x_of_another_width_than_an_interleaved_weight_is_our_error(kernel, lanes):
    """Only the extension reads an interleaved weight, so an x that does not
    fit it (a corrupt program's) is refused here, naming the node."""
    node = _Node(32, 4)
    run = quant.build_quantized_matmul(node, _Context(cpu.kernels(build=True), layouts={node.w.idx: Layout.INTERLEAVED}))
    rng = np.random.default_rng(7)
    x = mx.array(rng.standard_normal((1, 3, 128)).astype(np.float32))
    frame = [x, *kernel.interleave_quantized(*quantized(rng, 96, 256, 4, 32), 32, 4), None]
    with pytest.raises(PteError, match=r"^QuantizedMatmulNode: x of shape \(1, 3, 128\) against a 4-bit weight "
                                       r"of 256 columns: corrupt file\?$"):
        run(frame)


def test_every_quantized_linear_of_an_export_is_interleaved(exported):
    """The layout analysis on a real export: the 4-bit fixture's quantized
    weights are read by their matmuls only, each with scales and biases of
    its own (its init chain computes the biases from the scales)."""
    from llm_executorch_mlx.runtime import load_program
    from llm_executorch_mlx.runtime.pte.graph import node_name

    _, pte = exported("llama", trained=True, dtype="fp32", qlinear="4w")
    graph = load_program(pte)._graph("forward")
    found = interleavable_quantized(graph, Plan(True, cpu.kernels(build=True)).takes_quantized)
    matmul_weights = {i.op.w.idx for c in graph.instructionChains for i in c.instructions
                      if node_name(i) == "QuantizedMatmulNode"}
    assert set(found) == matmul_weights and len(found) > 0
    sides = [slot for s, b, _, _ in found.values() for slot in (s, b)]
    assert len(sides) == len(set(sides))


def test_the_exporters_symmetric_weights_are_read_with_fp16_scales_and_no_biases(exported):
    """torchao's 4w weights are symmetric (b = -8 s): the int8 layout drops
    their biases and holds their scales in fp16, so a decode step reads what
    the file holds less half of each scale and every bias
    (``Program.read_bytes``, counted here from the file's metadata)."""
    from llm_executorch_mlx.runtime import load_program
    from llm_executorch_mlx.runtime.dtypes import mlx_dtype

    _, pte = exported("llama", trained=True, dtype="fp32", qlinear="4w")
    program = load_program(pte)
    program.prepare_cpu_kernels()
    assert program.plan.limits.int8_bits, "x86 builds have integer dot products"
    program.load_method("forward", cache=program.new_cache(capacity=8))
    graph = program._graph("forward")
    found = interleavable_quantized(graph, program.plan.takes_quantized)

    def stored_bytes(tid):
        meta = graph.tensorMeta[tid]
        return int(np.prod([d.value for d in meta.shape])) * mlx_dtype(meta.scalarType).size

    saved = sum(stored_bytes(s) // 2 + stored_bytes(b) for s, b, _, _ in found.values())
    assert found and program.read_bytes("forward") == program.weight_bytes(as_stored=True) - saved


# -- a tied quantized embedding: the table interleaved, its rows looked up there --


@pytest.mark.parametrize("bits, group, N, K", INTERLEAVED_CASES)
@pytest.mark.parametrize("index_dtype", [mx.int32, mx.int64, mx.uint32])
def test_rows_of_an_interleaved_table_are_mlx_s_dequantized_rows(kernel, lanes, bits, group, N, K, index_dtype):
    rng = np.random.default_rng(bits + group + N + K)
    stored = quantized(rng, N, K, bits, group)
    table = kernel.interleave_quantized(*stored, group, bits)
    ids = rng.integers(0, N, (2, 5))
    ids[0, :2] = (0, N - 1)  # the first and last rows, and a repeat
    ids[1, 4] = ids[1, 0]
    indices = mx.array(ids).astype(index_dtype)
    rows = kernel.take_interleaved(*table, indices, group, bits)
    assert rows.shape == (2, 5, K) and rows.dtype == mx.float32
    np.testing.assert_array_equal(np.array(rows), np.array(mx.dequantize(*stored, group, bits)[indices]))
    np.testing.assert_allclose(np.array(rows), by_hand(*stored, bits, group)[ids], rtol=1e-6, atol=1e-6)


def test_a_lookup_past_the_table_reads_a_row_of_it(kernel, lanes):
    """MLX counts a negative index from the end; an index past either end (a
    corrupt input's) reads the nearest row, never memory outside the table."""
    rng = np.random.default_rng(5)
    stored = quantized(rng, 2 * lanes, 64, 4, 32)
    table = kernel.interleave_quantized(*stored, 32, 4)
    rows = np.array(kernel.take_interleaved(*table, mx.array([-1, -2 * lanes, 2 * lanes, -5 * lanes]), 32, 4))
    w = np.array(mx.dequantize(*stored, 32, 4))
    np.testing.assert_array_equal(rows, w[[2 * lanes - 1, 0, 2 * lanes - 1, 0]])


def test_a_lookup_refuses_what_it_cannot_read_with_the_reason(kernel, lanes):
    rng = np.random.default_rng(6)
    table = kernel.interleave_quantized(*quantized(rng, lanes, 64, 4, 32), 32, 4)
    with pytest.raises(ValueError, match="indices must be int32, int64 or uint32"):
        kernel.take_interleaved(*table, mx.array([0.0]), 32, 4)
    odd = quantized(rng, lanes + 1, 64, 4, 32)
    with pytest.raises(ValueError, match=f"multiple of {lanes} rows"):
        kernel.take_interleaved(*odd, mx.array([0]), 32, 4)


@pytest.mark.parametrize("bits", ["4w", "8w"])
def test_a_tied_quantized_embedding_is_interleaved_and_matches_torchao(exported, bits):
    """The LM head multiplies with the embedding's quantized table, which the
    embedding also looks rows up in (SmolLM2's shape): the table is stored
    interleaved for the head's products and the lookup reads that layout;
    the logits are transformers' on torchao's quantization as the exporter
    does it, at every prompt and decode position."""
    import test_parity as parity
    import torch

    import models
    from llm_executorch_mlx.runtime import load_program
    from llm_executorch_mlx.runtime.pte.graph import node_name

    model_dir, pte = exported("llama", trained=True, qlinear=bits, qembedding=bits, tied=True)
    program = load_program(pte)
    graph = program._graph("forward")
    found = interleavable_quantized(graph, Plan(True, cpu.kernels(build=True)).takes_quantized)
    main = graph.instructionChains[graph.mainChainIdx].instructions
    head = main[-1].op.w.idx
    assert node_name(main[-1]) == "QuantizedMatmulNode" and head in found
    assert any(node_name(i) == "TakeNode" and i.op.x.idx == head for i in main)  # the embedding reads it too
    program.prepare_cpu_kernels()
    forward = program.load_method("forward", cache=program.new_cache(capacity=16))
    assert forward.op_names.count("QuantizedGather") == 1 and "DequantizeNode" not in forward.op_names
    for int8 in (False, True):  # the lookup reads either layout
        tokens, ours = parity.greedy(pte, parity.prompt_for(5), parity.NEW_TOKENS, kv_dtype="fp32",
                                     int8_activations=int8)
        reference = models.reference_model(model_dir, qlinear=bits, qembedding=bits, group_size=32, tied=True)
        int8_here = int8 and int(bits[0]) in program.plan.limits.int8_bits
        if int8_here:
            parity.round_linear_inputs_to_int8(reference)
            parity.round_quantized_scales_to_fp16(reference)
        with torch.no_grad():
            ref = reference(input_ids=torch.tensor([tokens[:-1]])).logits[0].numpy()
        if int8_here:
            parity.assert_rounded_close(tokens, ours[:-1], ref)
        else:
            parity.assert_close_where_decisive(tokens, ours[:-1], ref, parity.Q4_REL_TOL)
