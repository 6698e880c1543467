"""A model split over 1, 2 and 3 ring ranks on this machine (``mlx.launch``):
memory per rank, prefill and decode speed, and the cost of one exchange.

Each run starts the ranks with MLX's own launcher (``mlx.launch --backend
ring -n N --hosts 127.0.0.1``; ``--backend mpi`` or ``nccl`` instead,
``LLM_PTE_PARALLEL`` from ``--parallel``: by layers or by heads), this
script in each (``--rank``): rank by
rank it reports the memory MLX holds once the rank's weights and cache are
loaded, its peak memory (MLX's and the
process's), then, all ranks together, the time of ``--prompt-len`` random
tokens prefilled and ``--new-tokens`` greedy ones through the plugin's decode
loop, and one exchange of a decode step's hidden state (``[1, 1, hidden]``),
median of 200: for a pipeline the hop a step pays per rank boundary (half
the round trip from rank 0 to its neighbour and back), for tensor parallel
one ``all_sum`` (a step runs two a layer). One process (N = 1) is the
reference.

    python benchmarks/bench_split.py MODEL.pte [--ranks 1,2,3] [--parallel pipeline|tensor] [--backend ring|mpi|nccl]

On one machine the ranks share its cores, and a rank waiting in ``recv``
spins on one, so a split runs slower than one process here; the exchange's
cost is what ranks on separate machines pay per step and boundary (or
sum), plus the network's latency.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent


def rank_main(args) -> None:
    from llm_executorch_mlx import distributed
    from llm_executorch_mlx.runtime import load_program

    import mlx.core as mx
    from llm_executorch_mlx.text.generate import Timings, generate_tokens

    program = load_program(args.pte)
    program.prepare_cpu_kernels()
    group = distributed.group()
    if group is not None:
        program = distributed.share(program, group)
    meta = program.metadata
    cache = program.new_cache(capacity=args.prompt_len + args.new_tokens + 8)
    forward = program.load_method("forward", cache=cache)
    mx.eval(cache.state)
    loaded = mx.get_active_memory()  # the rank's weights and its cache's first pools
    prompt = [(7 * i + 3) % meta.vocab_size for i in range(args.prompt_len)]
    timings = Timings()
    t0 = time.perf_counter()
    steps = generate_tokens(forward, cache, prompt, 0, meta.prefill_chunk, lambda row, h: mx.argmax(row),
                            args.new_tokens, timings)
    first = None
    for _ in steps:
        first = first or time.perf_counter()
    end = time.perf_counter()
    exchange = None
    if group is not None and group.size() > 1:
        x = mx.zeros((1, 1, args.hidden), dtype=mx.float32)
        times = []
        for _ in range(200):
            t = time.perf_counter()
            if os.environ.get(distributed.PARALLEL) == "tensor":
                mx.eval(mx.distributed.all_sum(x, group=group))
            elif group.rank() == 0:
                mx.eval(mx.distributed.send(x, 1, group=group))
                mx.eval(mx.distributed.recv_like(x, 1, group=group))
            elif group.rank() == 1:
                y = mx.distributed.recv_like(x, 0, group=group)
                mx.eval(mx.distributed.send(y, 0, group=group))
            times.append(time.perf_counter() - t)
        if os.environ.get(distributed.PARALLEL) == "tensor":
            exchange = 1e3 * statistics.median(times)
        elif group.rank() < 2:  # the hop between ranks 0 and 1: half the round trip
            exchange = 1e3 * statistics.median(times) / 2
    import resource

    rank = 0 if group is None else group.rank()
    # a file per rank: the launchers interleave the ranks' standard output (mpirun's "raw" output mid-line)
    (args.reports / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "ranks": 1 if group is None else group.size(),
        "loaded_bytes": loaded, "mlx_peak_bytes": mx.get_peak_memory(),
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "prefill_tps": args.prompt_len / (first - t0), "decode_tps": (args.new_tokens - 1) / (end - first),
        "exchange_ms": exchange,
    }))


# What each backend needs beside --backend: mpirun's ranks may share cores
# here; NCCL's NVLink multicast stays off (the lent machines ask it).
BACKEND_ARGS = {"ring": [], "mpi": ["--mpi-arg", "--bind-to none"], "nccl": ["--env", "NCCL_NVLS_ENABLE=0"]}


def launch(args, n: int) -> list[dict]:
    import tempfile

    reports = pathlib.Path(tempfile.mkdtemp(prefix="bench_split-"))
    own = [sys.executable, __file__, str(args.pte), "--rank", "--prompt-len", str(args.prompt_len),
           "--new-tokens", str(args.new_tokens), "--hidden", str(args.hidden), "--reports", str(reports)]
    if n == 1:
        command = own
    else:
        launcher = shutil.which("mlx.launch") or str(pathlib.Path(sys.executable).parent / "mlx.launch")
        command = [launcher, "--backend", args.backend, "-n", str(n), "--hosts", "127.0.0.1",
                   "--env", f"LLM_PTE_PARALLEL={args.parallel}", *BACKEND_ARGS[args.backend], "--", *own]
    out = subprocess.run(command, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    rows = [json.loads(f.read_text()) for f in sorted(reports.glob("rank*.json"))]
    shutil.rmtree(reports)
    if len(rows) != n:
        sys.exit(f"{n} ranks: expected {n} reports, got {len(rows)}\n{out.stderr[-2000:]}")
    return sorted(rows, key=lambda r: r["rank"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pte", type=pathlib.Path)
    p.add_argument("--ranks", default="1,2,3", help="group sizes, comma-separated (default: 1,2,3)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--hidden", type=int, default=576, help="the model's hidden size, for the exchange (default: 576)")
    p.add_argument("--backend", choices=tuple(BACKEND_ARGS), default="ring",
                   help="mlx.launch's backend (default: ring; nccl: GPUs, with --parallel tensor)")
    p.add_argument("--parallel", choices=("pipeline", "tensor"), default="pipeline",
                   help="split by layers or every layer by heads (default: pipeline)")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--reports", type=pathlib.Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank:
        return rank_main(args)
    from harness.machine import cpu_model

    print(f"{cpu_model()} ({len(os.sched_getaffinity(0))} cores); {args.pte.name}; {args.prompt_len}-token prompt, "
          f"{args.new_tokens} greedy tokens; split: {args.parallel} over {args.backend}\n")
    print("| ranks | rank | MLX memory once loaded MB | MLX peak MB | process peak RSS MB | prefill tok/s | decode tok/s "
          f"| one {'all_sum' if args.parallel == 'tensor' else 'hop'} ms |\n|---|---|---|---|---|---|---|---|")
    for n in (int(r) for r in args.ranks.split(",")):
        for r in launch(args, n):
            exchange = f"{r['exchange_ms']:.3f}" if r["exchange_ms"] is not None else ""
            print(f"| {n} | {r['rank']} | {r['loaded_bytes'] / 1e6:.0f} | {r['mlx_peak_bytes'] / 1e6:.0f} | "
                  f"{r['max_rss_bytes'] / 1e6:.0f} | {r['prefill_tps']:.1f} | {r['decode_tps']:.2f} | {exchange} |",
                  flush=True)


if __name__ == "__main__":
    main()
