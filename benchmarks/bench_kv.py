"""Speed of a quantized KV cache (``-o kv_storage_dtype``, ``-o
kv_value_dtype``) and of an fp32 one (a CPU's default for a model that
computes in fp32) against the fp16 cache, at long contexts, beside
llama.cpp's caches of the same widths.

One process, interleaved: per repetition and context length, a prompt of
that many tokens then ``--new-tokens`` greedy ones, through ``generate_tokens``
(the plugin's loop) with a fresh cache in each storage, and, given
``--gguf``, llama.cpp with its cache in F16, Q8_0, Q8_0/Q4_0, Q4_0 and F32
(its flash attention on for all: a quantized value cache needs it). The
table gives prefill and decode tok/s and, per repetition, each storage's
speed ÷ the same engine's fp16 cache, and ours ÷ llama.cpp at the same
widths.

    python benchmarks/bench_kv.py MODEL.pte --contexts 2048,3584 [--gguf MODEL.gguf]
"""

from __future__ import annotations

import argparse
import pathlib

from harness import cli
from harness.engines import LlamaCpp, Ours
from harness.machine import bind_blas_and_import_mlx, machine_info
from harness.models import random_prompt
from harness.report import fmt, log, ratio_spread, spread, table, write_json
from harness.timing import settle

# ours (keys, values) beside llama.cpp's cache of the same widths
STORAGES = {("fp16", "fp16"): "f16", ("int8", "int8"): "q8_0", ("int8", "int4"): "q8_0/q4_0",
            ("int4", "int4"): "q4_0", ("fp32", "fp32"): "f32"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pte", type=pathlib.Path)
    ap.add_argument("--contexts", default="2048", help="prompt lengths, comma-separated (default: 2048)")
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy tokens after each prompt (default: 64)")
    ap.add_argument("--gguf", type=pathlib.Path, help="the same weights for llama.cpp (default: ours only)")
    ap.add_argument("--model-dir", type=pathlib.Path,
                    help="the Hugging Face directory of the weights (llama.cpp's KV bytes; default: none)")
    ap.add_argument("--threads", type=int, default=2)
    cli.add_reps(ap, 3)
    cli.add_json(ap)
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    info = machine_info(bind_blas_and_import_mlx())
    engines = {}
    for (keys, values), theirs in STORAGES.items():
        engines["ours", keys, values] = Ours(args.pte, name=f"ours {keys}/{values}", kv_dtype=keys,
                                             kv_value_dtype=values)
        if args.gguf:
            ctx = max(contexts) + args.new_tokens + 8
            engines["llama.cpp", keys, values] = LlamaCpp(args.gguf, theirs, ctx, 128, args.threads, theirs, True,
                                                          args.model_dir or args.pte.parent, flash_attn=True)
    meta = engines["ours", "fp16", "fp16"].program.metadata
    if max(contexts) + args.new_tokens > meta.max_context:
        ap.error(f"a context of {max(contexts)} plus {args.new_tokens} tokens is past the model's {meta.max_context}")
    raw = {"machine": info, "pte": str(args.pte), "reps": []}
    for engine in engines.values():  # warm: kernels built, pools allocated once
        engine.run(random_prompt(0, meta.vocab_size, 64), 4)
    for rep in range(args.reps):
        runs = {}
        for n in contexts:
            prompt = random_prompt(rep, meta.vocab_size, n)
            order = list(engines.items()) if rep % 2 == 0 else list(reversed(engines.items()))
            for key, engine in order:
                settle()
                run = engine.run(prompt, args.new_tokens)
                runs[" ".join(key) + f" {n}"] = {"prefill": run.prefill_tps, "decode": run.decode_tps}
                log(f"rep {rep} {' '.join(key)} at {n}: prefill {run.prefill_tps:.1f}, decode {run.decode_tps:.2f}")
        raw["reps"].append(runs)
    print(f"{info['cpu_model']} ({info['cpus_available']} cores, {info['mlx_device']}); {args.pte.name}; "
          f"{args.new_tokens} greedy tokens after each context; {args.reps} repetitions, median [min–max]\n")
    rows = []
    for n in contexts:
        for engine_name, keys, values in engines:
            def series(what, k=keys, v=values, e=engine_name):
                return [r[f"{e} {k} {v} {n}"][what] for r in raw["reps"]]
            base = lambda what, e=engine_name: series(what, "fp16", "fp16", e)  # noqa: E731
            peer = (lambda what, k=keys, v=values: series(what, k, v, "llama.cpp")) if args.gguf else None
            rows.append([n, f"{engine_name} {keys}/{values}", engines[engine_name, keys, values].kv_bytes_per_token,
                         fmt(spread(series("prefill"))), fmt(spread(series("decode")), "{:.2f}"),
                         fmt(ratio_spread(series("decode"), base("decode")), "{:.2f}"),
                         fmt(ratio_spread(series("decode"), peer("decode")), "{:.2f}")
                         if peer and engine_name == "ours" else ""])
    print("\n".join(table(["context", "engine, K/V", "KV bytes/token", "prefill tok/s", "decode tok/s",
                           "decode ÷ its fp16 cache", "decode ours ÷ llama.cpp"], rows)))
    if args.json:
        write_json(args.json, raw)


if __name__ == "__main__":
    main()
