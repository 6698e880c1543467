"""A short step's pure runs of ops replayed through ``mx.compile``
(``runtime/interp/compiled_runs.py``).

End to end: greedy decoding with the runs compiled gives the logits of every
op built from Python (``LLM_PTE_COMPILED_STEPS=0``), and the compiled runs do
run; the parity tests (``test_parity.py``) hold the compiled route against
transformers. On hand-made chains: each call's results against numpy while
a run reads a value that changes (keyed, then built op by op), an op that
needs a value on the host (never traced), and which slots a run hands on.
"""

import mlx.core as mx
import numpy as np
import pytest
from test_parity import prompt_for

from llm_executorch_mlx.runtime import load_program
from llm_executorch_mlx.runtime.gpu import attention
from llm_executorch_mlx.runtime.gpu import decode as gpu_decode
from llm_executorch_mlx.runtime.errors import NeedsHost
from llm_executorch_mlx.runtime.interp import compiled_runs
from llm_executorch_mlx.runtime.interp.compiled_runs import CompiledChain
from llm_executorch_mlx.runtime.plan import COMPILED_STEPS_FLAG, Plan


def decode(pte, prompt, new_tokens):
    program = load_program(pte)
    program.prepare_cpu_kernels()
    cache = program.new_cache(capacity=128)
    forward = program.load_method("forward", cache=cache)
    chunk = program.metadata.prefill_chunk
    for start in range(0, len(prompt), chunk):
        ids = np.array([prompt[start : start + chunk]], dtype=np.int64)
        logits = forward.execute([ids, np.arange(start, start + ids.shape[1], dtype=np.int64)])[0]
    rows, tokens = [], list(prompt)
    for _ in range(new_tokens):
        tokens.append(int(np.array(logits[0, -1].astype(mx.float32)).argmax()))
        logits = forward.execute([np.array([[tokens[-1]]]), np.array([len(tokens) - 1], dtype=np.int64)])[0]
        rows.append(np.array(logits.astype(mx.float32))[0, -1])
    return tokens, np.stack(rows)


@pytest.fixture
def chains(monkeypatch):
    """Every ``CompiledChain`` recorded meanwhile, and how many runs replayed."""
    made, replays = [], []
    record, call = CompiledChain.record.__func__, compiled_runs._Run.call

    def recording(cls, *args):
        made.append(record(cls, *args))
        return made[-1]

    def counted(self, ops, frame, rows):
        replays.append(self.trace is not None)
        return call(self, ops, frame, rows)

    monkeypatch.setattr(CompiledChain, "record", classmethod(recording))
    monkeypatch.setattr(compiled_runs._Run, "call", counted)
    return made, replays


@pytest.mark.parametrize("arch,qlinear", [("llama", None), ("llama", "4w"), ("gemma3", None)])
def test_compiled_decode_matches_every_op_built_from_python(exported, arch, qlinear, chains, monkeypatch):
    _, pte = exported(arch, qlinear=qlinear)
    prompt = prompt_for()
    monkeypatch.setenv(COMPILED_STEPS_FLAG, "0")
    tokens, plain = decode(pte, prompt, 8)
    assert not chains[0]
    monkeypatch.setenv(COMPILED_STEPS_FLAG, "1")
    compiled_tokens, compiled = decode(pte, prompt, 8)
    assert compiled_tokens == tokens
    np.testing.assert_array_equal(compiled, plain)
    made, replays = chains
    runs = made[-1].runs  # the decode steps' chain (a short last prefill chunk has its own)
    assert runs and all(not r.off for r in runs.values())
    assert sum(replays) >= 5 * len(runs)  # the steps after the plain one, the recording and the trace replay


def test_the_flag_turns_compiled_runs_off(monkeypatch):
    monkeypatch.setenv(COMPILED_STEPS_FLAG, "0")
    assert not Plan(cpu=True).compiles_steps
    monkeypatch.delenv(COMPILED_STEPS_FLAG)
    assert Plan(cpu=True).compiles_steps


def test_a_cpu_compiles_decode_steps_alone_and_a_cuda_gpu_verifying_calls_too(monkeypatch):
    assert Plan(cpu=True).compiled_rows == 1
    monkeypatch.setattr(gpu_decode, "for_device", lambda: None)  # a GPU without the CUDA kernels (Metal)
    assert Plan(cpu=False).compiled_rows == 1
    monkeypatch.setattr(gpu_decode, "for_device", gpu_decode.MlxOps)
    assert Plan(cpu=False).compiled_rows == attention.MOST_ROWS


def test_steps_of_other_lengths_are_kept_apart():
    arrays = [compiled_runs.step_shape([np.zeros((1, rows), np.int64), np.arange(rows)]) for rows in (1, 2, 6)]
    lists = [compiled_runs.step_shape([[[5] * rows], list(range(rows))]) for rows in (1, 2, 6)]  # as to_mlx takes
    assert len(set(arrays)) == 3 and lists == arrays


def test_a_step_fed_from_the_host_shares_the_compiled_runs_of_one_fed_arrays():
    # a token verified on the host and one sampled on the device: one chain, one recording
    token, position = np.zeros((1, 1), np.uint32), np.zeros(1, np.int64)
    assert compiled_runs.step_shape([token, position]) == compiled_runs.step_shape(
        [mx.array(token), mx.array(position)])
    assert compiled_runs.step_shape([token.astype(np.int64), position]) != compiled_runs.step_shape(
        [mx.array(token), mx.array(position)])


# Hand-made chains: a frame of [x, n, y, z, w, v]; slot 0 a constant, unless told.
X, N, Y, Z, W, V = range(6)


