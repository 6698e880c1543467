"""Prefill and decode speed of our runtime against mlx-lm and ExecuTorch's
XNNPACK path, on the same weights.

Builds (or reuses) a seeded random-weight Llama as a Hugging Face directory,
exports it with ``export_hf_model`` once per dtype (and, for the XNNPACK peer,
with ExecuTorch's ``export_llama``), then times, in one process and
interleaved (ours, [ours-native,] mlx-lm, xnnpack, ours, ...):

- ours: ``generate_tokens``, the decode loop the ``llm`` plugin runs, with the
  plugin's greedy ``Sampler``, the default compute route (a bf16/fp16 file
  computes in fp32 on a CPU) and a fresh off-graph cache per repetition;
- ours-native (bf16/fp16 files only): the same with ``compute="native"``,
  i.e. in the file's dtype;
- ours-mlx-ops: ours without a CUDA GPU's decode-step kernels
  (``LLM_PTE_GPU_KERNELS=0``, ``runtime/gpu/decode.py``): MLX's own ops;
- ours-uncompiled: ours with every op of a decode step built from Python
  (``LLM_PTE_COMPILED_STEPS=0``, ``runtime/interp/compiled_runs.py``);
- mlx-lm: ``mlx_lm.generate.generate_step`` on the same weights cast with
  ``model.set_dtype``, a fresh prompt cache per repetition, the same prefill
  chunk;
- xnnpack: ExecuTorch's own CPU path, an XNNPACK ``.pte`` with a static
  in-graph KV cache run through ``executorch.runtime`` (see
  ``xnnpack_peer.py``), the same prefill chunk, argmax on the host.

The runtime binds an optimized BLAS (OpenBLAS or MKL) into MLX when it is
imported before ``mlx.core``; this script imports it first, so ours and mlx-lm
use the same BLAS. ``--blas reference`` keeps MLX's slow reference BLAS.

All engines are timed by the same code: prefill is prompt tokens / time to the
first token, decode is (new tokens - 1) / time from the first token to the
last. A decode ceiling per engine comes from MLX's measured copy bandwidth and
the bytes one decode step of that engine reads (its weights as held + its KV
cache at the mean context, in its cache's dtype).

    python benchmarks/bench_decode.py --shape tiny --reps 2
"""

from __future__ import annotations

import argparse
import gc
import os
import pathlib
import sys
import time
from dataclasses import dataclass

import xnnpack_peer  # imports neither torch nor executorch until used
from harness import cli, machine, models
from harness.engines import MlxLm, Ours
from harness.models import DTYPE_BYTES, DTYPES, in_child, model_shape, pte_info
from harness.report import fmt, log, spread, summarize_runs, table, write_json
from harness.timing import Run, rep_entry, settle, timed

