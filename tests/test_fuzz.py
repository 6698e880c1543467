"""Hostile .pte files: seeded mutants of each fixture kind never escape as
anything but a ``PteError`` (or a clean run), and the escapes fuzzing found
stay fixed. ``scripts/fuzz_pte.py`` is the long run."""

import json
import pathlib
import subprocess
import sys

import pytest

import fuzzing
from llm_executorch_mlx.runtime import PteError, load_program
from llm_executorch_mlx.runtime.interp.interpreter import GraphExecutor
from llm_executorch_mlx.runtime.pte.graph import decode_graph, encode_graph, node_name

MUTANTS = 200  # per kind; ~10 s each here
STATE_MUTANTS = 150  # per arch; ~10 s each here


@pytest.mark.parametrize("kind", sorted(fuzzing.KINDS))
def test_mutants_run_or_are_refused_never_escape(kind, exported):
    _, pte = exported(*fuzzing.KINDS[kind])
    worker = fuzzing.Worker(memory_limit=512 << 20, cpu_limit=60)
    try:
        assert worker.run(pte.read_bytes()) == ("ok", "")  # the file itself runs under the limits
        result = fuzzing.fuzz(pte, MUTANTS, seed=sorted(fuzzing.KINDS).index(kind), worker=worker)
    finally:
        worker.close()
    assert result["escapes"] == []
    counts = result["counts"]
    assert counts["ok"] > 0 and counts["refused"] > MUTANTS // 2, counts  # both paths were exercised


LOAD_SLACK = 16 << 20  # what one load may hold beyond its weights and cache (frames, closures, MLX's pools)


@pytest.mark.parametrize("kind", sorted(fuzzing.KINDS))
def test_loading_a_mutant_takes_at_most_twice_its_size_plus_its_cache(kind, exported, tmp_path):
    """Peak RSS of load -> cache -> forward, over the process's RSS before it
    (docs/design.md: at most 2x the file plus the cache; measured ~1x)."""
    _, pte = exported(*fuzzing.KINDS[kind])
    mutator = fuzzing.Mutator(pte.read_bytes(), seed=100 + sorted(fuzzing.KINDS).index(kind),
                              structure=fuzzing.structure_ranges(pte))
    paths = [pte]
    for i in range(40):
        paths.append(tmp_path / f"m{i}.pte")
        paths[-1].write_bytes(mutator.mutate()[0])
    measured = fuzzing.load_memory(pte, paths)
    assert len(measured) == len(paths) and measured[0]["outcome"] == "ok"
    over = [(str(p), m) for p, m in zip(paths, measured) if m["grown"] > 2 * m["file"] + m["cache"] + LOAD_SLACK]
    assert over == []
    assert {m["outcome"] for m in measured} >= {"ok", "refused"}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_state_mutants_are_noted_and_deleted_never_used_wrongly(arch, exported, tmp_path):
    """Saved cache states truncated, bit-flipped or spliced (state_fuzzing):
    each is loaded and continues as a cold run, or is ignored in one line and
    deleted, never an exception, a crash or tokens of its own."""
    import state_fuzzing

    _, pte = exported(arch)
    worker = state_fuzzing.StateWorker(pte, tmp_path, memory_limit=512 << 20, cpu_limit=60)
    try:
        assert worker.run(worker.good_state()) == ("loaded", "")  # the good state itself is used
        result = state_fuzzing.fuzz_states(worker, STATE_MUTANTS, seed=["llama", "gemma3"].index(arch))
    finally:
        worker.close()
    assert result["escapes"] == []
    assert result["counts"]["ignored"] > STATE_MUTANTS // 2, result["counts"]


def test_mutants_are_reproducible_from_their_seed(exported):
    _, pte = exported(*fuzzing.KINDS["llama-fp32"])
    data = pte.read_bytes()
    a, b, other = (fuzzing.Mutator(data, seed) for seed in (7, 7, 8))
    mutants = [a.mutate() for _ in range(3)]
    assert mutants == [b.mutate() for _ in range(3)]
    assert mutants != [other.mutate() for _ in range(3)]
    assert all(m != data for m, _ in mutants)


