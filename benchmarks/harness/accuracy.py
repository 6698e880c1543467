"""Accuracy measures shared by the accuracy benchmarks: teacher-forced
logits over a fixed text, their perplexity, greedy replies, and llama.cpp's
perplexity of the same token ids."""

from __future__ import annotations

import pathlib

import numpy as np

PROMPTS = ("What is the capital of France?", "Why is the sky blue?", "Write a haiku about the sea.",
           "Explain what a hash table is.")


def text_and_prompts(tokenizer: pathlib.Path, text: pathlib.Path, text_tokens: int) -> tuple[list[int], list[list[int]]]:
    """The fixed text's first ``text_tokens`` ids, and the demo prompts in SmolLM2's chat format."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    text_ids = tok.encode(text.read_text()).ids[:text_tokens]
    prompts = [tok.encode(f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n").ids for p in PROMPTS]
    return text_ids, prompts


def logits_of(forward, ids: list[int], chunk: int, start: int = 0) -> np.ndarray:
    import mlx.core as mx

    rows = []
    for at in range(0, len(ids), chunk):
        part = np.array([ids[at:at + chunk]], dtype=np.int64)
        pos = np.arange(start + at, start + at + part.shape[1], dtype=np.int64)
        rows.append(np.array(forward.execute([part, pos])[0].astype(mx.float32))[0])
    return np.concatenate(rows)


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    """exp(mean NLL) of ids[1:] under the logits at the positions before them."""
    shifted = logits[:-1] - logits[:-1].max(-1, keepdims=True)
    nll = np.log(np.exp(shifted).sum(-1)) - shifted[np.arange(len(ids) - 1), ids[1:]]
    return float(np.exp(nll.mean()))


def greedy_replies(forward, cache, prompts: list[list[int]], chunk: int, new_tokens: int) -> list[list[int]]:
    """``new_tokens`` greedy ids after each prompt, each from an empty cache."""
    replies = []
    for ids in prompts:
        cache.clear()
        last = logits_of(forward, ids, chunk)[-1]
        reply = []
        for _ in range(new_tokens):
            reply.append(int(last.argmax()))
            last = logits_of(forward, reply[-1:], 1, start=len(ids) + len(reply) - 1)[-1]
        replies.append(reply)
    return replies


def llama_cpp_perplexity(gguf: pathlib.Path, ids: list[int], type_k: int | None = None,
                         type_v: int | None = None) -> float:
    """llama.cpp's perplexity of ``ids``; ``type_k``/``type_v``: its cache's
    GGML types (a quantized V needs its flash attention, so it is on then)."""
    import llama_cpp

    kv = {} if type_k is None else dict(type_k=type_k, type_v=type_v, flash_attn=True)
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=len(ids) + 8, n_batch=128, n_ubatch=128, logits_all=True,
                          verbose=False, **kv)
    llm.eval(ids)
    return perplexity(np.array(llm.scores[: len(ids)], dtype=np.float32), ids)