ENGINES = ("ours", "ours-native", "ours-mlx-ops", "ours-uncompiled", "mlx-lm", "xnnpack")


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked; ``dtypes`` and ``engines`` become lists."""
    p = argparse.ArgumentParser(
        description="Prefill/decode tokens/s of llm-executorch-mlx vs mlx-lm and ExecuTorch's "
                    "XNNPACK path on one random Llama.",
    )
    cli.add_model_arguments(p)
    cli.add_ptes_by_dtype(p)
    p.add_argument("--engines", default=",".join(e for e in ENGINES if e != "ours-uncompiled"),
                   help="comma-separated engines among ours,ours-native,ours-mlx-ops,ours-uncompiled,mlx-lm,xnnpack "
                        f"(default: all but ours-uncompiled; ours is always run; ours-native only for bf16/fp16; "
                        f"ours-mlx-ops: MLX's own ops for a CUDA GPU's decode steps; ours-uncompiled: every op of a "
                        f"decode step built from Python; "
                        f"xnnpack only for {'/'.join(xnnpack_peer.XNNPACK_DTYPES)})")
    p.add_argument("--blas", default="auto",
                   help="BLAS for MLX's CPU matmuls: auto (the runtime's choice: "
                        f"{machine.BLAS_ENV}, else OpenBLAS behind its one-row route, else MKL, else OpenBLAS/BLIS), "
                        "reference (MLX's own, slow), "
                        f"or a library path; sets {machine.BLAS_ENV} for the run (default: auto)")
    cli.add_generation_arguments(p)
    cli.add_reps(p, 3)
    cli.add_json(p)
    args = p.parse_args(argv)
    args.dtypes = cli.choices(p, "--dtypes", args.dtypes, DTYPES)
    chosen = cli.choices(p, "--engines", args.engines, ENGINES, empty_ok=True)
    args.engines = [e for e in ENGINES if e in chosen or e == "ours"]
    cli.check_pte_needs_model_dir(p, args)
    cli.check_generation(p, args)
    return args


def measure_bandwidth(mib: int = 256, trials: int = 10) -> dict:
    """Best copy bandwidth MLX reaches, in bytes read + written per second.

    Each trial computes ``x = x + 1`` over ``mib`` MiB of fp32, split into one
    array per available CPU, each on its own MLX stream so the cores work in
    parallel. The input is dropped before evaluation so MLX writes into its
    buffer in place: a fresh output buffer would time page faults, not memory.
    On a GPU one stream and 8x the bytes, so one kernel, not launches, is timed.
    """
    import mlx.core as mx

    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    mib = mib * 8 if on_gpu else mib
    n_streams = 1 if on_gpu else max(1, len(os.sched_getaffinity(0)))
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


# -- artifacts and engines ---------------------------------------------------


@dataclass
class Artifacts:
    model_dir: pathlib.Path
    ptes: dict  # dtype -> our .pte
    xnnpack: dict  # dtype -> XNNPACK .pte, for the dtypes that have one
    xnnpack_skipped: dict  # dtype -> why it has none


def prepare_artifacts(args) -> Artifacts:
    """The HF model dir, one .pte per requested dtype and, when the xnnpack
    engine is asked for, one XNNPACK .pte per dtype it handles; built when
    missing. An XNNPACK export has the context and chunk of the .pte it is
    compared with."""
    model_dir, base = models.model_source(args.workdir, args.shape, args.seed, args.model_dir)
    ptes = models.ptes_by_dtype(args.pte, args.dtypes, base, model_dir, args.max_ctx_len, args.prefill_chunk)
    xnnpack, skipped = {}, {}
    if "xnnpack" in args.engines:
        for dtype in args.dtypes:
            if dtype not in xnnpack_peer.XNNPACK_DTYPES:
                skipped[dtype] = f"the XNNPACK peer is exported in {'/'.join(xnnpack_peer.XNNPACK_DTYPES)} only"
                continue
            _, ctx, chunk = pte_info(ptes[dtype])
            path = base / f"xnnpack-{dtype}-ctx{ctx}-chunk{chunk}.pte"
            if not path.exists():
                base.mkdir(parents=True, exist_ok=True)
                log(f"exporting the XNNPACK peer ({dtype}) to {path} with executorch's export_llama")
                try:
                    in_child(xnnpack_peer.export_xnnpack, model_dir, path, dtype, ctx, chunk)
                except Exception as exc:  # reported in the tables, the other engines still run
                    skipped[dtype] = f"export failed: {type(exc).__name__}: {exc}"
                    log(f"XNNPACK {dtype}: {skipped[dtype]}")
                    continue
            xnnpack[dtype] = path
    return Artifacts(model_dir, ptes, xnnpack, skipped)


class Xnnpack:
    """ExecuTorch's XNNPACK ``.pte`` (static in-graph cache) through
    ``executorch.runtime``; see ``xnnpack_peer.py``."""

    name = "xnnpack"

    def __init__(self, pte: pathlib.Path, model_dir: pathlib.Path, dtype: str, prefill_chunk: int):
        self.peer = xnnpack_peer.XnnpackPeer(pte, prefill_chunk)
        self.compute = dtype
        self.kv_dtype = dtype
        # A step reads every linear weight and the (untied) output projection,
        # but only one row of the input embedding table.
        self.weight_bytes = xnnpack_peer.step_weight_bytes(model_dir, DTYPE_BYTES[dtype])
        self.kv_bytes_per_token = models.kv_bytes_per_token(model_shape(model_dir), dtype)

    def info(self) -> dict:
        return {
            "pte": str(self.peer.pte),
            "pte_bytes": self.peer.pte.stat().st_size,
            "delegates": self.peer.backends,
            "threads": self.peer.threads,
        }

    def run(self, prompt: list[int], new_tokens: int) -> Run:
        return timed(self.peer.generate(prompt, new_tokens), len(prompt))


def make_engines(dtype: str, art: Artifacts, args, meta) -> list:
    """The engines for one dtype, in the order they take turns."""
    engines = [Ours(art.ptes[dtype], "auto")]
    if "ours-native" in args.engines and dtype != "fp32":
        engines.append(Ours(art.ptes[dtype], "native", name="ours-native"))
    if "ours-mlx-ops" in args.engines:
        engines.append(Ours(art.ptes[dtype], "auto", name="ours-mlx-ops", gpu_kernels=False))
    if "ours-uncompiled" in args.engines:
        engines.append(Ours(art.ptes[dtype], "auto", name="ours-uncompiled", compiled_steps=False))
    if "mlx-lm" in args.engines:
        engines.append(MlxLm(art.model_dir, dtype, meta.prefill_chunk))
    if dtype in art.xnnpack:
        engines.append(Xnnpack(art.xnnpack[dtype], art.model_dir, dtype, meta.prefill_chunk))
    return engines


# -- timing -------------------------------------------------------------------


def bench_dtype(dtype: str, art: Artifacts, args, bandwidth: float) -> dict:
    """Warm up, then time every engine interleaved; return raw numbers."""
    pte = art.ptes[dtype]
    from llm_executorch_mlx.runtime import load_program

    meta = load_program(pte, compute="native").metadata
    needed = args.prompt_len + args.new_tokens
    if (meta.max_context or 0) < needed:
        sys.exit(f"{pte} holds {meta.max_context} tokens; the run needs {needed}")
    if meta.activation_dtype != dtype:
        sys.exit(f"{pte} is {meta.activation_dtype}, expected {dtype}")
    engines = make_engines(dtype, art, args, meta)
    names = [e.name for e in engines]
    prompt = models.random_prompt(args.seed, meta.vocab_size, args.prompt_len)

    def one(engine) -> Run:
        settle()
        return engine.run(prompt, args.new_tokens)

    for engine in engines:  # warmup, excluded
        run = one(engine)
        log(f"{dtype} warmup {engine.name}: prefill {run.prefill_tps:.1f} tok/s, decode {run.decode_tps:.2f} tok/s")
    reps = []
    for rep in range(args.reps):
        runs = {}
        for engine in engines:
            runs[engine.name] = one(engine)
            log(f"{dtype} rep {rep + 1}/{args.reps} {engine.name}: prefill "
                f"{runs[engine.name].prefill_tps:.1f} tok/s, decode {runs[engine.name].decode_tps:.2f} tok/s")
        reps.append(rep_entry(runs))

    mean_context = args.prompt_len + args.new_tokens / 2
    engine_info = {}
    for engine in engines:
        kv_bytes = engine.kv_bytes_per_token * mean_context
        engine_info[engine.name] = {
            "compute": engine.compute,
            "kv_dtype": engine.kv_dtype,
            "weight_bytes": engine.weight_bytes,
            "kv_bytes_per_token": engine.kv_bytes_per_token,
            "kv_bytes_at_mean_context": kv_bytes,
            "ceiling_decode_tps": bandwidth / (engine.weight_bytes + kv_bytes),
            **engine.info(),
        }
    return {
        "dtype": dtype,
        "pte": pte,
        "xnnpack_pte": art.xnnpack.get(dtype),
        "xnnpack_skipped": art.xnnpack_skipped.get(dtype),
        "prefill_chunk": meta.prefill_chunk,
        "mean_context": mean_context,
        "engines": engine_info,
        "reps": reps,
        "summary": summarize_dtype(reps, names, engine_info),
    }


# -- reporting ----------------------------------------------------------------


def summarize_dtype(reps: list[dict], names: list[str], engines: dict) -> dict:
    """``summarize_runs`` plus each engine's decode as a fraction of its ceiling."""
    out = summarize_runs(reps, names)
    out["ceiling_fraction"] = {
        name: spread([r[name]["decode_tps"] / engines[name]["ceiling_decode_tps"] for r in reps])
        for name in names
    }
    return out