SCRIPTS = pathlib.Path(__file__).resolve().parent.parent / "scripts"


def _long_run(*args: str) -> subprocess.CompletedProcess:
    """scripts/fuzz_pte.py's main() in a fresh process, which then says
    whether tests/models.py (torch and executorch) was imported."""
    code = (f"import sys; sys.path.insert(0, {str(SCRIPTS)!r}); import fuzz_pte; rc = fuzz_pte.main({list(args)!r}); "
            "print('models imported' if 'models' in sys.modules else 'models not imported'); sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_the_long_run_fuzzes_the_file_it_is_given_without_building_a_fixture(llama, tmp_path):
    """``--pte KIND=PATH``, for a machine without torch and executorch: the
    counts are those of the same seeded mutants of that file run here."""
    out = tmp_path / "counts.json"
    run = _long_run("--pte", f"llama-fp32={llama[1]}", "--mutants", "20", "--seed", "3", "--json", str(out))
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "models not imported"
    worker = fuzzing.Worker(memory_limit=512 << 20, cpu_limit=60)
    try:
        expected = fuzzing.fuzz(llama[1], 20, seed=3, worker=worker)
    finally:
        worker.close()
    assert {kind: r["counts"] for kind, r in json.loads(out.read_text()).items()} == {"llama-fp32": expected["counts"]}


def test_the_long_run_splits_the_mutants_over_processes_of_consecutive_seeds(llama, tmp_path):
    """``--processes 2``: the counts of 11 mutants of seed 5 and 10 of seed 6
    run one after the other here, and how many distinct mutants they were."""
    out = tmp_path / "counts.json"
    run = _long_run("--pte", f"llama-fp32={llama[1]}", "--mutants", "21", "--seed", "5", "--processes", "2",
                    "--json", str(out))
    assert run.returncode == 0, run.stderr
    worker = fuzzing.Worker(memory_limit=512 << 20, cpu_limit=60)
    try:
        parts = [fuzzing.fuzz(llama[1], n, seed=seed, worker=worker) for n, seed in ((11, 5), (10, 6))]
    finally:
        worker.close()
    data = llama[1].read_bytes()
    mutants = set()
    for n, seed in ((11, 5), (10, 6)):
        mutator = fuzzing.Mutator(data, seed, fuzzing.structure_ranges(llama[1]))
        mutants.update(mutator.mutate()[0] for _ in range(n))
    result = json.loads(out.read_text())["llama-fp32"]
    assert result["counts"] == {k: parts[0]["counts"][k] + parts[1]["counts"][k] for k in fuzzing.OUTCOMES}
    assert (result["distinct"], result["seeds"], result["processes"]) == (len(mutants), "seed 5-6", 2)


@pytest.mark.parametrize("pte, message", [
    ("llama=x.pte", "--pte takes KIND=PATH with KIND one of gemma3-ring, llama-4w, llama-fp32 (got 'llama=x.pte')"),
    ("llama-4w=/nonexistent/x.pte", "--pte llama-4w: no file at /nonexistent/x.pte"),
])
def test_the_long_run_refuses_a_pte_it_cannot_use_in_one_line(pte, message):
    run = _long_run("--pte", pte, "--mutants", "1")
    assert run.returncode == 2
    assert run.stderr.splitlines()[-1].endswith(f"argument --pte: {message}")


# -- the escapes fuzzing found, one each ----------------------------------------


@pytest.fixture(scope="module")
def llama(exported):
    return exported(*fuzzing.KINDS["llama-fp32"])


def _edited(program, edit):
    """forward's MLX program, edited as a corrupt file would have it, read back."""
    graph = decode_graph(encode_graph(program._graph("forward")))
    edit(graph)
    return encode_graph(graph)


def _first(graph, node):
    return next(i for c in graph.instructionChains for i in c.instructions if node_name(i) == node)


@pytest.mark.parametrize("edit, message", [
    # UnicodeDecodeError: a weight's name that is not UTF-8
    (lambda g: setattr(g.namedSlots[0], "name", b"\xe8bad"), r"MLX program: name is not UTF-8 text \(at graph\.namedSlots\[0\]\)"),
    # TypeError "vars() argument must have __dict__": a node of an unknown union type
    (lambda g: setattr(g.instructionChains[0].instructions[2], "opType", 250),
     r"unknown or malformed node \(type 250\) \(at graph\.instructionChains\[0\]\.instructions\[2\]\)"),
    # AttributeError "'NoneType' object has no attribute 'slotType'": a missing required table
    (lambda g: setattr(g.namedSlots[1], "slot", None), r"MLX program: slot is missing \(at graph\.namedSlots\[1\]\)"),
    (lambda g: setattr(_first(g, "AddmmNode").op, "mat2", None), r"AddmmNode: mat2 is missing \(at graph\.instructionChains\[0\]\.instructions\[\d+\]\.op\)"),
    # an index into a list the reader trusts
    (lambda g: setattr(g.inputMap[0], "idx", 1 << 30), r"slot 1073741824 out of range \(the program has \d+\) \(at graph\.inputMap\[0\]\)"),
    (lambda g: setattr(g, "mainChainIdx", 7), r"main chain 7 .* is not one of its 1 chains"),
    # a frame of 2**32 slots
    (lambda g: setattr(g, "numTempTensors", (1 << 32) - 1), r"declares \d+ tensor and \d+ value slots, more than"),
    # ValueError from numpy: a constant of rank 256
    (lambda g: setattr(g.tensorMeta[0], "shape", g.tensorMeta[0].shape * 128), r"rank 256 is more than any tensor has \(64\) \(at graph\.tensorMeta\[0\]\)"),
])
def test_a_corrupt_mlx_program_is_refused_naming_the_field(llama, edit, message):
    program = load_program(llama[1])
    with pytest.raises(PteError, match=message):
        decode_graph(_edited(program, edit))


def test_a_huge_slice_axis_is_refused_not_a_memory_blow_up(llama):
    """A few flipped bytes gave a SliceNode axis 2**30: loading built
    ``(slice(None),) * axis`` (gigabytes)."""
    program = load_program(llama[1])

    def edit(g):
        _first(g, "SliceNode").op.axis.literal = 1 << 30

    graph = decode_graph(_edited(program, edit))
    with pytest.raises(PteError, match=r"SliceNode: axis 1073741824 is out of range for any tensor"):
        GraphExecutor(graph, program._load_constants("forward", program._graph("forward")),
                      cache=program.new_cache())


@pytest.mark.parametrize("field, value", [("bits", 0), ("groupSize", 0), ("groupSize", 1), ("bits", 7)])
def test_quantization_mlx_does_not_run_is_refused_at_load_not_a_sigfpe(exported, field, value):
    """llama-4w mutants 2552, 4497, 13844 of the long run's seed 1: a bits or
    group size field of 0 (or one MLX has no kernel for) made MLX's quantized
    matmul divide by zero and kill the process."""
    program = load_program(exported(*fuzzing.KINDS["llama-4w"])[1])

    def edit(g):
        setattr(_first(g, "QuantizedMatmulNode").op, field, value)

    graph = decode_graph(_edited(program, edit))
    with pytest.raises(PteError, match=r"QuantizedMatmulNode: \d+-bit 'affine' quantization in groups of \d+ is not one MLX runs"):
        GraphExecutor(graph, program._load_constants("forward", program._graph("forward")),
                      cache=program.new_cache())


@pytest.mark.parametrize("scales_shape", [(0, 2), (64, 3), (64,), (32, 2)])
def test_scales_that_do_not_cover_a_quantized_weight_are_refused_at_load_not_a_sigfpe(exported, scales_shape):
    """llama-4w mutant 44519 of the long run's seed 2: a weight's scales of
    shape (0, 4) made MLX's quantized matmul divide by zero at the first step."""
    import mlx.core as mx

    program = load_program(exported(*fuzzing.KINDS["llama-4w"])[1])
    graph = program._graph("forward")
    constants = program._load_constants("forward", graph)
    node = _first(graph, "QuantizedMatmulNode").op
    assert constants[node.w.idx].shape == (64, 8) and constants[node.scales.idx].shape == (64, 2)  # 64 x 64, 4-bit
    constants[node.scales.idx] = mx.zeros(scales_shape)
    with pytest.raises(PteError, match=r"QuantizedMatmulNode: a 4-bit weight of shape \(64, 8\) in groups of 32 "
                                       r"needs scales( and biases)? of shape \(64, 2\), not"):
        GraphExecutor(graph, constants, cache=program.new_cache())


def test_an_invalid_transpose_of_a_weight_is_refused_naming_the_node(llama):
    """IndexError from MLX at load: a weight's transpose with an axis past its rank."""
    program = load_program(llama[1])

    def edit(g):
        _first(g, "TransposeNode").op.perm = [4096, 0]

    graph = decode_graph(_edited(program, edit))
    with pytest.raises(PteError, match=r"TransposeNode \(instruction \d+\) is invalid: .*axis"):
        GraphExecutor(graph, program._load_constants("forward", program._graph("forward")),
                      cache=program.new_cache())


def test_a_weight_name_that_is_not_utf8_in_the_container_is_refused(llama, tmp_path):
    """UnicodeDecodeError reading the program's named-data keys."""
    from llm_executorch_mlx.runtime.pte.container import PteFile

    data = bytearray(llama[1].read_bytes())
    pte = PteFile(llama[1])
    key = pte.named_data_keys[0].encode()
    at = data.index(key, 0, pte.program_size)
    pte.close()
    data[at] = 0xE8
    bad = tmp_path / "key.pte"
    bad.write_bytes(bytes(data))
    with pytest.raises(PteError, match=r"key.pte: named data \d+'s key is not UTF-8 text"):
        load_program(bad)


# -- cache geometry a corrupt file could ask for ----------------------------------


@pytest.mark.parametrize("facts, problem", [
    ({"get_n_caches": 1 << 20}, r"get_n_caches publishes 1048576; expected 0\.\.65536"),
    ({"get_kv_heads": [1 << 30, 2]}, r"get_kv_heads publishes \[1073741824, 2\]; no model has more than 65536"),
    ({"get_windows": [1 << 40, 0]}, r"a window is at most 2147483647 positions"),
    ({"get_max_ctx_len": 1 << 40}, r"get_max_ctx_len publishes 1099511627776; it must be 1\.\.2147483647"),
])
def test_cache_geometry_beyond_any_model_is_refused_at_load(facts, problem):
    from llm_executorch_mlx.runtime.pte.metadata import read_metadata

    raw = {"get_n_caches": 2, "get_kv_heads": [2, 2], "get_head_dims": [16, 16], "get_windows": [16, 0],
           "get_max_ctx_len": 128, **facts}
    with pytest.raises(PteError, match=problem):
        read_metadata(raw, None)


def test_a_cache_no_machine_can_hold_is_refused_before_it_is_allocated(exported):
    """Ring pools are allocated up front: a window of 2**30 positions in fp16 is ~768 GiB."""
    program = load_program(exported(*fuzzing.KINDS["gemma3-ring"])[1])
    with pytest.raises(PteError, match=r"the cache needs 768\.0 GiB up front .*pass a smaller capacity= or windows="):
        program.new_cache(capacity=(1 << 31) - 1, windows=str(1 << 30))
    with pytest.raises(PteError, match=r"capacity 17179869184 is more than the 2147483647 positions"):
        program.new_cache(capacity=1 << 34)


@pytest.mark.parametrize("sizes, problem", [
    ((2,) * 127, r"get_x returns a tensor of rank 127"),  # ValueError from numpy: rank > 64
    ((655360, 786448, 262152, 10, 12, 60, 60, 1, 4, 16, 33554432), r"constant 1 out of range"),  # int64 overflow
])
def test_a_constant_methods_tensor_of_a_corrupt_shape_is_refused(llama, sizes, problem):
    """A corrupt EValue of a constant method (gemma3-ring mutants 2689, 14675
    of the long run's seed 0)."""
    from llm_executorch_mlx.runtime.pte.container import TensorValue

    program = load_program(llama[1])
    with pytest.raises(PteError, match=problem):
        program._constant_tensor("get_x", TensorValue(scalar_type=6, sizes=sizes, data_buffer_idx=1, dynamic=False))
