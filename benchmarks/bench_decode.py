"""Prefill and decode speed of our runtime against mlx-lm, on the same weights.

Builds (or reuses) a seeded random-weight Llama as a Hugging Face directory,
exports it with ``export_hf_model`` once per dtype, then times, in one process
and interleaved (ours, mlx-lm, ours, mlx-lm, ...):

- ours: ``generate_tokens``, the decode loop the ``llm`` plugin runs, with the
  plugin's greedy ``Sampler`` and a fresh off-graph cache per repetition;
- mlx-lm: ``mlx_lm.generate.generate_step`` on the same weights cast with
  ``model.set_dtype``, a fresh prompt cache per repetition, the same prefill
  chunk.

Both are timed by the same code: prefill is prompt tokens / time to the first
token, decode is (new tokens - 1) / time from the first token to the last.
A decode ceiling comes from MLX's measured copy bandwidth and the bytes one
decode step must read (weights + KV cache at the mean context).

    python benchmarks/bench_decode.py --shape tiny --reps 2
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import hashlib
import importlib.metadata
import json
import multiprocessing
import os
import pathlib
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Iterator

import mlx.core as mx
import numpy as np

HERE = pathlib.Path(__file__).resolve().parent

# Llama shapes (transformers ``LlamaConfig`` fields) for the random models.
SHAPES = {
    "smollm-135m": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3,
    ),
    "tiny": dict(
        vocab_size=2048, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    ),
}
MX_DTYPES = {"fp32": mx.float32, "bf16": mx.bfloat16, "fp16": mx.float16}
BLAS_HINT = (
    "note: no optimized BLAS is loaded; the mlx-cpu wheel's own BLAS is slow. "
    "Try: apt-get install libopenblas0-pthread, then run with "
    "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked; ``dtypes`` becomes a list."""
    p = argparse.ArgumentParser(
        description="Prefill/decode tokens/s of llm-executorch-mlx vs mlx-lm on one random Llama.",
    )
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm-135m",
                   help="random model shape to build (default: smollm-135m)")
    p.add_argument("--seed", type=int, default=0, help="weight and prompt seed (default: 0)")
    p.add_argument("--model-dir", type=pathlib.Path,
                   help="reuse this Hugging Face model dir instead of building one")
    p.add_argument("--pte", type=pathlib.Path, action="append", default=[],
                   help="reuse this .pte exported from --model-dir (repeatable; its dtype "
                        "is read from the file); requested dtypes without one are exported")
    p.add_argument("--dtypes", default="fp32,bf16",
                   help="comma-separated dtypes among fp32,bf16,fp16 (default: fp32,bf16)")
    p.add_argument("--workdir", type=pathlib.Path, default=HERE / ".work",
                   help="where built models and exports are cached (default: benchmarks/.work)")
    p.add_argument("--max-ctx-len", type=int, default=1024, help="export max context (default: 1024)")
    p.add_argument("--prefill-chunk", type=int, default=128, help="export prefill chunk (default: 128)")
    p.add_argument("--prompt-len", type=int, default=512, help="random prompt ids (default: 512)")
    p.add_argument("--new-tokens", type=int, default=128, help="greedy tokens to generate (default: 128)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per engine (default: 3)")
    p.add_argument("--json", type=pathlib.Path, help="also write every raw number here")
    args = p.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [d for d in args.dtypes if d not in MX_DTYPES]
    if unknown or not args.dtypes:
        p.error(f"--dtypes: unknown {unknown}; choose among {', '.join(MX_DTYPES)}")
    if args.pte and args.model_dir is None:
        p.error("--pte needs --model-dir: mlx-lm runs the Hugging Face weights the .pte came from")
    if args.new_tokens < 2 or args.prompt_len < 1 or args.reps < 1:
        p.error("need --new-tokens >= 2, --prompt-len >= 1 and --reps >= 1")
    return args


# -- machine ------------------------------------------------------------------


