"""Linear weights stored the way the CPU's one-row SGEMM reads them fastest.

The layout is invisible to the program (same logical tensor, other strides),
so what is checked is which weights get it, that their values are unchanged,
and that an exported model still matches transformers (test_parity.py runs
every model through the same load path).
"""

import mlx.core as mx
import numpy as np
import pytest

from llm_executorch_mlx.runtime import cpu, load_program
from llm_executorch_mlx.runtime.pte._schema import mlx_delegate as md
from llm_executorch_mlx.runtime.pte.graph import decode_graph, encode_graph
from llm_executorch_mlx.runtime.interp.layout import for_blas, matmul_weights
from opgraph import OpGraph


def column_major(a: mx.array) -> bool:
    return memoryview(a).strides == (a.dtype.size, a.shape[0] * a.dtype.size)


def row_major(a: mx.array) -> bool:
    return memoryview(a).strides == (a.shape[1] * a.dtype.size, a.dtype.size)


def linear_program(x, weights, transposed_but_added):
    """``x @ W.T`` for each weight, plus one transposed constant added, not multiplied."""
    g = OpGraph()
    xs = g.input(x)
    for w in weights:
        wt, y = g.temp(), g.temp()
        g.node(md.TransposeNodeT, x=g.constant(w), out=wt, perm=[1, 0])
        g.node(md.AddmmNodeT, mat1=xs, mat2=wt, out=y, alpha=1.0, beta=1.0)
        g.output(y)
    wt, y = g.temp(), g.temp()
    g.node(md.TransposeNodeT, x=g.constant(transposed_but_added), out=wt, perm=[1, 0])
    g.node(md.AddNodeT, a=xs, b=wt, out=y)
    g.output(y)
    return g


def test_only_constants_a_matmul_reads_transposed_are_linear_weights():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 4)).astype(np.float32)
    tall, wide = rng.standard_normal((8, 4)), rng.standard_normal((3, 4))
    added = rng.standard_normal((4, 1))
    g = linear_program(x, [tall.astype(np.float32), wide.astype(np.float32)], added.astype(np.float32))
    graph, constants = g.build()
    assert matmul_weights(decode_graph(encode_graph(graph))) == {0, 1}


def test_tall_float32_weights_become_column_major_with_the_same_values():
    rng = np.random.default_rng(1)
    tall = mx.array(rng.standard_normal((8, 4)).astype(np.float32))
    wide = mx.array(rng.standard_normal((3, 4)).astype(np.float32))
    half = tall.astype(mx.bfloat16)
    laid = [for_blas(w) for w in (tall, wide, half)]
    mx.eval(laid)
    assert column_major(laid[0]) and row_major(laid[1]) and row_major(laid[2])
    for before, after in zip((tall, wide, half), laid):
        assert after.shape == before.shape and mx.array_equal(after, before).item()


def test_relaid_weights_compute_the_same_products():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 4)).astype(np.float32)
    ws = [rng.standard_normal(s).astype(np.float32) for s in ((8, 4), (3, 4))]
    g = linear_program(x, ws, np.zeros((4, 5), np.float32))
    graph, constants = g.build()
    graph = decode_graph(encode_graph(graph))
    laid = [for_blas(c) if i in matmul_weights(graph) else c for i, c in enumerate(constants)]
    from llm_executorch_mlx.runtime.interp.interpreter import GraphExecutor

    outs = GraphExecutor(graph, laid).execute([x])
    for w, y in zip(ws, outs):
        np.testing.assert_allclose(np.array(y), x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_exported_linear_weights_take_the_blas_layout_without_the_compiled_products(exported, arch, monkeypatch):
    _, pte = exported(arch)
    monkeypatch.setenv(cpu.PRODUCTS_FLAG, "0")
    program = load_program(pte)
    assert not program.prepare_cpu_kernels().products.on
    constants = program._load_constants("forward", program._graph("forward"))
    graph = program._graph("forward")
    linear = matmul_weights(graph)
    # q, k, v, o, gate, up, down per layer (+ the LM head when untied)
    assert len(linear) >= 7 * program.metadata.n_caches
    for tid in linear:
        w = constants[tid]
        rows, cols = w.shape
        assert column_major(w) if rows >= cols else row_major(w), (tid, w.shape)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_linear_weights_stay_row_major_for_the_compiled_products(exported, arch):
    """Its dot-product loops read each output's weights as one contiguous row."""
    _, pte = exported(arch)
    program = load_program(pte)
    assert program.prepare_cpu_kernels().products.on, program.cpu_kernels.products.why
    graph = program._graph("forward")
    constants = program._load_constants("forward", graph)
    linear = matmul_weights(graph)
    assert len(linear) >= 7 * program.metadata.n_caches
    assert all(row_major(constants[tid]) for tid in linear)
