"""Tiny Hugging Face models for the tests, built here (no weights to download).

Each architecture is a few layers of random weights; ``trained`` variants are
fitted for a few seconds on a synthetic sequence task so their logits have
clear winners (random bf16 weights tie too often to compare greedy tokens).
"""

from __future__ import annotations

import hashlib
import json
import pathlib

VOCAB = 256

ARCHITECTURES = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        ),
    ),
}


def build_config(arch: str):
    import transformers

    config_name, _, extra = ARCHITECTURES[arch]
    return getattr(transformers, config_name)(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        **extra,
    )


def synthetic_batch(generator, batch: int, length: int):
    """Sequences of a learnable rule: x[t+1] = (3 * x[t] + 7) % VOCAB."""
    import torch

    x0 = torch.randint(0, VOCAB, (batch, 1), generator=generator)
    seq = [x0]
    for _ in range(length - 1):
        seq.append((3 * seq[-1] + 7) % VOCAB)
    return torch.cat(seq, dim=1)


def build_model(arch: str, trained: bool, seed: int = 0):
    import torch
    import transformers

    torch.manual_seed(seed)
    _, model_name, _ = ARCHITECTURES[arch]
    model = getattr(transformers, model_name)(build_config(arch))
    if trained:
        generator = torch.Generator().manual_seed(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model.train()
        for _ in range(60):
            ids = synthetic_batch(generator, 16, 48)
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    return model


def spec_key(**spec) -> str:
    import executorch  # noqa: F401  (its version belongs in the key)
    import importlib.metadata

    spec["executorch"] = importlib.metadata.version("executorch")
    spec["transformers"] = importlib.metadata.version("transformers")
    return hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def make_fixture(root: pathlib.Path, arch: str, trained: bool, dtype: str, qlinear: str | None,
                 max_ctx_len: int = 128, prefill_chunk: int = 32) -> tuple[pathlib.Path, pathlib.Path]:
    """Save the HF model and export it; return (model dir, .pte path).

    Results are kept under ``root`` by spec, so repeated runs reuse them.
    """
    from llm_executorch_mlx.export import export_hf_model

    key = spec_key(arch=arch, trained=trained, dtype=dtype, qlinear=qlinear,
                   max_ctx_len=max_ctx_len, prefill_chunk=prefill_chunk)
    out = root / f"{arch}-{'trained' if trained else 'random'}-{dtype}-{qlinear or 'dense'}-{key}"
    pte = out / "model.pte"
    model_dir = out / "hf"
    if pte.exists() and (model_dir / "config.json").exists():
        return model_dir, pte
    out.mkdir(parents=True, exist_ok=True)
    build_model(arch, trained).save_pretrained(model_dir)
    window = getattr(build_config(arch), "sliding_window", None) if arch == "gemma3" else None
    chunk = min(prefill_chunk, window) if window else prefill_chunk
    export_hf_model(model_dir, pte.with_suffix(".tmp"), dtype=dtype, qlinear=qlinear,
                    group_size=32 if qlinear else None, max_ctx_len=max_ctx_len,
                    prefill_chunk=chunk)
    pte.with_suffix(".tmp").rename(pte)
    return model_dir, pte


LLAMA3_SPECIALS = ["<unk>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
CORPUS = [
    "Why is the sky blue? Because air scatters short blue wavelengths more than red ones.",
    "The quick brown fox jumps over the lazy dog. Hello there, how are you today?",
    "Tell me a story about a cat who learns to read books in the old library.",
    "Numbers like 1, 2, 3 and 42 appear in text; so do questions and answers.",
]


def make_tokenizer(directory: pathlib.Path, vocab_size: int = 200, extra_tokens: int = 0) -> pathlib.Path:
    """A small BPE tokenizer.json (+ tokenizer_config.json with a Llama 3 chat
    template) whose vocabulary fits the test models' 256 ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=LLAMA3_SPECIALS))
    tok.add_tokens([f"<extra_{i}>" for i in range(extra_tokens)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "chat_template": LLAMA3_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }))
    return directory / "tokenizer.json"


def hf_greedy(tokenizer_dir, model_dir, messages: list[dict], max_new_tokens: int):
    """The Hugging Face reference: transformers' own chat template and ids,
    and the model's eager greedy continuation up to ``<|eot_id|>``.

    Returns (prompt ids, continuation text).
    """
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eot, pad_token_id=eot)
    new = out[0, len(ids):].tolist()
    if new and new[-1] == eot:
        new = new[:-1]
    return ids, tok.decode(new)
