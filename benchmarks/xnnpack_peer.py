"""ExecuTorch's own CPU path for a Hugging Face Llama: an XNNPACK .pte.

The peer engine of ``bench_decode.py``. The export follows what ExecuTorch
documents for Llama-family models on CPU (``export_llama ... -kv
--use_sdpa_with_kv_cache -X --xnnpack-extended-ops``): ExecuTorch's own
Llama transformer, a static KV cache held inside the program (updated by
``llama::update_cache``, attended by ``llama::custom_sdpa``, the kernels its
C++ runner uses), every linear and elementwise op lowered to XNNPACK, a
dynamic sequence length up to the prefill chunk. The Hugging Face weights are
converted as ``examples/models/smollm2/convert_weights.py`` does (through
torchtune's Llama 3 mapping, which un-permutes q/k for ExecuTorch's
interleaved RoPE); the conversion is done here directly so torchtune is not
needed.

The program's ``forward(tokens [1, n], input_pos [1])`` writes the ``n``
tokens at ``input_pos`` into its cache and returns the last position's
logits. It runs through ``executorch.runtime`` (the pybindings), which
registers XNNPACK; importing ``executorch.extension.llm.custom_ops`` registers
the ``llama::`` kernels with it.

Everything here imports torch and executorch lazily: importing this module
costs nothing.
"""

from __future__ import annotations

import json
import os
import pathlib
import warnings
from typing import Iterator

XNNPACK_DTYPES = ("fp32", "bf16")


# -- export (run in a child process) ------------------------------------------


def meta_params(model_dir: pathlib.Path) -> dict:
    """ExecuTorch ``ModelArgs`` fields for a Hugging Face Llama ``config.json``."""
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise ValueError(f"{model_dir}: the XNNPACK peer exports Llama models, not {config.get('model_type')}")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{model_dir}: rope_type {rope['rope_type']} is not handled here")
    n_heads = config["num_attention_heads"]
    return {
        "dim": config["hidden_size"],
        "hidden_dim": config["intermediate_size"],
        "n_heads": n_heads,
        "n_kv_heads": config.get("num_key_value_heads", n_heads),
        "head_dim": config.get("head_dim") or config["hidden_size"] // n_heads,
        "n_layers": config["num_hidden_layers"],
        "vocab_size": config["vocab_size"],
        "norm_eps": config.get("rms_norm_eps", 1e-6),
        "rope_theta": rope.get("rope_theta", config.get("rope_theta", 10000.0)),
        "use_scaled_rope": False,
        "attention_qkv_bias": bool(config.get("attention_bias", False)),
    }, bool(config.get("tie_word_embeddings", False))


