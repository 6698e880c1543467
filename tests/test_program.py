"""load_program: the public API, metadata, and refusal of bad input."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from llm_executorch_mlx.runtime import PteError, load_program
from llm_executorch_mlx.runtime.pte.graph import decode_graph, encode_graph
from llm_executorch_mlx.runtime.interp.interpreter import GraphExecutor


@pytest.fixture(scope="module")
def llama(exported):
    return exported("llama")


def test_constant_methods_and_metadata_match_the_model_config(llama):
    model_dir, pte = llama
    config = json.loads((model_dir / "config.json").read_text())
    program = load_program(pte)
    assert {"forward", "get_max_ctx_len", "get_prefill_chunk_size", "get_n_caches"} <= program.method_names
    assert program.load_method("get_max_ctx_len").execute([]) == [128]
    m = program.metadata
    assert m.max_context == 128 and m.prefill_chunk == 32
    assert m.vocab_size == config["vocab_size"]
    assert m.n_caches == config["num_hidden_layers"]
    assert m.kv_heads == [config["num_key_value_heads"]] * m.n_caches
    assert m.head_dims == [config["hidden_size"] // config["num_attention_heads"]] * m.n_caches
    assert m.windows == [0] * m.n_caches
    assert m.activation_dtype == "fp32" and m.logits_mode == "full"
    d = m.as_dict()
    assert d["get_max_context_len"] == d["max_context"] == 128
    assert d["get_vocab_size"] == config["vocab_size"]


def test_forward_accepts_numpy_mlx_and_torch_inputs_alike(llama):
    import mlx.core as mx

    _, pte = llama
    program = load_program(pte)
    ids = np.array([[1, 2, 3]], dtype=np.int64)
    pos = np.arange(3, dtype=np.int64)
    results = []
    for convert in (lambda a: a, mx.array, torch.from_numpy, lambda a: a.tolist()):
        forward = program.load_method("forward", cache=program.new_cache(capacity=16))
        results.append(np.array(forward.execute([convert(ids), convert(pos)])[0]))
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])
    assert results[0].shape == (1, 3, 256)


def test_last_position_only_computes_the_lm_head_for_the_last_position(llama):
    """What generation asks for: the logits row it reads, equal to that row of
    the full output, and the same cache either way."""
    _, pte = llama
    program = load_program(pte)
    ids = np.random.default_rng(0).integers(0, 256, (1, 12))
    pos = np.arange(12, dtype=np.int64)
    outputs, caches = [], []
    for last_only in (False, True):
        cache = program.new_cache(capacity=16)
        forward = program.load_method("forward", cache=cache)
        outputs.append(np.array(forward.execute([ids, pos], last_position_only=last_only)[0]))
        caches.append([np.array(a) for a in cache.state])
    full, last = outputs
    assert full.shape == (1, 12, 256) and last.shape == (1, 1, 256)
    np.testing.assert_allclose(last[0, 0], full[0, -1], rtol=1e-5, atol=1e-5)
    for a, b in zip(*caches):
        np.testing.assert_array_equal(a, b)


def _resident_bytes_of(path) -> int:
    """Resident bytes of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        first = line.split(maxsplit=1)[0]
        if "-" in first and ":" not in first:  # a mapping's header line
            inside = line.rstrip().endswith(str(path))
        elif inside and first == "Rss:":
            total += int(line.split()[1]) * 1024
    return total


def test_weights_are_held_once_not_also_as_mapped_file_pages(llama):
    """Constants are copied into MLX arrays; the file's pages are then dropped
    from the mapping, so RSS does not count the weights twice."""
    import pathlib

    path = pathlib.Path(llama[1]).resolve()
    program = load_program(path)
    cache = program.new_cache(capacity=64)
    program.load_method("forward", cache=cache)
    assert program.weight_bytes() > 100_000
    assert _resident_bytes_of(path) < program.weight_bytes() // 10


def test_offgraph_forward_without_a_cache_says_how_to_build_one(llama):
    program = load_program(llama[1])
    with pytest.raises(PteError, match=r"new_cache\(capacity="):
        program.load_method("forward")


def test_too_many_tokens_in_one_call_is_refused(llama):
    program = load_program(llama[1])
    forward = program.load_method("forward", cache=program.new_cache())
    with pytest.raises(PteError, match="accepts at most 32"):
        forward.execute([np.zeros((1, 33), np.int64), np.arange(33)])


def test_window_override_makes_rings_and_lowers_max_write(llama):
    program = load_program(llama[1])
    cache = program.new_cache(capacity=64, windows="8,0")
    assert [g.window for g in cache.layers] == [8, 0]
    assert cache.max_write == 8
    assert cache.state[0].shape[2] == 8 + 8 - 1
    with pytest.raises(PteError, match="window pattern"):
        program.new_cache(windows="8,x")


def test_missing_method_is_named(llama):
    with pytest.raises(PteError, match="no method 'decode'"):
        load_program(llama[1]).load_method("decode")


# -- bad files ---------------------------------------------------------------


def test_empty_file(tmp_path):
    p = tmp_path / "empty.pte"
    p.write_bytes(b"")
    with pytest.raises(PteError, match="empty"):
        load_program(p)


