"""The long fuzz run: mutants of each fixture kind, counts by outcome.

    nice -n 15 python scripts/fuzz_pte.py --mutants 100000 [--kinds llama-fp32,llama-4w,gemma3-ring]
        [--seed 0] [--processes 1] [--memory-mb 512] [--cpu-limit 60] [--json out.json]
        [--atheris-runs N [--atheris-seconds S]] [--states N] [--pte KIND=PATH ...]

Each mutant of the tests' tiny exports (tests/models.py, kept in the tests'
pytest cache; or of the files ``--pte KIND=PATH`` names, so that a machine
without torch and executorch can run it) goes through ``load_program`` ->
``new_cache`` -> ``load_method("forward")`` -> ``execute`` in one child process under an
address-space limit and a CPU-time limit (tests/fuzzing.py), with the CPU
kernel extension built first where it can be; ``--processes P``
runs P such children at once, child p on its share of the mutants with seed
``--seed + p``. Prints one line of counts per kind (with how many of its
mutants were distinct), every escape (foreign exception, memory, crash, hang)
with how its mutant was made and the seed and index that rebuild it, and
exits 1 when there was one.

``--atheris-runs N`` then runs atheris (coverage-guided; the ``fuzz`` extra)
on each target of ``scripts/atheris_targets.py`` (the container and graph
readers, the metadata reader, the tokenizer and template loaders) for N
inputs or ``--atheris-seconds`` each, starting from the kinds' own bytes and
good tokenizer files: anything but an error of ours is a finding.

``--states N`` runs N mutants of a saved cache state of the llama and the
gemma3 fixture (tests/state_fuzzing.py): each must load and continue as a
cold run does, or be ignored in one line and deleted.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys
import threading
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import fuzzing  # noqa: E402


def fixture(kind: str, given: dict[str, pathlib.Path]) -> pathlib.Path:
    """The file fuzzed as ``kind``: the one ``--pte`` names, else the tests'
    export (built with torch and executorch the first time)."""
    if kind in given:
        return given[kind]
    from models import make_fixture

    root = REPO / ".pytest_cache" / "d" / "pte-fixtures"
    root.mkdir(parents=True, exist_ok=True)
    return make_fixture(root, *fuzzing.KINDS[kind])[1]


def named_pte(text: str) -> tuple[str, pathlib.Path]:
    """``KIND=PATH`` of ``--pte``."""
    kind, sep, path = text.partition("=")
    if not sep or kind not in fuzzing.KINDS:
        raise argparse.ArgumentTypeError(f"--pte takes KIND=PATH with KIND one of {', '.join(sorted(fuzzing.KINDS))}"
                                         f" (got {text!r})")
    if not pathlib.Path(path).is_file():
        raise argparse.ArgumentTypeError(f"--pte {kind}: no file at {path}")
    return kind, pathlib.Path(path)


def build_kernels() -> str:
    """Build the CPU kernel extension (once per machine) in a child process,
    since the workers only load a build already there; returns which kernels
    the workers run."""
    code = ("from llm_executorch_mlx.runtime import cpu; k = cpu.kernels(build=True); "
            "print(f'products: {k.products.why}; attention: {k.attention.why}')")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def run_mutants(args) -> dict:
    print(f"CPU kernels: {build_kernels()}", flush=True)
    results = {}
    for kind in args.kinds:
        pte = fixture(kind, args.pte)
        started = time.monotonic()
        seen = dict.fromkeys(fuzzing.OUTCOMES, 0)
        lock = threading.Lock()

        def progress(seed):
            def report(i, outcome, detail, how):
                with lock:
                    seen[outcome] += 1
                    if outcome in fuzzing.ESCAPES:  # as it happens: a run cut short still shows it
                        print(f"  {kind} seed {seed} mutant {i}: {outcome}: {detail}  ({how})", file=sys.stderr,
                              flush=True)
                    if sum(seen.values()) % 2000 == 0:
                        counts = " ".join(f"{k} {v}" for k, v in seen.items())
                        print(f"  {kind}: {sum(seen.values())} mutants, {time.monotonic() - started:.0f} s: {counts}",
                              file=sys.stderr, flush=True)
            return report

        def one(p):
            """Process ``p``'s share of the mutants, of seed ``args.seed + p``."""
            seed = args.seed + p
            share = args.mutants // args.processes + (p < args.mutants % args.processes)
            worker = fuzzing.Worker(memory_limit=args.memory_mb << 20, cpu_limit=args.cpu_limit)
            digests = []
            try:
                result = fuzzing.fuzz(pte, share, seed, worker, progress(seed), digests)
            finally:
                worker.close()
            return [dict(e, seed=seed) for e in result["escapes"]], digests

        with concurrent.futures.ThreadPoolExecutor(args.processes) as pool:  # each thread waits on its child
            parts = list(pool.map(one, range(args.processes)))
        seeds = f"seed {args.seed}" + (f"-{args.seed + args.processes - 1}" if args.processes > 1 else "")
        result = {"counts": dict(seen), "escapes": [e for escapes, _ in parts for e in escapes],
                  "distinct": len({d for _, digests in parts for d in digests}), "seeds": seeds,
                  "processes": args.processes, "seconds": round(time.monotonic() - started, 1)}
        results[kind] = result
        counts = " ".join(f"{k} {v}" for k, v in result["counts"].items())
        print(f"{kind}: {args.mutants} mutants ({result['distinct']} distinct; {seeds}, {args.processes} processes) "
              f"in {result['seconds']:.0f} s: {counts}", flush=True)
        for outcome_detail, n in collections.Counter(
            (e["outcome"], e["detail"]) for e in result["escapes"]
        ).most_common():
            first = next(e for e in result["escapes"] if (e["outcome"], e["detail"]) == outcome_detail)
            print(f"  {n} x {outcome_detail[0]}: {outcome_detail[1]}  (e.g. seed {first['seed']} mutant "
                  f"{first['index']}: {first['mutation']})")
    return results


