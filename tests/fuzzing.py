"""Fuzzing .pte loading: seeded mutants of a good file, run in a child process.

``Mutator`` derives mutants from a file's bytes (bit flips, random spans,
truncation, extreme 4/8-byte fields, duplicated and deleted spans), biased
towards the bytes that become structure (the program flatbuffer and the MLX
delegate's payload) over the weights. ``Workers`` runs each mutant the way a
user's first prompt does, ``load_program`` -> ``new_cache`` ->
``load_method("forward")`` -> ``execute``, in a child process under an
address-space limit (``RLIMIT_AS``) and a CPU-time limit, and classifies what
happened:

- ``ok``: it ran (a mutant of a weight is still a program);
- ``refused``: a ``PteError`` (ours: the message names the problem);
- ``foreign``: any other exception (its type and message are kept);
- ``memory``: ``MemoryError`` under the limit;
- ``crash``: the child died of a signal or exited;
- ``hang``: the child spent more CPU time than the limit on one mutant.

Everything but ``ok`` and ``refused`` is an escape. The parent process never
imports MLX; the child is restarted after a crash, a hang or a memory error.
Used by ``tests/test_fuzz.py`` (a bounded run) and ``scripts/fuzz_pte.py``
(the long one).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import random
import select
import subprocess
import sys
import tempfile
import time

OUTCOMES = ("ok", "refused", "foreign", "memory", "crash", "hang")
ESCAPES = ("foreign", "memory", "crash", "hang")

# The kinds of file fuzzed: tests/models.py make_fixture arguments.
KINDS = {
    "llama-fp32": ("llama", False, "fp32", None),
    "llama-4w": ("llama", True, "fp32", "4w"),
    "gemma3-ring": ("gemma3", False, "fp32", None),
}

_EXTREMES_32 = (0, 1, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xFFFFFFFE)
_EXTREMES_64 = (0, 1 << 31, 1 << 32, (1 << 63) - 1, 1 << 63, (1 << 64) - 1)


class Mutator:
    """Seeded mutants of ``data``; ``structure`` lists ``(start, end)`` byte
    ranges that become tables and graphs, where most mutations land."""

    def __init__(self, data: bytes, seed: int, structure: list[tuple[int, int]] = ()):
        self.data = data
        self.rng = random.Random(seed)
        self.structure = [(s, e) for s, e in structure if e > s] or [(0, len(data))]

    def _offset(self, n: int) -> int:
        rng = self.rng
        if rng.random() < 0.8:
            start, end = rng.choice(self.structure)
        else:
            start, end = 0, n
        return min(rng.randrange(start, max(start + 1, end)), n - 1)  # earlier cuts shrink n

    def mutate(self) -> tuple[bytes, str]:
        """One mutant and a short description of how it was made."""
        buf = bytearray(self.data)
        done = []
        for _ in range(self.rng.choice((1, 1, 1, 2, 3))):
            done.append(self._one(buf))
        return bytes(buf), "; ".join(done)

    def _one(self, buf: bytearray) -> str:
        rng, n = self.rng, len(buf)
        if n < 16:
            buf.extend(rng.randbytes(8))
            return "grow"
        kind = rng.choice(("flip", "flip", "span", "truncate", "field32", "field32", "field64", "duplicate", "delete"))
        at = self._offset(n)
        if kind == "flip":
            bits = rng.randint(1, 8)
            for _ in range(bits):
                i = min(n - 1, at + rng.randrange(8))
                buf[i] ^= 1 << rng.randrange(8)
            return f"flip {bits} bits at {at}"
        if kind == "span":
            length = min(rng.randint(1, 64), n - at)
            buf[at:at + length] = rng.randbytes(length)
            return f"random {length} bytes at {at}"
        if kind == "truncate":
            del buf[at:]
            return f"truncate at {at}"
        if kind in ("field32", "field64"):
            size = 4 if kind == "field32" else 8
            at -= at % (size if rng.random() < 0.7 else 1)  # fields are aligned; sometimes not
            at = min(at, n - size)
            values = _EXTREMES_32 if size == 4 else _EXTREMES_64
            value = rng.choice(values + (n, rng.getrandbits(size * 8)))
            if rng.random() < 0.3:  # a small nudge of the field that is there
                old = int.from_bytes(buf[at:at + size], "little")
                value = (old + rng.choice((-1, 1, -4, 4, 8, 1 << 16))) % (1 << (size * 8))
            buf[at:at + size] = value.to_bytes(size, "little")
            return f"{size}-byte field {value:#x} at {at}"
        length = min(rng.randint(1, 256), n - at)
        if kind == "duplicate":
            buf[at:at] = buf[at:at + length]
            return f"duplicate {length} bytes at {at}"
        del buf[at:at + length]
        return f"delete {length} bytes at {at}"


def structure_ranges(pte_path) -> list[tuple[int, int]]:
    """The program flatbuffer's bytes and each MLX payload's graph (header
    and flatbuffer, not its weights), read from a good file."""
    from llm_executorch_mlx.runtime.pte.container import PteFile

    pte = PteFile(pte_path)
    ranges = [(0, pte.program_size)]
    named = {pte.named_data_span(k) for k in pte.named_data_keys}
    for start, end in pte._segments:
        if (start, end) not in named:
            ranges.append((start, end))
    pte.close()
    return ranges


# -- the child ---------------------------------------------------------------

def _run_one(path: str) -> tuple[str, str]:
    import mlx.core as mx
    import numpy as np

    from llm_executorch_mlx.runtime import PteError, load_program

    try:
        program = load_program(path)
        cache = program.new_cache()
        forward = program.load_method("forward", cache=cache)
        t = 3
        ids = np.array([[1, 2, 3][:t]], dtype=np.int64)
        pos = np.arange(t, dtype=np.int64)
        inputs = [ids, pos] if forward.n_inputs == 2 else [ids, pos, np.array([t - 1], dtype=np.int64)]
        outputs = forward.execute(inputs)
        mx.eval([o for o in outputs if isinstance(o, mx.array)] + cache.state)
        program.close()
        return "ok", ""
    except PteError as e:
        if _caused_by(e, MemoryError):  # ours in name only: it ran out of memory
            return "memory", f"{type(e).__name__}: {e}"
        return "refused", f"{type(e).__name__}: {e}"
    except MemoryError as e:
        return "memory", f"MemoryError: {e}"
    except Exception as e:
        return "foreign", f"{type(e).__name__}: {e} [{_our_frame(e)}]"
    finally:
        mx.clear_cache()


def _caused_by(e: BaseException, kind: type) -> bool:
    while e is not None:
        if isinstance(e, kind):
            return True
        e = e.__context__
    return False


def _our_frame(e: BaseException) -> str:
    """Where in the package an exception came from (its innermost frame there)."""
    import traceback

    frames = [f for f in traceback.extract_tb(e.__traceback__) if "llm_executorch_mlx" in f.filename]
    return f"{pathlib.Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"


def _worker(memory_limit: int) -> None:
    """Read mutant paths from stdin, one a line; answer one JSON line each."""
    import resource

    import mlx.core as mx  # noqa: F401  (imported before the limit is set)

    out = sys.stdout
    sys.stdout = sys.stderr  # only the answers go to the parent
    vm = 0
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            vm = int(line.split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + memory_limit, vm + memory_limit))
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        outcome, detail = _run_one(line.strip())
        out.write(json.dumps({"outcome": outcome, "detail": detail[:500]}) + "\n")
        out.flush()


class Worker:
    """One child process running mutants; restarted when it dies or hangs.

    Args:
        memory_limit: bytes of address space a child may add to what it maps
            once MLX is imported.
        cpu_limit: seconds of CPU time one mutant may take.
    """

    def __init__(self, memory_limit: int = 1 << 30, cpu_limit: float = 20.0, nice: int = 0):
        self.memory_limit = memory_limit
        self.cpu_limit = cpu_limit
        self.nice = nice
        self.proc = None
        fd, self.path = tempfile.mkstemp(suffix=".pte", prefix="fuzz-")
        os.close(fd)

    def child_call(self) -> str:
        """The Python the child runs (``state_fuzzing.StateWorker`` runs its own)."""
        return f"import fuzzing; fuzzing._worker({self.memory_limit})"

    def _start(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        here = pathlib.Path(__file__).resolve().parent  # this module, and the package beside it
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(here), str(here.parent), os.environ.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", self.child_call()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
            preexec_fn=(lambda: os.nice(self.nice)) if self.nice else None,
        )
        first = self.proc.stdout.readline()
        if first.strip() != b'{"ready": true}':
            raise RuntimeError(f"the fuzzing worker did not start (it said {first[:200]!r})")

    def _cpu_seconds(self) -> float:
        try:
            fields = open(f"/proc/{self.proc.pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def run(self, data: bytes) -> tuple[str, str]:
        """Run one mutant; return (outcome, detail)."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        with open(self.path, "wb") as f:
            f.write(data)
        start = self._cpu_seconds()
        self.proc.stdin.write((self.path + "\n").encode())
        self.proc.stdin.flush()
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready:
                line = self.proc.stdout.readline()
                if line:
                    answer = json.loads(line)
                    if answer["outcome"] == "memory":
                        self.stop()  # its heap may be fragmented past use
                    return answer["outcome"], answer["detail"]
                code = self.proc.wait()
                self.proc = None
                return "crash", f"the worker died ({_exit_text(code)})"
            if self._cpu_seconds() - start > self.cpu_limit:
                self.stop()
                return "hang", f"over {self.cpu_limit:g} s of CPU time"

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def close(self) -> None:
        self.stop()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def _exit_text(code: int) -> str:
    if code < 0:
        import signal

        return f"signal {signal.Signals(-code).name}"
    return f"exit status {code}"


