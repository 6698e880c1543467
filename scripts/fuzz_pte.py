"""The long fuzz run: mutants of each fixture kind, counts by outcome.

    nice -n 15 python scripts/fuzz_pte.py --mutants 100000 [--kinds llama-fp32,llama-4w,gemma3-ring]
        [--seed 0] [--memory-mb 512] [--cpu-limit 60] [--json out.json] [--atheris-runs N] [--states N]

Each mutant of the tests' tiny exports (tests/models.py, kept in the tests'
pytest cache) goes through ``load_program`` -> ``new_cache`` ->
``load_method("forward")`` -> ``execute`` in one child process under an
address-space limit and a CPU-time limit (tests/fuzzing.py). Prints one line
of counts per kind, every escape (foreign exception, memory, crash, hang) with
how its mutant was made, and exits 1 when there was one.

``--atheris-runs N`` then runs N inputs of atheris (coverage-guided; the
``fuzz`` extra) against the container reader (``PteFile``) and the MLX graph
reader (``decode_graph``, with its checks), starting from the kinds' own
bytes: anything but a ``PteError`` is a finding and stops it.

``--states N`` runs N mutants of a saved cache state of the llama and the
gemma3 fixture (tests/state_fuzzing.py): each must load and continue as a
cold run does, or be ignored in one line and deleted.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import fuzzing  # noqa: E402
from models import make_fixture  # noqa: E402


def fixture(kind: str) -> pathlib.Path:
    root = REPO / ".pytest_cache" / "d" / "pte-fixtures"
    root.mkdir(parents=True, exist_ok=True)
    return make_fixture(root, *fuzzing.KINDS[kind])[1]


def run_mutants(args) -> dict:
    results = {}
    for kind in args.kinds:
        pte = fixture(kind)
        worker = fuzzing.Worker(memory_limit=args.memory_mb << 20, cpu_limit=args.cpu_limit)
        started = time.monotonic()

        seen = dict.fromkeys(fuzzing.OUTCOMES, 0)

        def progress(i, outcome, *_):
            seen[outcome] += 1
            if (i + 1) % 2000 == 0:
                counts = " ".join(f"{k} {v}" for k, v in seen.items())
                print(f"  {kind}: {i + 1} mutants, {time.monotonic() - started:.0f} s: {counts}",
                      file=sys.stderr, flush=True)

        try:
            result = fuzzing.fuzz(pte, args.mutants, args.seed, worker, progress)
        finally:
            worker.close()
        result["seconds"] = round(time.monotonic() - started, 1)
        results[kind] = result
        counts = " ".join(f"{k} {v}" for k, v in result["counts"].items())
        print(f"{kind}: {args.mutants} mutants (seed {args.seed}) in {result['seconds']:.0f} s: {counts}", flush=True)
        for outcome_detail, n in collections.Counter(
            (e["outcome"], e["detail"]) for e in result["escapes"]
        ).most_common():
            first = next(e for e in result["escapes"] if (e["outcome"], e["detail"]) == outcome_detail)
            print(f"  {n} x {outcome_detail[0]}: {outcome_detail[1]}  (e.g. mutant {first['index']}: {first['mutation']})")
    return results


def run_states(args) -> dict:
    import tempfile

    import state_fuzzing

    results = {}
    for arch in ("llama", "gemma3"):
        pte = make_fixture(REPO / ".pytest_cache" / "d" / "pte-fixtures", arch, False, "fp32", None)[1]
        started = time.monotonic()
        with tempfile.TemporaryDirectory() as directory:
            worker = state_fuzzing.StateWorker(pte, directory, memory_limit=args.memory_mb << 20,
                                               cpu_limit=args.cpu_limit)
            try:
                result = state_fuzzing.fuzz_states(worker, args.states, args.seed)
            finally:
                worker.close()
        results[f"{arch}-state"] = result
        counts = " ".join(f"{k} {v}" for k, v in result["counts"].items())
        print(f"{arch} saved state: {args.states} mutants (seed {args.seed}) in "
              f"{time.monotonic() - started:.0f} s: {counts}", flush=True)
        for e in result["escapes"][:20]:
            print(f"  {e['outcome']}: {e['detail']}  (mutant {e['index']}: {e['mutation']})")
    return results


ATHERIS_TARGET = """
import sys, tempfile, os
sys.path.insert(0, {tests!r})
import atheris
with atheris.instrument_imports():
    from llm_executorch_mlx.runtime.errors import PteError
    from llm_executorch_mlx.runtime.pte.container import PteFile
    from llm_executorch_mlx.runtime.pte.graph import decode_graph

fd, path = tempfile.mkstemp(suffix=".pte")
os.close(fd)

def one(data):
    kind, body = (data[0] % 2, data[1:]) if data else (0, b"")
    try:
        if kind == 0:
            with open(path, "wb") as f:
                f.write(body)
            PteFile(path).close()
        else:
            decode_graph(body)
    except PteError:
        pass

atheris.Setup(sys.argv, one)
atheris.Fuzz()
"""


def run_atheris(args) -> int:
    """atheris on both readers, seeded with each kind's file and MLX payload."""
    corpus = REPO / ".pytest_cache" / "atheris-corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    from llm_executorch_mlx.runtime.pte.container import PteFile

    for kind in args.kinds:
        pte = fixture(kind)
        (corpus / f"{kind}.pte").write_bytes(b"\0" + pte.read_bytes())
        f = PteFile(pte)
        for name, plan in f.plans.items():
            for d, delegate in enumerate(plan.delegates):
                (corpus / f"{kind}-{name}-{d}.mlx").write_bytes(b"\1" + delegate.payload)
        f.close()
    code = ATHERIS_TARGET.format(tests=str(REPO / "tests"))
    cmd = [sys.executable, "-c", code, f"-runs={args.atheris_runs}", "-rss_limit_mb=2048",
           "-timeout=30", "-max_len=1200000", str(corpus)]
    print(f"atheris: {args.atheris_runs} runs on the container and graph readers", flush=True)
    return subprocess.run(cmd, cwd=REPO).returncode


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mutants", type=int, default=100_000, help="mutants per kind")
    p.add_argument("--kinds", type=lambda s: s.split(","), default=sorted(fuzzing.KINDS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory-mb", type=int, default=512, help="address space a worker may add after importing MLX")
    p.add_argument("--cpu-limit", type=float, default=60.0, help="CPU seconds one mutant may take")
    p.add_argument("--json", type=pathlib.Path, help="write the counts and escapes here")
    p.add_argument("--atheris-runs", type=int, default=0)
    p.add_argument("--states", type=int, default=0, help="mutants of a saved cache state per fixture")
    args = p.parse_args(argv)
    results = {}
    if args.mutants:
        results = run_mutants(args)
    if args.states:
        results.update(run_states(args))
    escaped = any(r["escapes"] for r in results.values())
    if args.json and results:
        args.json.write_text(json.dumps(results, indent=1))
    if args.atheris_runs and run_atheris(args) != 0:
        escaped = True
    return 1 if escaped else 0


if __name__ == "__main__":
    sys.exit(main())
