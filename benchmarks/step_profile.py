"""Where a decode step's time goes in our runtime: host or device.

Runs the plugin's decode loop (``generate_tokens``, look-ahead included) on
one ``.pte`` and splits each step's wall time into what the host does and
what is left:

- build: our interpreter building the step's lazy MLX graph
  (``forward.execute``);
- submit: ``mx.async_eval`` handing that graph to MLX. On a GPU this encodes
  every kernel (MLX CUDA records them into CUDA graphs on the calling thread);
  on the CPU it queues the ops. Either blocks while MLX has 10 tasks in
  flight (a CPU task is 10 ops, a CUDA one ~100), so on a GPU that falls
  behind, submit includes waiting too;
- rest: everything else between two tokens: sampling's graph, reading the
  token (``y.item()``, where the host waits for the device) and the loop.

These are means over a generation; the median step (token to token) beside
them says whether a few slow steps (the host busy elsewhere) moved them.

When build + submit is the whole step and submit takes as long as encoding
on an idle device, the step is bound by per-op host work, and only fewer ops
(not faster kernels) make it faster. The generation loop is timed as it is, by wrapping
``forward.execute`` and ``mx.async_eval`` (a few hundred nanoseconds of
``perf_counter`` per call).

    python benchmarks/step_profile.py --pte model.pte --reps 3
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

from harness import cli
from harness.models import random_prompt
from harness.report import fmt, spread, table


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pte", type=pathlib.Path, required=True, help="the .pte to decode with")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prompt length (default: 512)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens to generate, at least 3 (default: 128)")
    cli.add_reps(p, 3, "generations to time")
    p.add_argument("--compute", default="auto", help="load_program's compute route (default: auto)")
    cli.add_json(p)
    args = p.parse_args(argv)
    if args.new_tokens < 3:
        p.error("--new-tokens must be at least 3 (the first and last tokens are not timed steps)")
    return args


class StepClock:
    """Wraps ``forward.execute`` and ``forward.submit`` (the decode loop's
    queueing of a step) and sums the host time each takes in decode steps (token ids come as a device
    array only there; prefill chunks come from the host).

    ``generate_tokens`` starts its decode clock after the first decode build,
    so builds are averaged from the second on; every decode submit is inside
    that clock."""

    def __init__(self, forward, mx):
        self.forward, self.mx = forward, mx
        self.n_inputs = forward.n_inputs
        self.wait, self.queue_on_build = forward.wait, forward.queue_on_build
        self.build = self.submit_seconds = 0.0
        self.builds = self.submits = 0
        self._decoding = False

    def execute(self, inputs, last_position_only=False):
        t0 = time.perf_counter()
        out = self.forward.execute(inputs, last_position_only)
        self._decoding = isinstance(inputs[0], self.mx.array)
        if self._decoding:
            if self.builds:  # the first decode build precedes the decode clock
                self.build += time.perf_counter() - t0
            self.builds += 1
        return out

    def submit(self, *arrays):
        t0 = time.perf_counter()
        self.forward.submit(*arrays)
        if self._decoding:
            self.submit_seconds += time.perf_counter() - t0
            self.submits += 1


def profile_once(program, prompt: list[int], new_tokens: int) -> dict:
    import mlx.core as mx

    from llm_executorch_mlx.text import generate
    from llm_executorch_mlx.text.sampling import Sampler

    cache = program.new_cache(capacity=program.metadata.max_context or len(prompt) + new_tokens)
    clock = StepClock(program.load_method("forward", cache=cache), mx)
    sampler = Sampler(temperature=0.0)
    timings = generate.Timings()
    steps = generate.generate_tokens(
        clock, cache, prompt, 0, cache.max_write or program.metadata.prefill_chunk or len(prompt),
        lambda logits, history: sampler.sample(logits), new_tokens, timings,
    )
    tokens, gaps, last = [], [], None
    for s in steps:  # token to token: a host's hiccup moves the mean, not the median
        now = time.perf_counter()
        if last is not None:
            gaps.append(now - last)
        tokens.append(s.token)
        last = now
    mx.synchronize()
    per_step = timings.decode_seconds / timings.decode_tokens
    build = clock.build / (clock.builds - 1)
    submit = clock.submit_seconds / clock.submits
    return {
        "decode_tps": 1 / per_step,
        "step_ms": 1e3 * per_step,
        "median_step_ms": 1e3 * statistics.median(gaps),
        "build_ms": 1e3 * build,
        "submit_ms": 1e3 * submit,
        "rest_ms": 1e3 * (per_step - build - submit),
        "ops": len(clock.forward.op_names),
        "tokens": tokens,
    }


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two generations part, None if equal."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main(argv=None) -> None:
    args = parse_args(argv)
    from llm_executorch_mlx.runtime import load_program  # binds MLX's BLAS first

    import mlx.core as mx

    program = load_program(args.pte, compute=args.compute)
    program.prepare_cpu_kernels()  # as the plugin does before a generation
    vocab = program.metadata.vocab_size or 1000
    prompt = random_prompt(0, vocab, args.prompt_tokens)
    profile_once(program, prompt, 8)  # warm-up: kernels compiled, shapes traced
    runs = [profile_once(program, prompt, args.new_tokens) for _ in range(args.reps)]
    keys = ("decode_tps", "step_ms", "build_ms", "submit_ms", "rest_ms", "median_step_ms")
    summary = {k: spread([r[k] for r in runs]) for k in keys}
    ops = runs[0]["ops"]
    device = str(mx.default_device())
    print(f"# Decode step profile: {args.pte.name} on {device}, {ops} interpreted ops a step\n")
    print(f"{args.prompt_tokens}-token prompt, {args.new_tokens} greedy tokens, "
          f"{args.reps} generations, median [min–max]\n")
    print("\n".join(table(
        ["decode tok/s", "step ms", "build ms (host)", "submit ms (host)", "rest ms (sampling, waiting for the device)",
         "median step ms"],
        [[fmt(summary["decode_tps"], "{:.1f}")] + [fmt(summary[k], "{:.2f}") for k in keys[1:]]],
    )))
    first = runs[0]["tokens"]
    parts = [first_difference(first, r["tokens"]) for r in runs[1:]]
    if all(p is None for p in parts):
        print("\nEvery generation produced the same greedy tokens.")
    else:
        where = ", ".join("same" if p is None else f"token {p}" for p in parts)
        print(f"\nGreedy tokens differ between generations; vs the first, each later one parts at: {where}.")
    if args.json:
        args.json.write_text(json.dumps(
            {"pte": str(args.pte), "device": device, "ops": ops, "runs": runs, "summary": summary},
            indent=1,
        ))


if __name__ == "__main__":
    sys.exit(main())