def fuzz(pte_path, mutants: int, seed: int, worker: Worker, report=None, digests=None) -> dict:
    """Run ``mutants`` seeded mutants of ``pte_path``; return counts by outcome
    and, for every escape, (outcome, detail, how the mutant was made, seed)."""
    data = pathlib.Path(pte_path).read_bytes()
    return run_mutants(Mutator(data, seed, structure_ranges(pte_path)), worker, mutants, OUTCOMES, ESCAPES, report,
                       digests)


def run_mutants(mutator: Mutator, worker, mutants: int, outcomes, escaping, report=None, digests=None) -> dict:
    """``mutants`` of ``mutator`` through ``worker.run``: counts by outcome (of
    ``outcomes``) and every one whose outcome is in ``escaping``. ``digests``
    (a list) gets a short hash of each mutant, so that runs of several seeds
    can count their distinct mutants."""
    counts = dict.fromkeys(outcomes, 0)
    escapes = []
    for i in range(mutants):
        mutant, how = mutator.mutate()
        if digests is not None:
            digests.append(hashlib.blake2b(mutant, digest_size=8).hexdigest())
        outcome, detail = worker.run(mutant)
        counts[outcome] += 1
        if outcome in escaping:
            escapes.append({"outcome": outcome, "detail": detail, "mutation": how, "index": i})
        if report is not None:
            report(i, outcome, detail, how)
    return {"counts": counts, "escapes": escapes}



