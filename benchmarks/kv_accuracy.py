"""What a quantized KV cache (``-o kv_storage_dtype``, ``-o kv_value_dtype``)
costs in accuracy on the real model.

SmolLM2-135M-Instruct in fp32 (so the cache is the only rounding), exported
once with a 4,096-token context under ``--workdir``; for each storage of keys
/ values against the fp16 cache (the default where a model computes in fp32;
the fp32 row is the exact cache):

- **perplexity** of a fixed text (the repository's LICENSE, 2,048 tokens by
  default: the later positions attend over a long quantized history), and the
  largest logit difference from the fp16 cache's at any position, as a
  fraction of that position's logit range (max - min);
- **greedy agreement**: 128 greedy tokens after each demo prompt, how many
  match the fp16 cache's before the first difference.

Beside them, llama.cpp's perplexity of the same ids with its F32 GGUF of the
same weights and its cache in F16, Q8_0 (K and V), Q8_0/Q4_0 and Q4_0, where
llama-cpp-python is installed (``bench_formats.py`` fetches the GGUF).

    python benchmarks/kv_accuracy.py
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

from harness.accuracy import greedy_replies, llama_cpp_perplexity, logits_of, perplexity, text_and_prompts
from harness.models import cached_export
from harness.report import row, table
from harness.timing import common_prefix

HERE = pathlib.Path(__file__).resolve().parent
# fp32: the exact cache of a model computing in fp32, whose default is fp16
STORAGES = (("fp16", "fp16"), ("fp32", "fp32"), ("int8", "int8"), ("int8", "int4"), ("int4", "int4"))
# llama.cpp's cache types beside ours: GGML_TYPE_F16, Q8_0, Q4_0
LLAMA_CPP_KV = (("f16", 1, 1), ("q8_0", 8, 8), ("q8_0/q4_0", 8, 2), ("q4_0", 2, 2))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=pathlib.Path, default=HERE / ".work" / "smollm2",
                   help="bench_formats.py's SmolLM2 directory (its hf/, tokenizer and GGUFs)")
    p.add_argument("--pte", type=pathlib.Path, help="an fp32 .pte of at least --text-tokens context (default: exported)")
    p.add_argument("--text", type=pathlib.Path, default=HERE.parent / "LICENSE", help="the fixed text (default: LICENSE)")
    p.add_argument("--text-tokens", type=int, default=2048, help="tokens of the text scored (default: 2048)")
    p.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per prompt (default: 128)")
    return p.parse_args(argv)


def run(pte: pathlib.Path, keys: str, values: str, text_ids: list[int], prompts: list[list[int]],
        new_tokens: int) -> dict:
    from llm_executorch_mlx.runtime import load_program

    program = load_program(pte)
    program.prepare_cpu_kernels()
    chunk = program.metadata.prefill_chunk
    capacity = max(len(text_ids), max(map(len, prompts)) + new_tokens)
    cache = program.new_cache(capacity=capacity, dtype=keys, value_dtype=values)
    forward = program.load_method("forward", cache=cache)
    logits = logits_of(forward, text_ids, chunk)
    return {"logits": logits, "perplexity": perplexity(logits, text_ids),
            "replies": greedy_replies(forward, cache, prompts, chunk, new_tokens),
            "bytes_per_token": cache.bytes_per_token()}


def main(argv=None) -> None:
    args = parse_args(argv)
    pte = args.pte or cached_export(args.workdir / "kv", args.workdir / "hf", "fp32", 4096, 128)
    text_ids, prompts = text_and_prompts(args.workdir / "tokenizer.json", args.text, args.text_tokens)
    print(f"fixed text: {len(text_ids)} tokens of {args.text.name}; {len(prompts)} prompts, "
          f"{args.new_tokens} greedy tokens each; {pte.name}\n")
    print("\n".join(table(["K / V", "bytes per token (÷ fp16)", "perplexity", "logit error / range, median [max]",
                           "greedy tokens matching fp16"])))
    runs = {kv: run(pte, *kv, text_ids, prompts, args.new_tokens) for kv in STORAGES}
    base = runs["fp16", "fp16"]
    span = base["logits"].max(-1) - base["logits"].min(-1)
    for (keys, values), r in runs.items():
        error = np.abs(r["logits"] - base["logits"]).max(-1) / span
        agree = [f"{common_prefix(a, b)}/{len(a)}" for a, b in zip(r["replies"], base["replies"])]
        print(row([f"{keys} / {values}", f"{r['bytes_per_token']:,} ({r['bytes_per_token'] / base['bytes_per_token']:.3f})",
                   f"{r['perplexity']:.4f}", f"{np.median(error):.4f} [{error.max():.4f}]", ", ".join(agree)]))
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return
    gguf = args.workdir / "SmolLM2-135M-Instruct.F32.gguf"
    print("\n" + "\n".join(table([f"llama.cpp cache ({gguf.name})", "perplexity"])))
    for name, type_k, type_v in LLAMA_CPP_KV:
        print(row([name, f"{llama_cpp_perplexity(gguf, text_ids, type_k, type_v):.4f}"]))


if __name__ == "__main__":
    main()
