"""A Llama-3.2-1B-shaped bf16 model for the GPU benchmark, carried as a skeleton.

A 1.2B-parameter .pte (2.5 GB) cannot travel to the lent GPU machine (64 MiB
a call) and that machine has no ExecuTorch to export one. So:

- ``pack OUT`` (here, with the ``export`` extra) exports the model with every
  parameter tensor filled with its own constant: the program, the layout and
  every non-parameter constant (RoPE frequencies...) are real, and the file
  gzips to a few MB. Each tensor gets a different constant so the exporter
  cannot merge identical blobs.
- ``unpack OUT --seed S`` (on the GPU machine, with mlx) unzips it, draws
  seeded random weights, writes them over the constants inside the .pte (by
  the named-data spans our container reports) and saves the same tensors as
  a Hugging Face ``model.safetensors`` for mlx-lm. Both engines then run the
  same weights; ``bench_decode.py --model-dir OUT/hf --pte OUT/model.pte``
  times them.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pathlib
import shutil
import sys
import tempfile

# Llama-3.2-1B's shape (transformers LlamaConfig fields), random weights.
LLAMA_32_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
    max_position_embeddings=131072, tie_word_embeddings=True, rope_theta=500000.0,
    rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=8192),
)
WEIGHT_STD = 0.02  # transformers' initializer_range for Llama


def pack(out: pathlib.Path, max_ctx_len: int, chunk: int) -> None:
    """Export the constant-filled skeleton to ``out/model.pte.gz`` + ``out/hf``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from bench_decode import export_pte, in_child

    config = LlamaConfig(**LLAMA_32_1B)
    with no_init_weights():
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.tie_weights()  # skipped initialisation leaves lm_head untied
    with torch.no_grad():
        for i, (_, p) in enumerate(model.named_parameters()):
            p.fill_((1 + (i % 128) / 128) * 2.0 ** (i // 128 - 8))  # distinct in bf16
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        hf = pathlib.Path(tmp) / "hf"
        model.save_pretrained(hf)
        del model
        pte = pathlib.Path(tmp) / "model.pte"
        in_child(export_pte, hf, pte, "bf16", max_ctx_len, chunk)
        with open(pte, "rb") as src, gzip.open(out / "model.pte.gz", "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst, 1 << 24)
        (out / "hf").mkdir(exist_ok=True)
        for name in ("config.json", "generation_config.json"):
            if (hf / name).exists():
                shutil.copy(hf / name, out / "hf" / name)
    _add_rope_theta(out / "hf" / "config.json")


def _add_rope_theta(config_path: pathlib.Path) -> None:
    """Transformers 5 writes ``rope_parameters`` only; mlx-lm reads ``rope_theta``
    and ``rope_scaling``, so write both spellings."""
    config = json.loads(config_path.read_text())
    rope = config.get("rope_parameters") or {}
    config.setdefault("rope_theta", rope.get("rope_theta", LLAMA_32_1B["rope_theta"]))
    config.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"}
                      or LLAMA_32_1B["rope_scaling"])
    config_path.write_text(json.dumps(config, indent=2))


def unpack(out: pathlib.Path, seed: int) -> None:
    """Write seeded random weights into ``out/model.pte`` and ``out/hf``."""
    import mlx.core as mx
    import numpy as np

    from llm_executorch_mlx.runtime.pte.container import PteFile

    pte_path = out / "model.pte"
    with gzip.open(out / "model.pte.gz", "rb") as src, open(pte_path, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 24)
    pte = PteFile(pte_path)
    spans = {key.split("/", 1)[-1].removeprefix("model."): pte.named_data_span(key)
             for key in pte.named_data_keys}
    pte.close()
    config = json.loads((out / "hf" / "config.json").read_text())
    names = [n for n in _parameter_names(config) if n in spans]
    file = np.memmap(pte_path, dtype=np.uint8, mode="r+")
    weights = {}
    for i, name in enumerate(names):
        shape = _parameter_shape(name, config)
        if name.endswith("norm.weight"):
            w = mx.ones(shape, dtype=mx.bfloat16)
        else:
            w = (mx.random.normal(shape, key=mx.random.key(seed * 10007 + i)) * WEIGHT_STD).astype(mx.bfloat16)
        raw = np.array(w.view(mx.uint16)).view(np.uint8).reshape(-1)
        start, end = spans[name]
        if end - start < raw.size:
            raise SystemExit(f"{name}: the .pte holds {end - start} bytes, the shape needs {raw.size}")
        file[start : start + raw.size] = raw
        weights[name] = w
        if name == "model.embed_tokens.weight" and "lm_head.weight" in spans:
            start, end = spans["lm_head.weight"]  # exported untied: the same matrix
            file[start : start + raw.size] = raw
    file.flush()
    del file
    mx.save_safetensors(str(out / "hf" / "model.safetensors"), weights, metadata={"format": "mlx"})
    print(f"wrote {len(weights)} tensors ({sum(w.nbytes for w in weights.values()) / 1e9:.2f} GB) "
          f"into {pte_path} and {out / 'hf' / 'model.safetensors'}")


def _parameter_names(config: dict) -> list[str]:
    names = ["embed_tokens.weight", "norm.weight"]
    for layer in range(config["num_hidden_layers"]):
        prefix = f"layers.{layer}."
        names += [prefix + n for n in (
            "input_layernorm.weight", "post_attention_layernorm.weight",
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        )]
    return ["model." + n for n in names]


def _parameter_shape(name: str, c: dict) -> tuple[int, ...]:
    hidden, inter, head = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    shapes = {
        "embed_tokens.weight": (c["vocab_size"], hidden), "norm.weight": (hidden,),
        "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q, hidden), "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, q),
        "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    for suffix, shape in shapes.items():
        if name.endswith(suffix):
            return shape
    raise KeyError(name)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("pack", help="export the constant-filled skeleton (needs the export extra)")
    a.add_argument("out", type=pathlib.Path)
    a.add_argument("--max-ctx-len", type=int, default=2048)
    a.add_argument("--prefill-chunk", type=int, default=128)
    b = sub.add_parser("unpack", help="fill seeded random weights (needs mlx)")
    b.add_argument("out", type=pathlib.Path)
    b.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.command == "pack":
        pack(args.out, args.max_ctx_len, args.prefill_chunk)
    else:
        unpack(args.out, args.seed)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