# -- memory at load ------------------------------------------------------------

def _memory_child(warm: str, paths: list[str]) -> None:
    """Print, for each path, one JSON line: its outcome, the growth of peak
    RSS over the process's RSS before it, its file's size and its cache's bytes."""
    import gc

    import mlx.core as mx

    from llm_executorch_mlx.runtime import PteError, load_program

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no {field} in /proc/self/status")

    _run_one(warm)  # what the first load costs once (kernels, MLX's allocator, imports)
    for path in paths:
        gc.collect()
        mx.clear_cache()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # peak RSS := RSS now
        before = status("VmRSS")
        outcome, _ = _run_one(path)
        grown = status("VmHWM") - before
        try:  # the cache it asked for, loaded again to be measured
            program = load_program(path)
            cache_bytes = program.new_cache().nbytes
            program.close()
        except PteError:
            cache_bytes = 0
        print(json.dumps({"outcome": outcome, "grown": grown, "file": os.path.getsize(path),
                          "cache": cache_bytes}), flush=True)


def load_memory(warm, paths) -> list[dict]:
    """How much each of ``paths`` makes a process grow at load and first step
    (``_memory_child``), measured in one fresh child warmed up with ``warm``."""
    here = pathlib.Path(__file__).resolve().parent
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(here), str(here.parent), os.environ.get("PYTHONPATH")]))
    code = f"import fuzzing; fuzzing._memory_child({str(warm)!r}, {[str(p) for p in paths]!r})"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]