def test_random_bytes(tmp_path):
    p = tmp_path / "noise.pte"
    p.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(PteError, match="not an ExecuTorch"):
        load_program(p)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(PteError, match="no such file"):
        load_program(tmp_path / "nope.pte")
    with pytest.raises(PteError, match="directory"):
        load_program(tmp_path)


@pytest.mark.parametrize("fraction", [0.02, 0.5, 0.99])
def test_truncated_file(llama, tmp_path, fraction):
    data = llama[1].read_bytes()
    p = tmp_path / "cut.pte"
    p.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(PteError, match=r"truncated file: segment \d+ ends at byte \d+, the file has \d+"):
        program = load_program(p)
        program.load_method("forward", cache=program.new_cache())


def test_wrong_payload_magic(llama, tmp_path):
    data = bytearray(llama[1].read_bytes())
    at = data.index(b"MLX0")
    data[at : at + 4] = b"XLM0"
    p = tmp_path / "magic.pte"
    p.write_bytes(bytes(data))
    with pytest.raises(PteError, match="magic"):
        load_program(p)


def test_out_of_range_slot_in_a_well_formed_program(llama):
    program = load_program(llama[1])
    graph = program._graph("forward")
    bad = decode_graph(encode_graph(graph))
    bad.instructionChains[0].instructions[3].op.x.idx = 10_000
    with pytest.raises(PteError, match="slot 10000 out of range"):
        GraphExecutor(decode_graph(encode_graph(bad)), program._load_constants("forward", graph),
                      cache=program.new_cache())


def _export_plain(tmp_path, partitioner):
    from executorch.exir import to_edge_transform_and_lower

    class M(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.linear(x, torch.ones(4, 4)) + 1

    ep = torch.export.export(M(), (torch.ones(2, 4),))
    edge = to_edge_transform_and_lower(ep, partitioner=partitioner)
    p = tmp_path / "plain.pte"
    p.write_bytes(edge.to_executorch().buffer)
    return p


def test_forward_delegated_to_another_backend(tmp_path):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    program = load_program(_export_plain(tmp_path, [XnnpackPartitioner()]))
    with pytest.raises(PteError, match="delegated to XnnpackBackend, not MLXBackend"):
        program.load_method("forward")


def test_undelegated_program_is_refused(tmp_path):
    program = load_program(_export_plain(tmp_path, None))
    with pytest.raises(PteError, match="portable kernel calls"):
        program.load_method("forward")


def test_mlx_program_without_a_cache_runs_without_one(tmp_path):
    """A plain graph lowered to MLX (no off-graph cache) loads with no cache."""
    from llm_executorch_mlx.export import ensure_mlx_export_importable

    ensure_mlx_export_importable()
    from executorch.backends.mlx import MLXPartitioner

    program = load_program(_export_plain(tmp_path, [MLXPartitioner()]))
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    (y,) = program.load_method("forward").execute([x])
    np.testing.assert_allclose(np.array(y), x @ np.ones((4, 4), np.float32) + 1, rtol=1e-6)
    # It does not end in an LM head: asking for the last position changes nothing.
    (y_last,) = program.load_method("forward").execute([x], last_position_only=True)
    np.testing.assert_array_equal(np.array(y_last), np.array(y))


# -- import hygiene ------------------------------------------------------------


def test_a_decode_step_imports_neither_torch_nor_executorch(llama):
    code = f"""
import sys
import numpy as np
from llm_executorch_mlx.runtime import load_program
p = load_program({str(llama[1])!r})
f = p.load_method("forward", cache=p.new_cache(capacity=16))
f.execute([np.array([[1, 2]]), np.arange(2)])[0].tolist()
f.execute([np.array([[3]]), np.array([2])])[0].tolist()
heavy = [m for m in ("torch", "executorch", "executorch.exir", "executorch.runtime", "transformers") if m in sys.modules]
print(heavy)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_importing_the_plugin_is_cheap():
    code = "import sys, llm_executorch_mlx; print([m for m in ('mlx', 'mlx.core', 'torch', 'executorch') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_close_unmaps_the_file_and_loaded_methods_keep_working(llama):
    program = load_program(llama[1])
    forward = program.load_method("forward", cache=program.new_cache(capacity=8))
    program.close()
    out = forward.execute([np.array([[1, 2]]), np.arange(2)])[0]
    assert np.isfinite(np.array(out)).all()


def test_loading_builds_no_cpu_kernels_and_prepare_does(llama, tmp_path):
    """``llm pte register`` loads a method: that must not compile the
    extension (~30 s); a generation's ``prepare_cpu_kernels()`` does."""
    _, pte = llama
    code = (
        "import sys; from llm_executorch_mlx.runtime import load_program; "
        f"p = load_program({str(pte)!r}); p.load_method('forward', cache=p.new_cache(capacity=8)); "
        "print(p.cpu_kernels.attention.on, p.cpu_kernels.products.needs_build, flush=True); "
        "print('PREPARE', file=sys.stderr, flush=True); k = p.prepare_cpu_kernels(); "
        "print(k.attention.on, k.products.on)"
    )
    # a compiler that fails: the attempt shows, without 30 s of compiling
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "CXX": "false"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["False True", "False False"]
    loading, preparing = out.stderr.split("PREPARE")
    assert "building the CPU kernels" not in loading and "building the CPU kernels" in preparing