def chain(middle):
    """y = x * 2; ``middle``; w = z + 1; v = -w, then an op beyond the
    frame (never compiled) reading z and v."""
    return [
        ("Double", lambda f: f.__setitem__(Y, f[X] * 2)),
        ("Middle", middle),
        ("PlusOne", lambda f: f.__setitem__(W, f[Z] + 1)),
        ("Negate", lambda f: f.__setitem__(V, -f[W])),
        ("UpdateAndAttendNode", lambda f: f.__setitem__(V, f[V] + 0 * f[Z])),
    ]


def run_steps(ops, values, constants=1):
    x = mx.array([1.0, -2.0, 3.0])
    results, compiled = [], None
    for n in values:
        frame = [x, n, None, None, None, None]
        if compiled is None:
            compiled = CompiledChain.record(ops, frame, kept={V}, constants=constants, rows=1)
        else:
            compiled.run(frame)
        results.append((np.array(frame[Z]), np.array(frame[V])))
    return compiled, results


def spans(compiled):
    return sorted((r.first, r.last) for r in compiled.runs.values())


def test_an_op_reading_a_changing_value_is_built_apart_and_the_rest_stays_compiled():
    ops = chain(lambda f: f.__setitem__(Z, f[Y] + f[N]))
    values = [0, 1, 2, 3, 4]
    compiled, results = run_steps(ops, values)
    x = np.array([1.0, -2.0, 3.0], np.float32)
    for n, (z, v) in zip(values, results):
        np.testing.assert_array_equal(z, 2 * x + n)
        np.testing.assert_array_equal(v, -(2 * x + n + 1))
    assert spans(compiled) == [(2, 3)]  # Double alone is no run; Middle reads n
    assert compiled.runs[2].trace is not None and not compiled.runs[2].off


def test_a_run_with_a_fixed_value_replays_its_trace():
    ops = chain(lambda f: f.__setitem__(Z, f[Y] + f[N]))
    compiled, results = run_steps(ops, [5] * 6)
    for z, v in results:
        np.testing.assert_array_equal(z, [7.0, 1.0, 11.0])
        np.testing.assert_array_equal(v, [-8.0, -2.0, -12.0])
    assert spans(compiled) == [(0, 3)]
    run = compiled.runs[0]
    assert not run.off and run.trace is not None
    assert run.reads == [N] and run.captured == [X]  # x is a constant: captured, not passed
    assert run.outputs == [Z, V]  # y and w are read only inside the run


def test_an_op_that_reads_the_host_is_built_op_by_op():
    def middle(f):
        f[Z] = f[Y] + f[Y].sum().item()  # needs the value on the host: cannot be traced

    compiled, results = run_steps(chain(middle), [0] * 4, constants=0)  # x an input: a tracer
    for z, v in results:
        np.testing.assert_array_equal(z, [6.0, -0.0, 10.0])
        np.testing.assert_array_equal(v, [-7.0, -1.0, -11.0])
    assert compiled.runs[0].off


class Pools:
    """What a cache op's prelude hands its trace: a pool the host may replace."""

    def __init__(self):
        self.pool = mx.array([10.0, 20.0, 30.0])
        self.steps = []  # the host value each prelude read
        self.rows = []  # the tokens each prelude and trace were told the step has

    def op(self, needs_host=False):
        """``UpdateAndAttendNode`` with a prelude, as a GPU's cache kernel has
        (ops/attention.py): v += the pool; ``needs_host``: its trace refuses."""

        def prelude(f, rows):
            self.steps.append(f[N])  # a host value that changes: the host's read, not the run's
            self.rows.append(rows)
            return (self.pool,)

        def traced(f, captured, rows):
            self.rows.append(rows)
            if needs_host:
                raise NeedsHost("refused")
            f[V] = f[V] + captured[0]

        def run(f):
            f[V] = f[V] + prelude(f, 1)[0]

        run.prelude, run.traced = prelude, traced
        return run


def test_a_cache_op_with_a_prelude_joins_the_run_and_a_replaced_pool_is_traced_again():
    pools = Pools()
    ops = chain(lambda f: f.__setitem__(Z, f[Y] + 1))
    ops[-1] = ("UpdateAndAttendNode", pools.op())
    x = np.array([1.0, -2.0, 3.0], np.float32)
    compiled = None
    for n in range(6):
        if n == 3:
            pools.pool = mx.array([-1.0, 0.5, 4.0])  # grown or restored: a new array
        frame = [mx.array(x), n, None, None, None, None]
        if compiled is None:  # a step of three tokens (a verifying call's): what the cache op reserves for
            compiled = CompiledChain.record(ops, frame, kept={V}, constants=1, rows=3)
        else:
            compiled.run(frame)
        np.testing.assert_array_equal(np.array(frame[V]), -(2 * x + 2) + np.array(pools.pool))
    assert pools.steps == list(range(6))  # every step's prelude, once
    assert set(pools.rows) == {3}
    assert spans(compiled) == [(0, 4)]  # the cache op inside the run
    run = compiled.runs[0]
    assert N not in run.reads and run.preludes == [4]
    assert run.captured_arrays[0] is pools.pool


def test_a_cache_op_whose_trace_needs_the_host_is_built_op_by_op():
    pools = Pools()
    ops = chain(lambda f: f.__setitem__(Z, f[Y] + 1))
    ops[-1] = ("UpdateAndAttendNode", pools.op(needs_host=True))
    x = np.array([1.0, -2.0, 3.0], np.float32)
    compiled, results = run_steps(ops, range(5))
    for z, v in results:
        np.testing.assert_array_equal(v, -(2 * x + 2) + np.array([10.0, 20.0, 30.0]))
    assert spans(compiled) == [(0, 3)]  # the rest stays compiled