def optimized_blas() -> list[str]:
    """Paths of OpenBLAS / MKL libraries mapped into this process that MLX
    can bind to. numpy's ``libscipy_openblas`` does not count: its symbols are
    renamed (``scipy_cblas_sgemm64_``), so MLX never calls it."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "/" in line}
    names = {p: pathlib.Path(p).name.lower() for p in paths}
    return sorted(
        p for p, name in names.items()
        if ("openblas" in p.lower() or name.startswith("libmkl")) and "scipy_openblas" not in name
    )


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo, when there is one."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine_info() -> dict:
    """What the numbers depend on: machine, versions, BLAS, load."""
    versions = {}
    for dist in ("mlx", "mlx-lm", "executorch", "torch", "transformers", "llm-executorch-mlx"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    blas = optimized_blas()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0)),
        "mlx_device": str(mx.default_device()),
        "versions": versions,
        "optimized_blas": blas,
        "blas_note": "optimized BLAS loaded" if blas else "mlx wheel's reference BLAS (slow)",
        "ld_preload": os.environ.get("LD_PRELOAD"),
        "loadavg_start": os.getloadavg(),
    }


def measure_bandwidth(mib: int = 256, trials: int = 10) -> dict:
    """Best copy bandwidth MLX reaches, in bytes read + written per second.

    Each trial computes ``x = x + 1`` over ``mib`` MiB of fp32, split into one
    array per available CPU, each on its own MLX stream so the cores work in
    parallel. The input is dropped before evaluation so MLX writes into its
    buffer in place: a fresh output buffer would time page faults, not memory.
    """
    n_streams = max(1, len(os.sched_getaffinity(0)))
    streams = [mx.new_stream(mx.default_device()) for _ in range(n_streams)]
    xs = [mx.zeros((mib * 2**20 // 4 // n_streams,), mx.float32) for _ in streams]
    mx.eval(xs)
    moved = 2 * sum(x.nbytes for x in xs)
    samples = []
    for _ in range(trials):
        t0 = time.perf_counter()
        ys = []
        for stream in streams:
            with mx.stream(stream):
                ys.append(xs.pop(0) + 1)
        mx.eval(ys)
        samples.append(moved / (time.perf_counter() - t0))
        xs = ys
    return {"bytes_per_s": max(samples), "samples": samples, "mib": mib, "streams": n_streams}


# -- artifacts ----------------------------------------------------------------


def build_random_model(shape: str, seed: int, out: pathlib.Path) -> None:
    """Save a seeded random-weight Llama of ``shape`` as a Hugging Face dir."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        **SHAPES[shape], max_position_embeddings=2048, tie_word_embeddings=True,
        rope_theta=10000.0,
    )
    tmp = out.with_name(out.name + ".tmp")
    LlamaForCausalLM(config).save_pretrained(tmp)
    os.replace(tmp, out)


def export_pte(model_dir: pathlib.Path, out: pathlib.Path, dtype: str, max_ctx_len: int, chunk: int) -> None:
    """Export ``model_dir`` to ``out`` with our ``export_hf_model``."""
    from llm_executorch_mlx.export import export_hf_model

    tmp = out.with_name(out.stem + ".tmp.pte")
    export_hf_model(model_dir, tmp, dtype=dtype, max_ctx_len=max_ctx_len, prefill_chunk=chunk)
    os.replace(tmp, out)


def in_child(fn, *args) -> None:
    """Run ``fn(*args)`` in a fresh process, so building and exporting (torch
    thread pools, executorch, gigabytes of scratch memory) leave nothing behind
    in the process being timed."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        pool.submit(_to_stderr, fn, *args).result()


def _to_stderr(fn, *args) -> None:
    """Call ``fn(*args)`` with stdout sent to stderr: stdout is the report's."""
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    fn(*args)


def pte_dtype(path: pathlib.Path) -> str:
    """The activation dtype a .pte publishes (or its graph shows)."""
    from llm_executorch_mlx.runtime import load_program

    return load_program(path).metadata.activation_dtype


def prepare_artifacts(args) -> tuple[pathlib.Path, dict[str, pathlib.Path]]:
    """The HF model dir and one .pte per requested dtype, built when missing.

    Exports of a ``--model-dir`` are cached under a name taken from its path,
    so they are never mistaken for the random model's.
    """
    model_dir = args.model_dir
    if model_dir is not None:
        resolved = model_dir.resolve()
        digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:8]
        base = args.workdir / f"{resolved.name}-{digest}"
    else:
        base = args.workdir / f"{args.shape}-seed{args.seed}"
        model_dir = base / "hf"
        if not (model_dir / "config.json").exists():
            base.mkdir(parents=True, exist_ok=True)
            log(f"building random {args.shape} model in {model_dir}")
            in_child(build_random_model, args.shape, args.seed, model_dir)
    ptes = {}
    for path in args.pte:
        dtype = pte_dtype(path)
        if dtype not in args.dtypes:
            sys.exit(f"--pte {path} is {dtype}, which --dtypes ({','.join(args.dtypes)}) does not ask for")
        ptes[dtype] = path
    for dtype in args.dtypes:
        if dtype in ptes:
            continue
        ptes[dtype] = base / f"{dtype}-ctx{args.max_ctx_len}-chunk{args.prefill_chunk}.pte"
        if not ptes[dtype].exists():
            base.mkdir(parents=True, exist_ok=True)
            log(f"exporting {dtype} to {ptes[dtype]}")
            in_child(export_pte, model_dir, ptes[dtype], dtype, args.max_ctx_len, args.prefill_chunk)
    return model_dir, ptes