def run_states(args) -> dict:
    import tempfile

    import state_fuzzing
    from models import make_fixture

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


def run_atheris(args) -> int:
    """atheris on each reader (scripts/atheris_targets.py), seeded with the
    kinds' own files and MLX payloads and good tokenizer files; returns how
    many targets had a finding."""
    from llm_executorch_mlx.runtime.pte.container import PteFile

    corpora = REPO / ".pytest_cache" / "atheris-corpus"
    seeds = {target: corpora / target for target in ("pte", "metadata", "tokenizer")}
    for directory in seeds.values():
        directory.mkdir(parents=True, exist_ok=True)
    for kind in args.kinds:
        pte = fixture(kind, args.pte)
        (seeds["pte"] / f"{kind}.pte").write_bytes(b"\0" + pte.read_bytes())
        f = PteFile(pte)
        for name, plan in f.plans.items():
            for d, delegate in enumerate(plan.delegates):
                (seeds["pte"] / f"{kind}-{name}-{d}.mlx").write_bytes(b"\1" + delegate.payload)
        f.close()
    (seeds["metadata"] / "empty").write_bytes(b"")
    _tokenizer_seeds(seeds["tokenizer"])
    findings = 0
    for target, directory in seeds.items():
        cmd = [sys.executable, str(REPO / "scripts" / "atheris_targets.py"), target,
               f"-runs={args.atheris_runs}", f"-max_total_time={args.atheris_seconds}",
               "-rss_limit_mb=2048", "-timeout=30", "-max_len=1200000", "-print_final_stats=1",
               f"-artifact_prefix={corpora}/{target}-", str(directory)]
        print(f"atheris {target}: up to {args.atheris_runs} runs or {args.atheris_seconds} s", flush=True)
        if subprocess.run(cmd, cwd=REPO).returncode != 0:
            findings += 1
    return findings


def _tokenizer_seeds(directory: pathlib.Path) -> None:
    """One good file of each kind scripts/atheris_targets.py's tokenizer
    target tells apart by its first byte."""
    import tempfile

    from models import LLAMA3_TEMPLATE, make_tokenizer
    from test_text_tokenizer import build_sentencepiece, build_tiktoken

    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        good = make_tokenizer(tmp / "bpe")
        (directory / "tokenizer.json").write_bytes(b"\0" + good.read_bytes())
        (directory / "sentencepiece").write_bytes(b"\1" + build_sentencepiece(tmp / "sp").read_bytes())
        (directory / "tiktoken").write_bytes(b"\1" + build_tiktoken(tmp / "tt").read_bytes())
        (directory / "tokenizer_config.json").write_bytes(b"\2" + (tmp / "bpe" / "tokenizer_config.json").read_bytes())
        (directory / "template").write_bytes(b"\3" + LLAMA3_TEMPLATE.encode())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mutants", type=int, default=100_000, help="mutants per kind")
    p.add_argument("--kinds", type=lambda s: s.split(","), help="default: the --pte kinds, else all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--processes", type=int, default=1,
                   help="workers run at once, each on its share of the mutants with its own seed "
                        "(--seed, --seed + 1, ...)")
    p.add_argument("--memory-mb", type=int, default=512, help="address space a worker may add after importing MLX")
    p.add_argument("--cpu-limit", type=float, default=60.0, help="CPU seconds one mutant may take")
    p.add_argument("--json", type=pathlib.Path, help="write the counts and escapes here")
    p.add_argument("--atheris-runs", type=int, default=0, help="inputs per atheris target (0: no atheris)")
    p.add_argument("--atheris-seconds", type=int, default=600, help="the most time per atheris target")
    p.add_argument("--states", type=int, default=0, help="mutants of a saved cache state per fixture")
    p.add_argument("--pte", type=named_pte, action="append", default=[], metavar="KIND=PATH",
                   help="fuzz this file as KIND instead of building the tests' export (no torch or executorch needed)")
    args = p.parse_args(argv)
    args.pte = dict(args.pte)
    args.kinds = args.kinds or sorted(args.pte or fuzzing.KINDS)
    results = {}
    if args.mutants:
        results = run_mutants(args)
    if args.states:
        results.update(run_states(args))
    escaped = any(r["escapes"] for r in results.values())
    if args.json and results:
        args.json.write_text(json.dumps(results, indent=1))
    if args.atheris_runs and run_atheris(args):
        escaped = True
    return 1 if escaped else 0


if __name__ == "__main__":
    sys.exit(main())
