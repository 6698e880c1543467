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
    "llama-tied": (  # the LM head reads the embedding's table, as in SmolLM2
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    "llama-3kv": (  # heads, KV heads and MLP width that three ranks share (tensor parallel)
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(num_hidden_layers=2, hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=96),
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
            head_dim=32,  # groups of 32 fit: a quantized cache takes it
            sliding_window=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        ),
    ),
}


def build_config(arch: str, tied: bool = False):
    import transformers

    config_name, _, extra = ARCHITECTURES[arch]
    defaults = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, max_position_embeddings=512,
                    tie_word_embeddings=tied)
    return getattr(transformers, config_name)(**dict(defaults, **extra))


def synthetic_batch(generator, batch: int, length: int):
    """Sequences of a learnable rule: x[t+1] = (3 * x[t] + 7) % VOCAB."""
    import torch

    x0 = torch.randint(0, VOCAB, (batch, 1), generator=generator)
    seq = [x0]
    for _ in range(length - 1):
        seq.append((3 * seq[-1] + 7) % VOCAB)
    return torch.cat(seq, dim=1)


def build_model(arch: str, trained: bool, seed: int = 0, tied: bool = False):
    import torch
    import transformers

    torch.manual_seed(seed)
    _, model_name, _ = ARCHITECTURES[arch]
    model = getattr(transformers, model_name)(build_config(arch, tied))
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


def export_code() -> list[pathlib.Path]:
    """The project's code an export of a fixture runs: ``export.py`` and the
    package modules it imports at module level, and theirs, in turn (the
    imports inside its functions serve GGUF sources and ``llm pte export``'s
    checks, which fixtures do not use)."""
    import ast

    import llm_executorch_mlx

    package = pathlib.Path(llm_executorch_mlx.__file__).parent
    found, todo = [], [package / "export.py"]
    while todo:
        path = todo.pop()
        if path in found:
            continue
        found.append(path)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.level:
                base = path.parent
                for _ in range(node.level - 1):
                    base = base.parent
                target = base.joinpath(*(node.module or "").split("."))
                for candidate in (target.with_suffix(".py"), target / "__init__.py"):
                    if candidate.exists():
                        todo.append(candidate)
                        break
    return sorted(found)


def spec_key(**spec) -> str:
    """A fixture's cache key: its spec, the exporting libraries' versions,
    and the code that builds and exports it (a change there re-exports)."""
    import executorch  # noqa: F401  (its version belongs in the key)
    import importlib.metadata
    import inspect

    spec["executorch"] = importlib.metadata.version("executorch")
    spec["transformers"] = importlib.metadata.version("transformers")
    code = hashlib.sha1()
    for path in export_code():
        code.update(path.read_bytes())
    for builder in (build_config, synthetic_batch, build_model, make_fixture):
        code.update(inspect.getsource(builder).encode())
    code.update(json.dumps(ARCHITECTURES, sort_keys=True).encode())
    spec["code"] = code.hexdigest()
    return hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def make_fixture(root: pathlib.Path, arch: str, trained: bool, dtype: str, qlinear: str | None,
                 max_ctx_len: int = 128, prefill_chunk: int = 32, qembedding: str | None = None,
                 tied: bool = False) -> tuple[pathlib.Path, pathlib.Path]:
    """Save the HF model and export it; return (model dir, .pte path).
    ``qembedding``: the embedding quantized too; ``tied``: the LM head is the
    embedding's table (as SmolLM2's is).

    Results are kept under ``root`` by spec, so repeated runs reuse them.
    """
    from llm_executorch_mlx.export import export_hf_model

    key = spec_key(arch=arch, trained=trained, dtype=dtype, qlinear=qlinear, qembedding=qembedding, tied=tied,
                   max_ctx_len=max_ctx_len, prefill_chunk=prefill_chunk)
    extra = (f"-e{qembedding}" if qembedding else "") + ("-tied" if tied else "")
    out = root / f"{arch}-{'trained' if trained else 'random'}-{dtype}-{qlinear or 'dense'}{extra}-{key}"
    pte = out / "model.pte"
    model_dir = out / "hf"
    if pte.exists() and (model_dir / "config.json").exists():
        return model_dir, pte
    out.mkdir(parents=True, exist_ok=True)
    build_model(arch, trained, tied=tied).save_pretrained(model_dir)
    window = getattr(build_config(arch), "sliding_window", None) if arch == "gemma3" else None
    chunk = min(prefill_chunk, window) if window else prefill_chunk
    export_hf_model(model_dir, pte.with_suffix(".tmp"), dtype=dtype, qlinear=qlinear, qembedding=qembedding,
                    group_size=32 if qlinear or qembedding else None, max_ctx_len=max_ctx_len,
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


def reference_model(model_dir, dtype: str = "fp32", qlinear: str | None = None, qembedding: str | None = None,
                    group_size: int = 32, tied: bool = False):
    """transformers eager on the weights an export of ``model_dir`` holds:
    rounded to ``dtype`` and quantized as the exporter does (ExecuTorch's
    ``quantize_model_``, the head sharing the embedding's quantized table
    where ``tied``), computing in fp32 as our CPU route does."""
    import torch
    import transformers

    stored = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=stored).float()
    if qlinear or qembedding:
        from executorch.backends.mlx.llm.quantization import quantize_model_

        quantize_model_(model, qlinear_config=qlinear, qlinear_group_size=group_size if qlinear else None,
                        qembedding_config=qembedding, qembedding_group_size=group_size if qembedding else None,
                        tie_word_embeddings=tied)
    return model.eval()


def greedy_ids(model, ids: list[int], max_new_tokens: int, stop_id: int) -> list[int]:
    """The model's eager greedy continuation of ``ids``, without ``stop_id``."""
    import torch

    new = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = int(model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax())
            if nxt == stop_id:
                break
            new.append(nxt)
    return new


def hf_greedy(tokenizer_dir, model_dir, messages: list[dict], max_new_tokens: int, **weights):
    """The Hugging Face reference: transformers' own chat template and ids,
    and the model's eager greedy continuation up to ``<|eot_id|>``
    (``weights``: ``reference_model``'s dtype and quantization).

    Returns (prompt ids, continuation text).
    """
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    model = reference_model(model_dir, **weights)
    new = greedy_ids(model, ids, max_new_tokens, tok.convert_tokens_to_ids("<|eot_id|>"))
    return ids, tok.decode(new)


def hf_turns(tokenizer_dir, model_dir, user_turns: list[str], max_new_tokens: int, **weights):
    """transformers holding a conversation itself: each turn's prompt is the
    previous prompt, the ids it generated, ``<|eot_id|>`` and the new user
    turn as its chat template renders it; greedy and eager on that whole
    history each turn (what a cached multi-turn chat must equal).

    Returns, per turn, (prompt ids, reply ids, reply text); the text is what
    the reply adds to the decoded conversation (a reply starting a word
    keeps its leading space there, as our streaming decoder's does).
    """
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    model = reference_model(model_dir, **weights)
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    turns, history = [], []
    for text in user_turns:
        opening = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
        assert opening[0] == tok.bos_token_id
        ids = opening if not history else history + opening[1:]  # one BOS, at the start
        reply = greedy_ids(model, ids, max_new_tokens, eot)
        turns.append((ids, reply, tok.decode(ids + reply)[len(tok.decode(ids)):]))
        history = ids + reply + [eot]
    return turns
