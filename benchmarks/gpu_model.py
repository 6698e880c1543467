"""A Llama-3.2-1B-shaped model for the GPU benchmark, bf16 or 4/8-bit, carried as a skeleton.

A 1.2B-parameter .pte (2.5 GB in bf16, 0.7 GB in 4-bit) cannot travel to the
lent GPU machine (64 MiB a call) and that machine has no ExecuTorch to export
one. So:

- ``pack OUT [--quantize 4w]`` (here, with the ``export`` extra) exports the
  model with every parameter tensor filled with its own constant: the program,
  the layout and every non-parameter constant (RoPE frequencies...) are real,
  and the file gzips to a few MB. Each tensor gets a different constant, and
  its first 16 rows its index in binary (x1 or x-2), so the exporter cannot
  merge identical blobs: quantized, a constant alone packs to the same
  integers in every tensor.
- ``unpack OUT --seed S`` (on the GPU machine, with mlx) unzips it, draws
  seeded random bf16 weights, writes them over the constants inside the .pte
  (by the named-data spans our container reports) and saves the same tensors
  as a Hugging Face ``model.safetensors`` for mlx-lm. A quantized skeleton
  gets the same draws quantized once (``quantize``) and both files hold the
  same packed integers and scales: the .pte in the layout ExecuTorch's MLX
  backend writes, the safetensors as an mlx-lm quantized checkpoint. Both
  engines then run the same weights; ``bench_decode.py --model-dir OUT/hf
  --pte OUT/model.pte`` times them.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pathlib
import shutil
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
QUANTIZE_BITS = {"4w": 4, "8w": 8}  # the exporter's --qlinear/--qembedding configs


def pack(out: pathlib.Path, max_ctx_len: int, chunk: int, quantize: str | None = None,
         group_size: int = 32, shape: dict = LLAMA_32_1B) -> None:
    """Export the constant-filled skeleton to ``out/model.pte.gz`` + ``out/hf``;
    ``quantize`` ("4w", "8w") quantizes the linears and the embedding in groups
    of ``group_size``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights

    from harness.models import export_pte, in_child

    config = LlamaConfig(**shape)
    with no_init_weights():
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.tie_weights()  # skipped initialisation leaves lm_head untied
    with torch.no_grad():
        for i, (_, p) in enumerate(model.named_parameters()):
            p.fill_((1 + (i % 128) / 128) * 2.0 ** (i // 128 - 8))  # distinct in bf16
            if p.ndim == 2:  # i's bits in rows 0-15 (x1 or x-2): distinct integers and scales once quantized
                p[:16] *= torch.tensor([-2.0 if i >> b & 1 else 1.0 for b in range(16)])[:, None]
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        hf = pathlib.Path(tmp) / "hf"
        model.save_pretrained(hf)
        del model
        pte = pathlib.Path(tmp) / "model.pte"
        in_child(export_pte, hf, pte, "bf16", max_ctx_len, chunk, quantize, group_size if quantize else None)
        _check_distinct(pte, json.loads((hf / "config.json").read_text()), quantize is not None)
        with open(pte, "rb") as src, gzip.open(out / "model.pte.gz", "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst, 1 << 24)
        (out / "hf").mkdir(exist_ok=True)
        for name in ("config.json", "generation_config.json"):
            if (hf / name).exists():
                shutil.copy(hf / name, out / "hf" / name)
    config_path = out / "hf" / "config.json"
    _add_rope_theta(config_path)
    if quantize:
        # mlx-lm's marker of a quantized checkpoint; unpack reads it too.
        config = json.loads(config_path.read_text())
        config["quantization"] = {"group_size": group_size, "bits": QUANTIZE_BITS[quantize]}
        config_path.write_text(json.dumps(config, indent=2))


def _add_rope_theta(config_path: pathlib.Path) -> None:
    """Transformers 5 writes ``rope_parameters`` only; mlx-lm reads ``rope_theta``
    and ``rope_scaling``, so write both spellings."""
    config = json.loads(config_path.read_text())
    rope = config.get("rope_parameters") or {}
    config.setdefault("rope_theta", rope.get("rope_theta", LLAMA_32_1B["rope_theta"]))
    config.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"}
                      or LLAMA_32_1B["rope_scaling"])
    config_path.write_text(json.dumps(config, indent=2))


def _check_distinct(pte_path: pathlib.Path, config: dict, quantized: bool) -> None:
    """Refuse a skeleton where two parameters share a blob: unpack would write
    both draws into the same bytes."""
    spans = _named_data_spans(pte_path)
    seen = {}
    for name in _parameter_names(config):
        for key in _data_keys(name, quantized and not name.endswith("norm.weight")):
            if key not in spans:
                raise SystemExit(f"{pte_path}: no named data {key!r} for {name}")
            if spans[key] in seen:
                raise SystemExit(f"{pte_path}: {key} and {seen[spans[key]]} share one blob")
            seen[spans[key]] = key


def _named_data_spans(pte_path: pathlib.Path) -> dict[str, tuple[int, int]]:
    """Each named-data key of the .pte, less its program prefix, to its byte span."""
    from llm_executorch_mlx.runtime.pte.container import PteFile

    pte = PteFile(pte_path)
    try:
        return {key.split("/", 1)[-1].removeprefix("model."): pte.named_data_span(key)
                for key in pte.named_data_keys}
    finally:
        pte.close()


def _data_keys(name: str, quantized: bool) -> tuple[str, ...]:
    """The named data holding parameter ``name``: itself, or for a quantized
    weight the packed integers and the scales. The biases are not stored: the
    zero point is 0, so the program computes them as scales * -2^(bits-1)."""
    if not quantized:
        return (name,)
    stem = name.removesuffix(".weight") + ".parametrizations.weight."
    return stem + "original0_to_packed", stem + "original1"


def quantize(w, bits: int, group_size: int):
    """Symmetric per-group quantization of a bf16 matrix, as ExecuTorch's MLX
    backend stores it: ``(packed, scales, biases)`` in ``mx.quantize``'s
    layout (unsigned q + 2^(bits-1), packed LSB first into uint32), with
    biases = scales * -2^(bits-1).

    Scales follow torchao's symmetric min-max rule, max|w| / (2^(bits-1) - 0.5)
    per group (/ 7.5 in 4 bits); the exporter's HQQ refines them, which
    changes values, not the layout or the speed.
    """
    import mlx.core as mx

    offset = 1 << (bits - 1)
    rows, cols = w.shape
    groups = w.astype(mx.float32).reshape(rows, cols // group_size, group_size)
    scales = (mx.abs(groups).max(axis=-1, keepdims=True) / (offset - 0.5)).astype(mx.bfloat16)
    q = mx.clip(mx.round(groups / scales.astype(mx.float32)), -offset, offset - 1) + offset
    q = q.astype(mx.uint32).reshape(rows, cols * bits // 32, 32 // bits)
    packed = (q << mx.arange(0, 32, bits, dtype=mx.uint32)).sum(axis=-1)  # disjoint bits: sum is OR
    scales = scales.reshape(rows, -1)
    return packed, scales, scales * -offset


def unpack(out: pathlib.Path, seed: int) -> None:
    """Write seeded random weights into ``out/model.pte`` and ``out/hf``."""
    import mlx.core as mx
    import numpy as np

    pte_path = out / "model.pte"
    with gzip.open(out / "model.pte.gz", "rb") as src, open(pte_path, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 24)
    spans = _named_data_spans(pte_path)
    config = json.loads((out / "hf" / "config.json").read_text())
    quant = config.get("quantization")  # {"group_size", "bits"} for a quantized skeleton
    file = np.memmap(pte_path, dtype=np.uint8, mode="r+")

    def write(key: str, array) -> None:
        raw = np.array(array.view(mx.uint8)).reshape(-1)
        start, end = spans[key]
        if end - start != raw.size:
            raise SystemExit(f"{key}: the .pte holds {end - start} bytes, {raw.size} were drawn")
        file[start:end] = raw

    weights = {}
    for i, name in enumerate(_parameter_names(config)):
        shape = _parameter_shape(name, config)
        norm = name.endswith("norm.weight")
        if norm:
            w = mx.ones(shape, dtype=mx.bfloat16)
        else:
            w = (mx.random.normal(shape, key=mx.random.key(seed * 10007 + i)) * WEIGHT_STD).astype(mx.bfloat16)
        quantized = quant is not None and not norm  # the exporter quantizes linears and the embedding
        if quantized:
            packed, scales, biases = quantize(w, quant["bits"], quant["group_size"])
            stem = name.removesuffix("weight")
            weights.update({name: packed, stem + "scales": scales, stem + "biases": biases})
            stored = [packed, scales]
        else:
            weights[name] = w
            stored = [w]
        for key, array in zip(_data_keys(name, quantized), stored):
            write(key, array)
        if name == "model.embed_tokens.weight":
            # Exported untied in bf16: the same matrix again. Quantized, the
            # exporter re-ties lm_head and the program reads the embedding's blobs.
            for key, array in zip(_data_keys("lm_head.weight", quantized), stored):
                if key in spans:
                    write(key, array)
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
    a.add_argument("--quantize", choices=sorted(QUANTIZE_BITS),
                   help="quantize the linears and the embedding (the exporter's --qlinear/--qembedding)")
    a.add_argument("--group-size", type=int, choices=(32, 64, 128), default=32,
                   help="quantization group size (default: 32)")
    a.add_argument("--vocab-size", type=int, default=LLAMA_32_1B["vocab_size"],
                   help="the vocabulary (default: Llama-3.2's; 49152 is SmolLM2's, so its tokenizer serves and "
                        "the demo model can draft for it)")
    b = sub.add_parser("unpack", help="fill seeded random weights (needs mlx)")
    b.add_argument("out", type=pathlib.Path)
    b.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.command == "pack":
        pack(args.out, args.max_ctx_len, args.prefill_chunk, args.quantize, args.group_size,
             dict(LLAMA_32_1B, vocab_size=args.vocab_size))
    else:
        unpack(args.out, args.seed)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