def markdown(results: list[dict], bandwidth: dict, args, info: dict) -> str:
    """The report: throughput per engine, ratios, ceilings, token agreement."""
    blas = info["blas"]["global_sgemm_library"] or "MLX's reference BLAS"
    speeds, ceilings = [], []
    for r in results:
        s, dtype = r["summary"], r["dtype"]
        for name, engine in r["engines"].items():
            ceiling = {k: 100 * v for k, v in s["ceiling_fraction"][name].items()}
            speeds.append([dtype, name, engine["compute"], fmt(s["prefill_tps"][name]),
                           fmt(s["decode_tps"][name], "{:.2f}"), fmt(ceiling, "{:.0f}%")])
            same = f"{fmt(s['same_tokens'][name], '{:.0f}')} of {args.new_tokens}" if name != "ours" else ""
            ceilings.append([dtype, name, f"{engine['weight_bytes'] / 1e6:.1f}",
                             f"{engine['kv_bytes_at_mean_context'] / 1e6:.1f} ({engine['kv_dtype']}, "
                             f"ctx {r['mean_context']:g})", f"{engine['ceiling_decode_tps']:.1f}", same])
        for name, ratio in s["prefill_tps"]["ratio"].items():
            speeds.append([dtype, f"ours/{name}", "", fmt(ratio, "{:.2f}"),
                           fmt(s["decode_tps"]["ratio"][name], "{:.2f}"), ""])
        if r["xnnpack_skipped"] and "xnnpack" in args.engines:
            speeds.append([dtype, "xnnpack", f"not run: {r['xnnpack_skipped']}", "", "", ""])
    lines = [
        f"prompt {args.prompt_len} random ids, {args.new_tokens} greedy tokens, "
        f"{args.reps} interleaved reps after 1 warmup each; median [min–max]; "
        f"MLX BLAS: {blas}",
        "",
        *table(["dtype", "engine", "computes in", "prefill tok/s", "decode tok/s", "decode % of its ceiling"],
               speeds),
        "",
        f"Copy bandwidth (MLX, {bandwidth['streams']} streams, best of {len(bandwidth['samples'])}): "
        f"{bandwidth['bytes_per_s'] / 1e9:.1f} GB/s",
        "",
        *table(["dtype", "engine", "weights read MB", "KV MB at mean context", "decode ceiling tok/s",
                "tokens equal to ours"], ceilings),
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    blas = machine.bind_blas_and_import_mlx(args.blas)  # before anything else imports mlx.core
    log(machine.blas_note(blas) or f"MLX BLAS: {blas['global_sgemm_library']} ({blas['reason']})")
    art = prepare_artifacts(args)
    info = machine.machine_info(blas)
    bandwidth = measure_bandwidth()
    log(f"copy bandwidth: {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s")
    results = []
    for dtype in args.dtypes:
        results.append(bench_dtype(dtype, art, args, bandwidth["bytes_per_s"]))
        gc.collect()  # the engines of one dtype go before the next dtype's load
    info["loadavg_end"] = os.getloadavg()
    print(markdown(results, bandwidth, args, info))
    if args.json:
        report = {
            "args": vars(args),
            "model_dir": art.model_dir,
            "machine": info,
            "bandwidth": bandwidth,
            "results": results,
        }
        write_json(args.json, report)


if __name__ == "__main__":
    main()
