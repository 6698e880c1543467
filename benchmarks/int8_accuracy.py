"""What ``-o int8_activations`` costs in accuracy on the real model.

For each quantized ``.pte`` (default: ``bench_formats.py``'s 4- and 8-bit
exports of SmolLM2-135M-Instruct under ``--workdir``), the int8 route
(activations rounded to int8 per group, ``runtime/cpu/quantized_int8.h``)
against the route that keeps them within 2^-16 (``int8_activations=False``):

- **logits**: teacher-forced over a fixed text (the repository's LICENSE),
  the largest |int8 - other| at any position, as a fraction of that
  position's logit range (max - min), and the perplexity of the text under
  each route;
- **greedy agreement**: 128 greedy tokens after each demo prompt, how many
  match before the first difference.

Beside them, llama.cpp's perplexity of the same token ids with its GGUFs of
the same weights (default: ``bench_formats.py``'s F32, Q8_0, Q4_0 and the
wheel's Q4_1, where llama-cpp-python is installed): its quantized products
round activations to 8 bits per block of 32 as ours do.

    python benchmarks/int8_accuracy.py
    python benchmarks/int8_accuracy.py --pte a.pte --tokenizer tokenizer.json
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

from harness.accuracy import greedy_replies, llama_cpp_perplexity, logits_of, perplexity, text_and_prompts
from harness.report import row, table
from harness.timing import common_prefix

HERE = pathlib.Path(__file__).resolve().parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    work = HERE / ".work" / "smollm2"
    p.add_argument("--pte", action="append", type=pathlib.Path,
                   help="a quantized .pte (repeatable; default: bench_formats.py's q4 and q8 exports)")
    p.add_argument("--tokenizer", type=pathlib.Path, default=work / "hf" / "tokenizer.json")
    p.add_argument("--text", type=pathlib.Path, default=HERE.parent / "LICENSE", help="the fixed text (default: LICENSE)")
    p.add_argument("--text-tokens", type=int, default=900, help="tokens of the text scored (default: 900)")
    p.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per prompt (default: 128)")
    p.add_argument("--gguf", action="append", type=pathlib.Path,
                   help="a GGUF for llama.cpp's perplexity (repeatable; default: bench_formats.py's)")
    args = p.parse_args(argv)
    args.pte = args.pte or sorted(work.glob("ours-q[48]-*.pte"))
    args.gguf = args.gguf or sorted(work.glob("*.gguf"))
    if not args.pte:
        p.error("no .pte: run benchmarks/bench_formats.py --formats q4,q8 once, or pass --pte")
    return args


def route(pte: pathlib.Path, int8: bool, text_ids: list[int], prompts: list[list[int]], new_tokens: int) -> dict:
    from llm_executorch_mlx.runtime import load_program

    program = load_program(pte, int8_activations=int8)
    program.prepare_cpu_kernels()
    chunk = program.metadata.prefill_chunk
    capacity = max(len(text_ids), max(map(len, prompts)) + new_tokens)
    cache = program.new_cache(capacity=capacity, dtype="fp32")
    forward = program.load_method("forward", cache=cache)
    logits = logits_of(forward, text_ids, chunk)
    replies = greedy_replies(forward, cache, prompts, chunk, new_tokens)
    return {"logits": logits, "perplexity": perplexity(logits, text_ids), "replies": replies}


def main(argv=None) -> None:
    args = parse_args(argv)
    text_ids, prompts = text_and_prompts(args.tokenizer, args.text, args.text_tokens)
    print(f"fixed text: {len(text_ids)} tokens of {args.text.name}; {len(prompts)} prompts, {args.new_tokens} greedy tokens each\n")
    print("\n".join(table(["model", "logit error / range, median [max]", "perplexity, int8",
                           "perplexity, within 2^-16", "greedy tokens matching"])))
    for pte in args.pte:
        other, int8 = (route(pte, flag, text_ids, prompts, args.new_tokens) for flag in (False, True))
        span = other["logits"].max(-1) - other["logits"].min(-1)
        error = np.abs(int8["logits"] - other["logits"]).max(-1) / span
        agree = [f"{common_prefix(a, b)}/{len(a)}" for a, b in zip(int8["replies"], other["replies"])]
        print(row([pte.name, f"{np.median(error):.4f} [{error.max():.4f}]", f"{int8['perplexity']:.3f}",
                   f"{other['perplexity']:.3f}", ", ".join(agree)]))
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return
    print("\n" + "\n".join(table(["llama.cpp GGUF", "perplexity"])))
    for gguf in args.gguf:
        print(row([gguf.name, f"{llama_cpp_perplexity(gguf, text_ids):.3f}"]))


if __name__ == "__main__":
    main()
