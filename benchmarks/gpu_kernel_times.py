"""Each GPU kernel's own time in our decode step, under Nsight Compute.

``step_profile.py`` splits a step into host work and waiting; this says what
the GPU does while the host waits. It runs the plugin's decode loop
(``generate_tokens``) on one ``.pte`` under ``ncu`` (clocks and caches left
alone), profiles ``--steps`` decode steps after a few untimed ones, and
prints each kernel's time a step, summed by kernel name, and the total. A
total near the step's wall time means the GPU is busy the whole step (its
kernels are what to make faster); a total far under it means the GPU idles
while the host encodes.

ncu runs one kernel at a time, so launch gaps vanish here: the total is the
GPU's own work, not the step's wall time.

    python benchmarks/gpu_kernel_times.py --pte model.pte     # on the GPU machine
    python benchmarks/gpu_kernel_times.py --pte model.pte --details 'pte_decode' --count 5
    LLM_PTE_GPU_KERNELS=0 python benchmarks/gpu_kernel_times.py --pte model.pte   # MLX's own ops
"""

from __future__ import annotations

import argparse
import collections
import csv
import ctypes
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

from harness.models import random_prompt

WARM_STEPS = 4


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pte", type=pathlib.Path, required=True, help="the .pte to decode with")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prompt length (default: 512)")
    p.add_argument("--steps", type=int, default=3, help="decode steps to profile (default: 3)")
    p.add_argument("--ncu", default=shutil.which("ncu") or "ncu", help="the ncu to run (default: on PATH)")
    p.add_argument("--top", type=int, default=25, help="kernels to list, longest first (default: 25)")
    p.add_argument("--details", metavar="REGEX",
                   help="instead: ncu's full report (throughput, occupancy, stalls) of the kernels "
                        "whose names match, from the first profiled step")
    p.add_argument("--count", type=int, default=5, help="with --details: kernels to report (default: 5)")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


class ProfiledSteps:
    """Wraps ``forward.execute``: starts the CUDA profiler at decode step
    ``WARM_STEPS`` and stops it ``steps`` steps later, with the device idle
    at both edges so each profiled kernel belongs to a profiled step."""

    def __init__(self, forward, mx, steps: int):
        self.forward, self.mx, self.steps = forward, mx, steps
        self.n_inputs, self.wait, self.submit = forward.n_inputs, forward.wait, forward.submit
        self.queue_on_build = forward.queue_on_build
        self.decode_steps = 0
        self.cuda = ctypes.CDLL("libcuda.so.1")

    def execute(self, inputs, last_position_only=False):
        if isinstance(inputs[0], self.mx.array):  # decode steps get the token as a device array
            if self.decode_steps in (WARM_STEPS, WARM_STEPS + self.steps):
                self.mx.synchronize()
                (self.cuda.cuProfilerStart if self.decode_steps == WARM_STEPS else self.cuda.cuProfilerStop)()
            self.decode_steps += 1
        return self.forward.execute(inputs, last_position_only)


def inner(args) -> None:
    from llm_executorch_mlx.runtime import load_program

    import mlx.core as mx

    from llm_executorch_mlx.text import generate
    from llm_executorch_mlx.text.sampling import Sampler

    program = load_program(args.pte)
    program.prepare_cpu_kernels()
    prompt = random_prompt(0, program.metadata.vocab_size or 1000, args.prompt_tokens)
    cache = program.new_cache(capacity=program.metadata.max_context or len(prompt) + 64)
    forward = ProfiledSteps(program.load_method("forward", cache=cache), mx, args.steps)
    sampler = Sampler(temperature=0.0)
    steps = generate.generate_tokens(
        forward, cache, prompt, 0, cache.max_write or program.metadata.prefill_chunk or len(prompt),
        lambda logits, history: sampler.sample(logits), WARM_STEPS + args.steps + 2, generate.Timings(),
    )
    for _ in steps:
        pass
    mx.synchronize()


def kernel_name(raw: str) -> str:
    """A kernel's name without its template arguments and parameters."""
    name = re.sub(r"\(.*", "", raw)
    while "<" in name:
        name = re.sub(r"<[^<>]*>", "", name)
    return name.strip() or raw


def details(args) -> int:
    """ncu's own report, all sections, of ``--count`` matching kernels."""
    cmd = [args.ncu, "--clock-control", "none", "--profile-from-start", "off", "--set", "full",
           "--kernel-name", f"regex:{args.details}", "--launch-count", str(args.count),
           sys.executable, __file__, "--inner", "--pte", str(args.pte),
           "--prompt-tokens", str(args.prompt_tokens), "--steps", "1"]
    return subprocess.run(cmd, env=os.environ.copy()).returncode


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.inner:
        inner(args)
        return 0
    if args.details:
        return details(args)
    with tempfile.TemporaryDirectory() as tmp:
        log = pathlib.Path(tmp) / "ncu.csv"
        cmd = [args.ncu, "--clock-control", "none", "--cache-control", "none", "--profile-from-start", "off",
               "--metrics", "gpu__time_duration.sum", "--csv", "--print-units", "base", "--log-file", str(log),
               sys.executable, __file__, "--inner", "--pte", str(args.pte),
               "--prompt-tokens", str(args.prompt_tokens), "--steps", str(args.steps)]
        done = subprocess.run(cmd, env=os.environ.copy())
        if done.returncode or not log.exists():
            print(f"ncu exited with {done.returncode}; its log:\n{log.read_text() if log.exists() else '(none)'}")
            return 1
        text = log.read_text()
    rows = list(csv.DictReader(line for line in text.splitlines() if line.startswith('"')))
    times, counts = collections.Counter(), collections.Counter()
    for row in rows:
        if row.get("Metric Name") == "gpu__time_duration.sum":
            name = kernel_name(row["Kernel Name"])
            times[name] += float(row["Metric Value"].replace(",", "")) / args.steps
            counts[name] += 1 / args.steps
    if not times:
        print("ncu profiled no kernels; its log:\n" + text[-4000:])
        return 1
    route = "MLX's own ops" if os.environ.get("LLM_PTE_GPU_KERNELS") == "0" else "the decode-step kernels"
    print(f"# GPU kernel time a decode step: {args.pte.name}, {route}, "
          f"{args.steps} steps after {WARM_STEPS}\n")
    print("| kernel | launches a step | µs a step | share |\n|---|---|---|---|")
    total = sum(times.values())
    for name, ns in times.most_common(args.top):
        print(f"| `{name[:90]}` | {counts[name]:.0f} | {ns / 1e3:.1f} | {100 * ns / total:.1f}% |")
    rest = times.most_common()[args.top:]
    if rest:
        print(f"| {len(rest)} others | {sum(counts[n] for n, _ in rest):.0f} | {sum(t for _, t in rest) / 1e3:.1f} "
              f"| {100 * sum(t for _, t in rest) / total:.1f}% |")
    print(f"\n**{sum(counts.values()):.0f} launches, {total / 1e6:.3f} ms of GPU time a step.**")
    return 0


if __name__ == "__main__":
    sys.exit(main())