# -- timing -------------------------------------------------------------------


@dataclass
class Run:
    """One generation: its throughputs and the tokens it produced."""

    prefill_tps: float
    decode_tps: float
    tokens: list[int]


def timed(token_stream: Iterator[int], prompt_len: int, stream: mx.Stream) -> Run:
    """Drain a token generator, timing its first and last token.

    Waits for ``stream``, the one the generator computes on, afterwards, so
    work it queued past its last token cannot spill into the next measurement.
    """
    tokens = []
    t0 = time.perf_counter()
    for token in token_stream:
        now = time.perf_counter()
        if not tokens:
            t_first = now
        tokens.append(token)
    mx.synchronize(stream)
    return Run(prompt_len / (t_first - t0), (len(tokens) - 1) / (now - t_first), tokens)


class Ours:
    """Our runtime through ``generate_tokens``, as the plugin drives it."""

    name = "ours"

    def __init__(self, pte: pathlib.Path):
        from llm_executorch_mlx.runtime import load_program
        from llm_executorch_mlx.text.sampling import Sampler

        self.program = load_program(pte)
        self.sampler = Sampler(temperature=0.0)
        self.last_timings = None

    def new_cache(self, capacity: int):
        """A cache like the plugin's: the model's activation dtype."""
        return self.program.new_cache(capacity=capacity, dtype=self.program.metadata.activation_dtype)

    def run(self, prompt: list[int], new_tokens: int) -> Run:
        from llm_executorch_mlx.text.generate import Timings, generate_tokens

        cache = self.new_cache(self.program.metadata.max_context)
        forward = self.program.load_method("forward", cache=cache)
        self.last_timings = Timings()
        steps = generate_tokens(
            forward, cache, prompt, 0, self.program.metadata.prefill_chunk,
            lambda logits, history: self.sampler.sample(logits), new_tokens, self.last_timings,
        )
        stream = mx.default_stream(mx.default_device())
        return timed((step.token for step in steps), len(prompt), stream)


class MlxLm:
    """mlx-lm's ``generate_step`` on the Hugging Face weights, cast to ``dtype``."""

    name = "mlx-lm"

    def __init__(self, model_dir: pathlib.Path, dtype: str, prefill_chunk: int):
        from mlx_lm.utils import load_model

        self.model, _ = load_model(model_dir)
        self.model.set_dtype(MX_DTYPES[dtype])
        mx.eval(self.model.parameters())
        self.prefill_chunk = prefill_chunk

    def run(self, prompt: list[int], new_tokens: int) -> Run:
        from mlx_lm.generate import generate_step, generation_stream

        steps = generate_step(
            mx.array(prompt), self.model, max_tokens=new_tokens, prefill_step_size=self.prefill_chunk,
        )
        return timed((token for token, _ in steps), len(prompt), generation_stream)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two generations share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def bench_dtype(dtype: str, pte: pathlib.Path, model_dir: pathlib.Path, args, bandwidth: float) -> dict:
    """Warm up, then time ours and mlx-lm interleaved; return raw numbers."""
    ours = Ours(pte)
    meta = ours.program.metadata
    needed = args.prompt_len + args.new_tokens
    if (meta.max_context or 0) < needed:
        sys.exit(f"{pte} holds {meta.max_context} tokens; the run needs {needed}")
    if meta.activation_dtype != dtype:
        sys.exit(f"{pte} is {meta.activation_dtype}, expected {dtype}")
    theirs = MlxLm(model_dir, dtype, meta.prefill_chunk)
    prompt = np.random.default_rng(args.seed).integers(0, meta.vocab_size, args.prompt_len).tolist()

    for engine in (ours, theirs):  # warmup, excluded
        mx.clear_cache()
        engine.run(prompt, args.new_tokens)
    reps = []
    for rep in range(args.reps):
        runs = {}
        for engine in (ours, theirs):
            mx.clear_cache()
            runs[engine.name] = engine.run(prompt, args.new_tokens)
            log(f"{dtype} rep {rep + 1}/{args.reps} {engine.name}: prefill "
                f"{runs[engine.name].prefill_tps:.1f} tok/s, decode {runs[engine.name].decode_tps:.2f} tok/s")
        reps.append({
            "ours": {**asdict(runs["ours"]), "plugin_timings": asdict(ours.last_timings)},
            "mlx-lm": asdict(runs["mlx-lm"]),
            "same_tokens": common_prefix(runs["ours"].tokens, runs["mlx-lm"].tokens),
        })

    ceiling = decode_ceiling(ours, args, bandwidth)
    return {
        "dtype": dtype,
        "pte": pte,
        "prefill_chunk": meta.prefill_chunk,
        **ceiling,
        "reps": reps,
        "summary": summarize_dtype(reps, ceiling["ceiling_decode_tps"]),
    }


