"""The models the benchmarks run: seeded random Llamas of a named shape saved
as Hugging Face directories, and our exports of them, each made once and
cached under a work directory.

Building and exporting run in a child process (``in_child``), so torch thread
pools, executorch and gigabytes of scratch memory leave nothing behind in the
process being timed.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

from .report import log

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
DTYPES = ("fp32", "bf16", "fp16")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


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


def export_pte(model_dir: pathlib.Path, out: pathlib.Path, dtype: str, max_ctx_len: int, chunk: int,
               quantize: str | None = None, group_size: int | None = None) -> None:
    """Export ``model_dir`` to ``out`` with our ``export_hf_model``; ``quantize``
    ("4w", "8w") quantizes the linears and the embedding."""
    from llm_executorch_mlx.export import export_hf_model

    tmp = out.with_name(out.stem + ".tmp.pte")
    export_hf_model(model_dir, tmp, dtype=dtype, qlinear=quantize, qembedding=quantize, group_size=group_size,
                    max_ctx_len=max_ctx_len, prefill_chunk=chunk)
    os.replace(tmp, out)


def in_child(fn, *args) -> None:
    """Run ``fn(*args)`` in a fresh process, its stdout sent to stderr."""
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        pool.submit(_to_stderr, fn, *args).result()


def _to_stderr(fn, *args) -> None:
    """Call ``fn(*args)`` with stdout sent to stderr: stdout is the report's."""
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    fn(*args)


def model_source(workdir: pathlib.Path, shape: str, seed: int,
                 model_dir: pathlib.Path | None = None) -> tuple[pathlib.Path, pathlib.Path]:
    """The Hugging Face model dir and the folder its exports are cached in:
    ``model_dir`` if given, its exports under a name taken from its path (so
    they are never mistaken for the random model's), else the random model of
    ``shape`` and ``seed``, built when missing."""
    if model_dir is not None:
        import hashlib

        resolved = model_dir.resolve()
        digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:8]
        return model_dir, workdir / f"{resolved.name}-{digest}"
    base = workdir / f"{shape}-seed{seed}"
    model_dir = base / "hf"
    if not (model_dir / "config.json").exists():
        base.mkdir(parents=True, exist_ok=True)
        log(f"building random {shape} model in {model_dir}")
        in_child(build_random_model, shape, seed, model_dir)
    return model_dir, base


def cached_export(base: pathlib.Path, model_dir: pathlib.Path, dtype: str, max_ctx_len: int,
                  chunk: int) -> pathlib.Path:
    """Our export of ``model_dir`` in ``dtype``, made under ``base`` when missing."""
    pte = base / f"{dtype}-ctx{max_ctx_len}-chunk{chunk}.pte"
    if not pte.exists():
        base.mkdir(parents=True, exist_ok=True)
        log(f"exporting {dtype} to {pte}")
        in_child(export_pte, model_dir, pte, dtype, max_ctx_len, chunk)
    return pte


def ptes_by_dtype(given: list[pathlib.Path], dtypes: list[str], base: pathlib.Path, model_dir: pathlib.Path,
                  max_ctx_len: int, chunk: int) -> dict[str, pathlib.Path]:
    """One .pte per dtype of ``dtypes``: a ``given`` file of that dtype (read
    from the file), else ``cached_export``'s."""
    ptes = {}
    for path in given:
        dtype = pte_info(path)[0]
        if dtype not in dtypes:
            sys.exit(f"--pte {path} is {dtype}, which --dtypes ({','.join(dtypes)}) does not ask for")
        ptes[dtype] = path
    for dtype in dtypes:
        if dtype not in ptes:
            ptes[dtype] = cached_export(base, model_dir, dtype, max_ctx_len, chunk)
    return ptes


def pte_info(path: pathlib.Path) -> tuple[str, int, int]:
    """The activation dtype a .pte publishes (or its graph shows), its max
    context and prefill chunk."""
    from llm_executorch_mlx.runtime import load_program

    meta = load_program(path, compute="native").metadata
    return meta.activation_dtype, meta.max_context, meta.prefill_chunk


def model_shape(model_dir: pathlib.Path) -> dict:
    """The sizes of a Hugging Face Llama ``config.json`` that byte counts need."""
    c = json.loads((model_dir / "config.json").read_text())
    c = c.get("text_config", c)
    heads = c["num_attention_heads"]
    return {
        "hidden": c["hidden_size"],
        "intermediate": c["intermediate_size"],
        "vocab": c["vocab_size"],
        "heads": heads,
        "kv_heads": c.get("num_key_value_heads") or heads,
        "head_dim": c.get("head_dim") or c["hidden_size"] // heads,
        "layers": c["num_hidden_layers"],
    }


def kv_bytes_per_token(shape: dict, dtype: str) -> int:
    """K and V bytes one token takes in every layer: layers x 2 x kv_heads x head_dim x size."""
    return shape["layers"] * 2 * shape["kv_heads"] * shape["head_dim"] * DTYPE_BYTES[dtype]


def prefill_macs_per_token(shape: dict, prompt_len: int) -> float:
    """Multiply-adds one token of a ``prompt_len`` prompt costs: every layer's
    linears, and attention's scores and weighted values over the mean causal
    context. The LM head, which a prefill runs for its last position only, is
    left out."""
    h, q, kv = shape["hidden"], shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
    linears = h * (q + 2 * kv) + q * h + 3 * h * shape["intermediate"]
    attention = 2 * q * (prompt_len + 1) / 2
    return shape["layers"] * (linears + attention)


def random_prompt(seed: int, vocab_size: int, n: int) -> list[int]:
    """``n`` seeded random ids of a vocabulary."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocab_size, n).tolist()