def _unpermute(w, n_heads: int, head_dim: int):
    """Hugging Face's rotate-half q/k rows back to Meta's interleaved pairs
    (torchtune's ``hf_to_tune`` permutation)."""
    rows = w.shape[0]
    return w.view(n_heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(rows, -1)


def convert_checkpoint(model_dir: pathlib.Path, params: dict, tied: bool) -> dict:
    """The Hugging Face state dict under ExecuTorch's Llama names."""
    from safetensors.torch import load_file

    hf = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        hf.update(load_file(shard))
    names = {
        "model.embed_tokens.weight": "tok_embeddings.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
        "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
        "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
        "mlp.up_proj": "feed_forward.w3",
        "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm",
    }
    out = {}
    for key, value in hf.items():
        if key in names:
            out[names[key]] = value
            continue
        parts = key.split(".")  # model.layers.{i}.{module...}.{weight|bias}
        if parts[:2] != ["model", "layers"]:
            raise ValueError(f"unexpected weight {key}")
        module = ".".join(parts[3:-1])
        if module not in per_layer:
            raise ValueError(f"unexpected weight {key}")
        new = f"layers.{parts[2]}.{per_layer[module]}.{parts[-1]}"
        if module == "self_attn.q_proj":
            value = _unpermute(value, params["n_heads"], params["head_dim"])
        elif module == "self_attn.k_proj":
            value = _unpermute(value, params["n_kv_heads"], params["head_dim"])
        out[new] = value
    if "output.weight" not in out:
        if not tied:
            raise ValueError(f"{model_dir} has no lm_head.weight and does not tie embeddings")
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def export_xnnpack(model_dir: pathlib.Path, out: pathlib.Path, dtype: str, max_ctx_len: int, chunk: int) -> None:
    """Export ``model_dir`` to an XNNPACK ``.pte`` at ``out`` with
    ExecuTorch's ``export_llama`` (static in-graph KV cache of ``max_ctx_len``
    tokens, forward steps of up to ``chunk`` tokens)."""
    import torch
    from executorch.examples.models.llama.export_llama_lib import build_args_parser, export_llama

    if dtype not in XNNPACK_DTYPES:
        raise ValueError(f"XNNPACK peer dtypes: {XNNPACK_DTYPES}, not {dtype}")
    model_dir = pathlib.Path(model_dir)
    out = pathlib.Path(out)
    scratch = out.with_name(out.stem + ".export")
    scratch.mkdir(parents=True, exist_ok=True)
    params, tied = meta_params(model_dir)
    (scratch / "params.json").write_text(json.dumps(params))
    torch.save(convert_checkpoint(model_dir, params, tied), scratch / "checkpoint.pth")
    argv = [
        "--model", "llama3",  # ExecuTorch's Llama transformer; weights and params are ours
        "--checkpoint", str(scratch / "checkpoint.pth"),
        "--params", str(scratch / "params.json"),
        "-kv", "--use_sdpa_with_kv_cache",
        "-X", "--xnnpack-extended-ops",
        "-d", dtype,
        "--max_seq_length", str(chunk + 1),  # the traced length is bounded by max_seq_length - 1
        "--max_context_length", str(max_ctx_len),
        "--metadata", json.dumps({"get_bos_id": -1, "get_eos_ids": []}),
        "--output-dir", str(scratch),
        "--output_name", str(scratch / "model.pte"),  # a name ending in .pte is used verbatim
    ]
    if dtype == "bf16":
        argv.append("--xnnpack-enable-bf16")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        export_llama(build_args_parser().parse_args(argv))
    if not (scratch / "model.pte").exists():  # export_llama logs a failed save and returns
        raise RuntimeError(f"export_llama wrote no {scratch / 'model.pte'}")
    os.replace(scratch / "model.pte", out)
    for leftover in scratch.iterdir():
        leftover.unlink()
    scratch.rmdir()


def step_weight_bytes(model_dir: pathlib.Path, dtype_bytes: int) -> int:
    """Weight bytes one decode step of the exported program reads: every
    projection, norm and the output layer (a separate copy even when the
    Hugging Face model ties it), but of the input embedding table one row."""
    params, _ = meta_params(pathlib.Path(model_dir))
    dim, hd = params["dim"], params["head_dim"]
    q, kv = params["n_heads"] * hd, params["n_kv_heads"] * hd
    per_layer = dim * q + 2 * dim * kv + q * dim + 3 * dim * params["hidden_dim"] + 2 * dim
    if params["attention_qkv_bias"]:
        per_layer += q + 2 * kv
    total = params["n_layers"] * per_layer + dim + params["vocab_size"] * dim
    return total * dtype_bytes


# -- running ------------------------------------------------------------------


def delegated_backends(path: pathlib.Path) -> dict[str, int]:
    """How many delegate calls of each backend the program holds (a check that
    the export really went to XNNPACK), from the flatbuffer alone."""
    from llm_executorch_mlx.runtime.pte.container import PteFile

    counts: dict[str, int] = {}
    pte = PteFile(path)
    try:
        for plan in pte.plans.values():
            for delegate in plan.delegates:
                counts[delegate.backend_id] = counts.get(delegate.backend_id, 0) + 1
    finally:
        pte.close()
    return counts


class XnnpackPeer:
    """An XNNPACK ``.pte`` through ``executorch.runtime``, greedy decoding with
    an argmax on the host. The cache lives in the program, so a repetition
    starts over at position 0 (each step overwrites the positions it covers and
    attends only up to them)."""

    name = "xnnpack"

    def __init__(self, pte: pathlib.Path, prefill_chunk: int):
        import numpy as np
        import torch
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401 (registers llama:: kernels)
        from executorch.extension.pybindings import portable_lib
        from executorch.runtime import Runtime

        if "XnnpackBackend" not in portable_lib._get_registered_backend_names():
            raise RuntimeError("these executorch pybindings have no XNNPACK backend")
        self._np, self._torch = np, torch
        self.pte = pte
        self.program = Runtime.get().load_program(pte)
        self.forward = self.program.load_method("forward")
        self.prefill_chunk = prefill_chunk
        self.threads = portable_lib._threadpool_get_thread_count()
        self.backends = delegated_backends(pte)

    def _step(self, tokens: list[int], pos: int):
        torch = self._torch
        ids = torch.tensor([tokens], dtype=torch.long)
        start = torch.tensor([pos], dtype=torch.long)
        return self.forward.execute((ids, start))[0]

    def generate(self, prompt: list[int], new_tokens: int) -> Iterator[int]:
        pos = 0
        logits = None
        for i in range(0, len(prompt), self.prefill_chunk):
            piece = prompt[i:i + self.prefill_chunk]
            logits = self._step(piece, pos)
            pos += len(piece)
        for n in range(new_tokens):
            token = int(logits.reshape(-1, logits.shape[-1])[-1].argmax())
            yield token
            if n + 1 < new_tokens:
                logits = self._step([token], pos)
                pos += 1
