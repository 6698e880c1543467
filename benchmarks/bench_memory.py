"""Memory of our runtime against mlx-lm on the same weights: MLX and process.

For each .pte (one per dtype) it runs the plugin's own decode loop
(``generate_tokens`` with the greedy ``Sampler``, the library's default
compute route -- on a CPU a bf16/fp16 file is widened to fp32 at load -- and
a cache built as the plugin builds it, in the model's activation dtype) and,
as the peer, mlx-lm's ``generate_step`` on the same Hugging Face weights cast
with ``set_dtype``: a 512-token random prompt, then 128 greedy tokens.
``--compute native`` keeps ours in the file's dtype. Every measurement is a fresh process
(``benchmarks/memory_probe.py``), so no two runs' peaks mix; repetitions
interleave the engines (ours, mlx-lm, ours, mlx-lm, ...).

In each process it records, after loading, after prefill and after decoding:
MLX active / peak / cache memory (``mx.get_active_memory``,
``mx.get_peak_memory``, ``mx.get_cache_memory``) and process RSS from
/proc/self/status (VmRSS, VmHWM and its RssAnon / RssFile split), plus the
resident bytes of the .pte's own memory mapping (/proc/self/smaps). Peaks are
per stage: both are reset after each snapshot.

The reference a peak is compared with (all in bytes):

    expected    = weights + KV in use + activations
    weights     = program.weight_bytes(), as held after any widening (ours) /
                  the parameters' nbytes after set_dtype (mlx-lm)
    KV in use   = live tokens x sum over layers of 2 x kv_heads x head_dim x KV dtype size
    activations = dtype size x (T x (hidden + 2 x intermediate + vocab) + heads x T x S)

with T the prefill chunk (the widest step) and S the prompt length (the
widest context a prefill chunk attends to): one chunk's hidden state, MLP
gate and up projections, logits, and attention scores.

    python benchmarks/bench_memory.py --shape tiny --reps 2
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

from harness import cli, machine, models
from harness.models import DTYPE_BYTES, DTYPES, kv_bytes_per_token
from harness.report import fmt, log, ratio_spread, spread, table, write_json

PROBE = pathlib.Path(__file__).resolve().parent / "memory_probe.py"
ENGINES = ("ours", "mlx-lm")
STAGES = ("start", "load", "prefill", "decode", "closed")
MB = 1e6


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="MLX and process memory of llm-executorch-mlx vs mlx-lm on one model "
                    "(fresh process per measurement).",
    )
    cli.add_model_arguments(p)
    cli.add_ptes_by_dtype(p)
    p.add_argument("--engines", default="ours,mlx-lm",
                   help="comma-separated engines among ours,mlx-lm (default: both)")
    p.add_argument("--compute", help="ours: load_program's compute route (auto, native, fp32; "
                   "default: the library's, which on a CPU widens bf16/fp16 programs to fp32)")
    p.add_argument("--kv-dtype", help="ours: KV storage dtype (default: the model's activation dtype, "
                   "as the plugin)")
    cli.add_generation_arguments(p)
    cli.add_reps(p, 3, "processes per engine and dtype, interleaved")
    cli.add_json(p)
    args = p.parse_args(argv)
    args.dtypes = cli.choices(p, "--dtypes", args.dtypes, DTYPES)
    args.engines = cli.choices(p, "--engines", args.engines, ENGINES)
    cli.check_pte_needs_model_dir(p, args)
    cli.check_generation(p, args)
    return args


def prepare(args) -> tuple[pathlib.Path, dict[str, pathlib.Path]]:
    """The HF dir and one .pte per dtype, built (in child processes) when missing."""
    model_dir, base = models.model_source(args.workdir, args.shape, args.seed, args.model_dir)
    return model_dir, models.ptes_by_dtype(args.pte, args.dtypes, base, model_dir, args.max_ctx_len,
                                           args.prefill_chunk)


def probe(engine: str, dtype: str, pte: pathlib.Path, model_dir: pathlib.Path, args) -> dict:
    """One measurement in a fresh process."""
    cmd = [sys.executable, str(PROBE), engine, "--prompt-len", str(args.prompt_len),
           "--new-tokens", str(args.new_tokens), "--seed", str(args.seed)]
    if engine == "ours":
        cmd += ["--pte", str(pte)]
        if args.compute:
            cmd += ["--compute", args.compute]
        if args.kv_dtype:
            cmd += ["--kv-dtype", args.kv_dtype]
    else:
        cmd += ["--model-dir", str(model_dir), "--dtype", dtype,
                "--prefill-chunk", str(args.prefill_chunk_of[dtype])]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        sys.exit(f"probe failed ({done.returncode}): {' '.join(cmd)}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def activation_bytes(shape: dict, dtype: str, chunk: int, context: int) -> int:
    """dtype size x (T x (hidden + 2 x intermediate + vocab) + heads x T x S)."""
    return DTYPE_BYTES[dtype] * (
        chunk * (shape["hidden"] + 2 * shape["intermediate"] + shape["vocab"])
        + shape["heads"] * chunk * context
    )


def derive(run: dict, shape: dict, dtype: str, args) -> dict:
    """The figures the tables show, from one probe's snapshots. Activations
    count in the dtype the engine computes in, KV in its storage dtype."""
    st = {s["stage"]: s for s in run["stages"]}
    after = [st[s] for s in ("load", "prefill", "decode")]
    chunk = min(args.prefill_chunk_of[dtype], args.prompt_len)
    kv_theory = st["decode"]["kv_tokens"] * kv_bytes_per_token(shape, run["kv_dtype"])
    act = activation_bytes(shape, run["compute_dtype"], chunk, args.prompt_len)
    expected = run["weight_bytes"] + kv_theory + act
    mlx_peak = max(s["mlx_peak"] for s in after)
    hwm = max(s["VmHWM"] for s in after)
    base = st["start"]["VmRSS"]
    out = {
        "weight_bytes": run["weight_bytes"],
        "weight_bytes_stored": run["weight_bytes_stored"],
        "kv_tokens": st["decode"]["kv_tokens"],
        "kv_bytes_theory": kv_theory,
        "kv_bytes_in_use": st["decode"]["kv_bytes_in_use"],
        "kv_bytes_allocated": st["decode"]["kv_bytes_allocated"],
        "activation_bytes": act,
        "expected_bytes": expected,
        "mlx_peak": mlx_peak,
        "mlx_peak_after_load": max(st["prefill"]["mlx_peak"], st["decode"]["mlx_peak"]),
        "mlx_peak_ratio": mlx_peak / expected,
        "rss_start": base,
        "rss_hwm": hwm,
        "rss_hwm_above_start": hwm - base,
        "rss_hwm_above_start_ratio": (hwm - base) / expected,
        "rss_hwm_ratio": hwm / expected,
    }
    if run["engine"] == "ours":
        load = st["load"]
        out.update({
            "load_pte_mapped": load["pte_mapped_rss"],
            # the cache's pools are lazy mx.zeros, not yet allocated: active
            # memory after load is the weights (and any constant tables)
            "load_mlx_active": load["mlx_active"],
            "load_mlx_peak": load["mlx_peak"],
            "load_anon_growth": load["RssAnon"] - st["start"]["RssAnon"],
            "load_file_growth": load["RssFile"] - st["start"]["RssFile"],
            "close_rss_freed": st["decode"]["VmRSS"] - st["closed"]["VmRSS"],
            "close_error": st["closed"].get("close_error"),
        })
    return out


def bench(args, model_dir: pathlib.Path, ptes: dict[str, pathlib.Path]) -> dict:
    shape = models.model_shape(model_dir)
    runs = {(d, e): [] for d in args.dtypes for e in args.engines}
    for rep in range(args.reps):
        for dtype in args.dtypes:
            # alternate which engine goes first, so neither always runs on a
            # machine the other just warmed (page cache, allocator)
            order = args.engines if rep % 2 == 0 else args.engines[::-1]
            for engine in order:
                run = probe(engine, dtype, ptes[dtype], model_dir, args)
                run["derived"] = derive(run, shape, dtype, args)
                runs[dtype, engine].append(run)
                d = run["derived"]
                log(f"rep {rep + 1}/{args.reps} {dtype} {engine}: MLX peak {d['mlx_peak'] / MB:.1f} MB "
                    f"({d['mlx_peak_ratio']:.2f}x expected), RSS HWM {d['rss_hwm'] / MB:.1f} MB")
    return {"shape": shape, "runs": runs}


# -- reporting ----------------------------------------------------------------


def mb(values) -> str:
    return fmt(spread([v / MB for v in values]), "{:.1f}")


def ratio(values) -> str:
    return fmt(spread(values), "{:.2f}")


def summarize(result: dict, args) -> dict:
    """Per dtype and engine, each derived figure as median/min/max; and the
    ours/mlx-lm ratios computed within each repetition."""
    out = {}
    for (dtype, engine), runs in result["runs"].items():
        keys = [k for k, v in runs[0]["derived"].items() if isinstance(v, (int, float))]
        out[f"{dtype}/{engine}"] = {k: spread([r["derived"][k] for r in runs]) for k in keys}
    if set(ENGINES) <= set(args.engines):
        for dtype in args.dtypes:
            ours, theirs = result["runs"][dtype, "ours"], result["runs"][dtype, "mlx-lm"]
            out[f"{dtype}/ours÷mlx-lm"] = {
                k: ratio_spread([a["derived"][k] for a in ours], [b["derived"][k] for b in theirs])
                for k in ("mlx_peak", "mlx_peak_after_load", "rss_hwm", "rss_hwm_above_start")
            }
    return out


def label(engine: str, rs: list[dict]) -> str:
    """The engine, with the dtypes it computes and stores KV in when they
    differ from the file's (a compute route may widen a bf16 program)."""
    r = rs[0]
    if r["compute_dtype"] == r["dtype"] and r["kv_dtype"] == r["dtype"]:
        return engine
    return f"{engine} (computes {r['compute_dtype']}, KV {r['kv_dtype']})"


