"""Fuzzing saved cache states (text/saved_states.py): seeded mutants of a good
state, each found, loaded and continued in a child process.

The child (``StateWorker``) saves a good state once: ``STATE_IDS`` prefilled
into a cache of a fixture .pte (past gemma3's 16-position window, so a ring
layer holds only its last cells), and greedily decodes ``CONTINUATION``
tokens after ``PROMPT`` (the state's ids and a few more) on a cold cache:
the reference. Each mutant of the state's bytes (``fuzzing.Mutator``, most
mutations in the safetensors header and our JSON header, the rest in the
arrays) is put under the state's name and goes the way a turn's does:
``StateStore.states`` -> ``usable`` -> ``load`` into a fresh cache, then the
same greedy decode after ``PROMPT`` from what was loaded (cold when
nothing was). What happened:

- ``loaded``: it was loaded and continued with the reference's tokens (a
  mutation that changed nothing the state means, say in JSON whitespace);
- ``ignored``: one one-line note, the file deleted, and the cold run's tokens;
- ``wrong``: tokens other than the reference's (loaded or not);
- ``silent``: not used, yet neither noted nor deleted;
- ``foreign``, ``memory``, ``crash``, ``hang``: as in ``fuzzing``.

Everything but ``loaded`` and ``ignored`` is an escape. Used by
``tests/test_fuzz.py`` (bounded) and ``scripts/fuzz_pte.py --states N``.
"""

from __future__ import annotations

import json
import pathlib
import sys

import fuzzing

STATE_OUTCOMES = ("loaded", "ignored", "wrong", "silent", "foreign", "memory", "crash", "hang")
STATE_ESCAPES = ("wrong", "silent", "foreign", "memory", "crash", "hang")
STATE_IDS = [(7 * i + 3) % 200 + 1 for i in range(40)]
PROMPT = STATE_IDS + [5, 9, 17]
CONTINUATION = 4
POLICY = {"capacity": 128, "dtype": "fp32", "fuzzing": True}


class _Child:
    """What the child keeps between mutants: the program, a cache, the good state."""

    def __init__(self, pte: str, directory: pathlib.Path):
        import mlx.core as mx

        from llm_executorch_mlx.runtime import load_program
        from llm_executorch_mlx.text.generate import prefill
        from llm_executorch_mlx.text.saved_states import StateStore, model_identity

        self.program = load_program(pte)
        self.identity = model_identity(pte)
        self.directory = directory
        self.notes: list[str] = []
        self.store = StateStore(directory, 1 << 40, self.notes.append)
        self.cache = self.program.new_cache(capacity=POLICY["capacity"], dtype=POLICY["dtype"])
        self.forward = self.program.load_method("forward", cache=self.cache)
        self.chunk = self.program.metadata.prefill_chunk
        prefill(self.forward, self.cache, STATE_IDS, 0, self.chunk)
        mx.eval(self.cache.state)
        self.good = self.store.save(self.identity, POLICY, self.cache, STATE_IDS, [["a reply", STATE_IDS[-3:]]])
        self.good_bytes = self.good.read_bytes()
        self.reference = self.continue_from(0)

    def continue_from(self, held: int) -> list[int]:
        """Greedy tokens after ``PROMPT``, the cache holding its first ``held`` ids."""
        import mlx.core as mx

        from llm_executorch_mlx.text.generate import Timings, generate_tokens

        if not held:
            self.cache.clear()
        steps = generate_tokens(self.forward, self.cache, PROMPT, held, self.chunk,
                                lambda logits, _: mx.argmax(logits), CONTINUATION, Timings())
        return [s.token for s in steps]

    def run(self, mutant: str) -> tuple[str, str]:
        import mlx.core as mx

        self.notes.clear()
        self.good.write_bytes(pathlib.Path(mutant).read_bytes())
        try:
            loaded = 0
            for state in self.store.states(self.identity, POLICY):
                n = state.usable(PROMPT)
                if n and self.store.load(state, n, self.cache):
                    loaded = n
                    break
            tokens = self.continue_from(loaded)
        except MemoryError as e:
            return "memory", f"MemoryError: {e}"
        except Exception as e:
            return "foreign", f"{type(e).__name__}: {e} [{fuzzing._our_frame(e)}]"
        finally:
            mx.clear_cache()
        if tokens != self.reference:
            return "wrong", f"{tokens} instead of {self.reference} (loaded {loaded} ids; notes {self.notes})"
        if loaded:
            return "loaded", ""
        if len(self.notes) == 1 and "\n" not in self.notes[0] and not self.good.exists():
            return "ignored", self.notes[0]
        return "silent", f"notes {self.notes}, the file {'kept' if self.good.exists() else 'deleted'}"


def _state_worker(memory_limit: int, pte: str, directory: str) -> None:
    """The child: build the good state, say where it is, then run mutants as
    ``fuzzing._worker`` does."""
    import resource

    out = sys.stdout
    sys.stdout = sys.stderr
    child = _Child(pte, pathlib.Path(directory))
    vm = 0
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            vm = int(line.split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + memory_limit, vm + memory_limit))
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        outcome, detail = child.run(line.strip())
        out.write(json.dumps({"outcome": outcome, "detail": detail[:500]}) + "\n")
        out.flush()


class StateWorker(fuzzing.Worker):
    """A ``fuzzing.Worker`` whose child runs state mutants of ``pte``'s good
    state, kept in ``directory`` (``good_state`` reads it)."""

    def __init__(self, pte, directory, **limits):
        super().__init__(**limits)
        self.pte, self.directory = str(pte), pathlib.Path(directory)

    def child_call(self) -> str:
        return (f"import state_fuzzing; state_fuzzing._state_worker({self.memory_limit}, "
                f"{self.pte!r}, {str(self.directory)!r})")

    def good_state(self) -> bytes:
        """The good state's bytes (the child saves it when it starts)."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        (path,) = self.directory.glob("*.safetensors")
        return path.read_bytes()


def state_structure(data: bytes) -> list[tuple[int, int]]:
    """A safetensors file's header (its JSON, with our state header inside) and its arrays."""
    end = 8 + int.from_bytes(data[:8], "little")
    return [(0, end), (end, len(data))]


def fuzz_states(worker: StateWorker, mutants: int, seed: int, report=None) -> dict:
    """Run ``mutants`` seeded mutants of the worker's good state; counts by
    outcome and every escape, as ``fuzzing.fuzz`` returns them."""
    data = worker.good_state()
    mutator = fuzzing.Mutator(data, seed, state_structure(data))
    return fuzzing.run_mutants(mutator, worker, mutants, STATE_OUTCOMES, STATE_ESCAPES, report)
