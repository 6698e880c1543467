"""Run every benchmark, one after another, and gather their reports.

    python benchmarks/run_all.py                 # the 135M-shaped model (about an hour on 2 cores)
    python benchmarks/run_all.py --shape tiny    # a smoke run of every script

Each script runs in its own process (they time and measure their own
children); their markdown goes to stdout under one heading each, and with
``--out DIR`` every script's markdown and JSON is also kept there.
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
SCRIPTS = {
    "decode": ("bench_decode.py", "Prefill and decode: ours vs mlx-lm vs ExecuTorch XNNPACK"),
    "chat": ("bench_chat.py", "An 8-turn chat: tokens sent and time to first token"),
    "startup": ("bench_startup.py", "Start-up and imports"),
    "memory": ("bench_memory.py", "Memory"),
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Run the benchmarks in benchmarks/ one after another.")
    p.add_argument("--shape", choices=["smollm-135m", "tiny"], default="smollm-135m",
                   help="model shape for the model-based scripts (default: smollm-135m)")
    p.add_argument("--only", default=",".join(SCRIPTS),
                   help=f"comma-separated subset of {','.join(SCRIPTS)} (default: all)")
    p.add_argument("--out", type=pathlib.Path, help="keep each script's markdown and JSON in this folder")
    args = p.parse_args(argv)
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SCRIPTS))
    if unknown:
        p.error(f"unknown benchmark(s) {', '.join(unknown)}: choose among {', '.join(SCRIPTS)}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    failed = []
    for name in chosen:
        script, title = SCRIPTS[name]
        command = [sys.executable, str(HERE / script)]
        if name != "startup":
            command += ["--shape", args.shape]
        if args.out:
            command += ["--json", str(args.out / f"{name}.json")]
        print(f"[run_all] {' '.join(command[1:])}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        result = subprocess.run(command, stdout=subprocess.PIPE, text=True)
        seconds = time.perf_counter() - start
        print(f"## {title}\n\n{result.stdout.strip()}\n\n_({script}, {seconds:.0f} s)_\n", flush=True)
        if args.out:
            (args.out / f"{name}.md").write_text(result.stdout)
        if result.returncode != 0:
            failed.append(f"{script} exited with {result.returncode}")
    if failed:
        sys.exit("; ".join(failed))


if __name__ == "__main__":
    main()