def markdown(result: dict, args) -> str:
    runs = result["runs"]
    stages = []
    for (dtype, engine), rs in runs.items():
        for stage in STAGES:
            snaps = [s for r in rs for s in r["stages"] if s["stage"] == stage]
            if not snaps:
                continue
            col = lambda k: mb([s[k] for s in snaps]) if snaps[0].get(k) is not None else "–"  # noqa: E731
            kv = lambda k: col(k) if k in snaps[0] else "–"  # noqa: E731
            kv_tokens = fmt(spread([s["kv_tokens"] for s in snaps]), "{:.0f}") if "kv_tokens" in snaps[0] else "–"
            stages.append([dtype, label(engine, rs), stage, col("mlx_active"), col("mlx_peak"), col("mlx_cache"),
                           col("VmRSS"), col("RssAnon"), col("RssFile"), col("pte_mapped_rss"), col("VmHWM"),
                           kv_tokens, kv("kv_bytes_in_use"), kv("kv_bytes_allocated")])
    peaks = []
    for (dtype, engine), rs in runs.items():
        g = lambda k: [r["derived"][k] for r in rs]  # noqa: E731
        peaks.append([dtype, label(engine, rs), mb(g("weight_bytes")), mb(g("kv_bytes_theory")),
                      mb(g("activation_bytes")), mb(g("expected_bytes")), mb(g("mlx_peak")),
                      ratio(g("mlx_peak_ratio")), mb(g("rss_hwm")), mb(g("rss_hwm_above_start")),
                      ratio(g("rss_hwm_above_start_ratio")), ratio(g("rss_hwm_ratio"))])
    lines = [
        f"prompt {args.prompt_len} random ids, {args.new_tokens} greedy tokens; one fresh process "
        f"per measurement, {args.reps} per engine and dtype, interleaved; MB = 10^6 bytes; "
        "median [min–max]",
        "",
        "BLAS bound into MLX: " + "; ".join(
            f"{e} {sorted({str(r.get('blas')) for (_, e2), rs in runs.items() if e2 == e for r in rs})}"
            for e in args.engines
        ),
        "",
        "Per stage (MLX peak and RSS HWM cover that stage only):",
        "",
        *table(["dtype", "engine", "stage", "MLX active", "MLX peak", "MLX cache", "RSS", "RssAnon", "RssFile",
                ".pte mapped", "RSS HWM", "KV tokens", "KV in use", "KV allocated"], stages),
        "",
        "Peak against weights + KV in use + one step's activations (MB; ratios are per process):",
        "",
        *table(["dtype", "engine", "weights", "KV in use (theory)", "activations", "expected", "MLX peak",
                "MLX peak / expected", "RSS HWM", "RSS HWM − start", "(HWM − start) / expected", "HWM / expected"],
               peaks),
    ]
    if set(ENGINES) <= set(args.engines):
        ratios = []
        for dtype in args.dtypes:
            ours, theirs = runs[dtype, "ours"], runs[dtype, "mlx-lm"]
            r = lambda k: fmt(ratio_spread([a["derived"][k] for a in ours], [b["derived"][k] for b in theirs]),  # noqa: E731
                              "{:.2f}")
            ratios.append([dtype, r("mlx_peak"), r("mlx_peak_after_load"), r("rss_hwm"), r("rss_hwm_above_start")])
        lines += ["", *table(["dtype", "ours ÷ mlx-lm: MLX peak", "MLX peak after load", "RSS HWM",
                              "RSS HWM − start"], ratios)]
    if "ours" in args.engines:
        held = []
        for dtype in args.dtypes:
            d = [r["derived"] for r in runs[dtype, "ours"]]
            g = lambda k: mb([x[k] for x in d])  # noqa: E731
            errors = {x["close_error"] for x in d if x.get("close_error")}
            held.append([dtype, label("ours", runs[dtype, "ours"]), g("weight_bytes_stored"), g("weight_bytes"),
                         g("load_mlx_active"), g("load_mlx_peak"), g("load_pte_mapped"), g("load_anon_growth"),
                         g("load_file_growth"),
                         g("close_rss_freed") + (" (close failed: " + "; ".join(errors) + ")" if errors else "")])
        lines += [
            "",
            "Are the weights held twice? (ours, after load; MB)",
            "",
            *table(["dtype", "engine", "weights stored", "weights in memory", "MLX active", "MLX peak during load",
                    ".pte pages resident (mapped)", "RssAnon growth", "RssFile growth",
                    "RSS freed by program.close()"], held),
        ]
    s = result["shape"]
    lines += [
        "",
        f"activations = dtype size × (T × (hidden + 2 × intermediate + vocab) + heads × T × S), "
        f"T = prefill chunk ({min(args.prefill_chunk_of[args.dtypes[0]], args.prompt_len)}), "
        f"S = prompt length ({args.prompt_len}); hidden {s['hidden']}, intermediate "
        f"{s['intermediate']}, vocab {s['vocab']}, heads {s['heads']}. KV in use (theory) = live "
        f"tokens × {s['layers']} layers × 2 × {s['kv_heads']} kv heads × {s['head_dim']} × KV dtype size. "
        "Activations count in the dtype the engine computes in. Weights: in memory (after any "
        "widening). RSS start = the process after importing its engine, before loading.",
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    info = machine.machine_info(machine.bind_blas_and_import_mlx("auto"))
    model_dir, ptes = prepare(args)
    args.prefill_chunk_of = {}
    from llm_executorch_mlx.runtime import load_program

    for dtype, pte in ptes.items():
        program = load_program(pte)
        meta = program.metadata
        needed = args.prompt_len + args.new_tokens
        if (meta.max_context or 0) < needed:
            sys.exit(f"{pte} holds {meta.max_context} tokens; the run needs {needed}")
        args.prefill_chunk_of[dtype] = meta.prefill_chunk
        program.close()
    result = bench(args, model_dir, ptes)
    info["loadavg_end"] = os.getloadavg()
    print(markdown(result, args))
    if args.json:
        report = {
            "args": vars(args),
            "model_dir": model_dir,
            "ptes": ptes,
            "machine": info,
            "shape": result["shape"],
            "summary": summarize(result, args),
            "runs": {f"{d}/{e}": rs for (d, e), rs in result["runs"].items()},
        }
        write_json(args.json, report)


if __name__ == "__main__":
    main()