def decode_ceiling(ours: Ours, args, bandwidth: float) -> dict:
    """Decode tokens/s if a step cost only reading its bytes once: every
    weight, plus the KV cache at the mean context of the timed steps."""
    weight_bytes = ours.program.weight_bytes()
    mean_context = args.prompt_len + args.new_tokens / 2
    kv_bytes = ours.new_cache(args.prompt_len + args.new_tokens).bytes_per_token() * mean_context
    return {
        "weight_bytes": weight_bytes,
        "mean_context": mean_context,
        "kv_bytes_at_mean_context": kv_bytes,
        "ceiling_decode_tps": bandwidth / (weight_bytes + kv_bytes),
    }


# -- reporting ----------------------------------------------------------------


def spread(values: list[float]) -> dict:
    """Median, min and max of a list of numbers."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize_dtype(reps: list[dict], ceiling_tps: float) -> dict:
    """Each figure and each per-repetition ratio as median [min-max]."""
    def series(engine, key):
        return [r[engine][key] for r in reps]

    out = {}
    for key in ("prefill_tps", "decode_tps"):
        ours, theirs = series("ours", key), series("mlx-lm", key)
        out[key] = {
            "ours": spread(ours),
            "mlx-lm": spread(theirs),
            "ratio": spread([a / b for a, b in zip(ours, theirs)]),
        }
    out["ceiling_fraction"] = {
        engine: spread([v / ceiling_tps for v in series(engine, "decode_tps")])
        for engine in ("ours", "mlx-lm")
    }
    out["same_tokens"] = spread([r["same_tokens"] for r in reps])
    return out


def fmt(s: dict, pattern: str = "{:.1f}") -> str:
    """``median [min–max]`` with one number format."""
    return f"{pattern.format(s['median'])} [{pattern.format(s['min'])}–{pattern.format(s['max'])}]"


def markdown(results: list[dict], bandwidth: dict, args) -> str:
    """The report: throughput per engine, ratios, and the bandwidth ceiling."""
    lines = [
        f"prompt {args.prompt_len} random ids, {args.new_tokens} greedy tokens, "
        f"{args.reps} interleaved reps after 1 warmup each; median [min–max]",
        "",
        "| dtype | engine | prefill tok/s | decode tok/s | decode % of ceiling |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        s = r["summary"]
        for engine in ("ours", "mlx-lm"):
            lines.append(
                f"| {r['dtype']} | {engine} | {fmt(s['prefill_tps'][engine])} | "
                f"{fmt(s['decode_tps'][engine], '{:.2f}')} | "
                f"{fmt({k: 100 * v for k, v in s['ceiling_fraction'][engine].items()}, '{:.0f}%')} |"
            )
        lines.append(
            f"| {r['dtype']} | ours/mlx-lm | {fmt(s['prefill_tps']['ratio'], '{:.2f}')} | "
            f"{fmt(s['decode_tps']['ratio'], '{:.2f}')} | |"
        )
    lines += [
        "",
        f"Copy bandwidth (MLX, {bandwidth['streams']} streams, best of {len(bandwidth['samples'])}): "
        f"{bandwidth['bytes_per_s'] / 1e9:.1f} GB/s",
        "",
        "| dtype | weights MB | KV MB at mean context | decode ceiling tok/s | tokens equal to mlx-lm's |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['dtype']} | {r['weight_bytes'] / 1e6:.1f} | "
            f"{r['kv_bytes_at_mean_context'] / 1e6:.1f} (ctx {r['mean_context']:g}) | "
            f"{r['ceiling_decode_tps']:.1f} | {fmt(r['summary']['same_tokens'], '{:.0f}')} "
            f"of {args.new_tokens} |"
        )
    return "\n".join(lines)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    model_dir, ptes = prepare_artifacts(args)
    machine = machine_info()
    if not machine["optimized_blas"]:
        log(BLAS_HINT)
    bandwidth = measure_bandwidth()
    log(f"copy bandwidth: {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s")
    results = [
        bench_dtype(dtype, ptes[dtype], model_dir, args, bandwidth["bytes_per_s"])
        for dtype in args.dtypes
    ]
    machine["loadavg_end"] = os.getloadavg()
    print(markdown(results, bandwidth, args))
    if args.json:
        report = {
            "args": vars(args),
            "model_dir": model_dir,
            "machine": machine,
            "bandwidth": bandwidth,
            "results": results,
        }
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
