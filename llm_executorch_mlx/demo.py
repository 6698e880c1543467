"""The demo model: built here, offline, from text every Python install has.

``llm pte demo`` (or ``build_demo()``) makes ``pte:demo`` in a few minutes on
two CPU cores, with nothing to download:

1. Corpus: the documentation strings of the standard library. A child
   Python imports every module of ``sys.stdlib_module_names`` (and the
   submodules of its packages) that imports cleanly, skipping the few with
   side effects, and collects the ``__doc__`` of modules, classes, functions
   and methods; doctest examples are dropped, duplicates removed. About 1 MB
   of English on CPython 3.11.
2. Tokenizer: byte-level BPE (``tokenizers``), 4096 ids, Llama 3's
   pre-tokenizer split, its special tokens and its chat template in
   ``tokenizer_config.json``.
3. Training data: conversations of 1-3 turns, each asking about an object
   by name ("What does json.dumps do?", "The os module") and answered with
   the opening prose of its docstring, rendered with the chat template.
4. Model: a 4-layer Llama (hidden 256, GQA 4/2 heads, tied embeddings,
   ~4M parameters) trained with AdamW on 256-token windows of that stream.
5. Export: ``export_model`` (the code behind ``llm pte export``), fp32,
   context 256; registered as ``pte:demo`` by the command.

Every random choice is seeded, so a build is reproducible on one machine
(the corpus follows the Python version it runs on). Needs the ``export``
extra (torch, transformers, executorch).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import pathlib
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
PTE_NAME = "demo.pte"
BUILD_INFO = "demo.json"  # written last: its presence means the build finished

# Modules whose import does something (opens a browser, prints, runs tests, starts a GUI)
# or that only exist as test data.
SKIP_MODULES = {
    "antigravity", "this", "idlelib", "turtledemo", "tkinter", "turtle", "lib2to3",
    "pydoc_data", "test", "ensurepip", "venv", "readline", "msilib", "winreg",
    "winsound", "msvcrt", "nt", "encodings", "distutils",
}
SKIP_SUBMODULE_PARTS = {"__main__", "test", "tests", "idle_test"}


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the demo model; ``build_demo`` records it in demo.json."""

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    context: int = 256  # training window and the exported max context
    batch_size: int = 4
    steps: int = 500
    learning_rate: float = 3e-3
    warmup: int = 20
    seed: int = 1234
    dtype: str = "fp32"  # measured faster than bf16 on MLX's CPU backend
    prefill_chunk: int = 64
    modules: tuple[str, ...] | None = None  # None: the whole standard library
    kinds: tuple[str, ...] = ("module", "class", "function")  # whose docstrings the model learns
    max_docs: int | None = None


RECIPE = Recipe()


@dataclass
class DemoBuild:
    directory: pathlib.Path
    pte: pathlib.Path
    tokenizer: pathlib.Path
    built: bool  # False: found already built
    seconds: float = 0.0
    info: dict = field(default_factory=dict)


def default_directory() -> pathlib.Path:
    import llm

    return pathlib.Path(llm.user_dir()) / "executorch-mlx" / "demo"


def is_built(directory: pathlib.Path) -> bool:
    return all((directory / n).is_file() for n in (PTE_NAME, "tokenizer.json", BUILD_INFO))


def build_demo(
    directory: str | os.PathLike | None = None,
    *,
    recipe: Recipe | None = None,
    steps: int | None = None,
    force: bool = False,
    progress: Callable[[str], None] | None = None,
) -> DemoBuild:
    """Build the demo model into ``directory`` (default: under ``llm.user_dir()``).

    Returns at once when it is already built there, unless ``force``.
    """
    recipe = recipe or RECIPE
    if steps is not None:
        recipe = replace(recipe, steps=steps)
    directory = pathlib.Path(directory).expanduser().resolve() if directory else default_directory()
    result = DemoBuild(directory, directory / PTE_NAME, directory / "tokenizer.json", built=False)
    if is_built(directory) and not force:
        result.info = json.loads((directory / BUILD_INFO).read_text())
        return result

    from .export import ExportError, check_export_dependencies

    check_export_dependencies()
    # Set before torch starts OpenMP: with the default busy-waiting, one core
    # taken by anything else makes every op of a 2-thread training wait (7x slower).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    started = time.monotonic()

    def say(message: str) -> None:
        if progress is not None:
            progress(f"[{time.monotonic() - started:5.1f}s] {message}")

    directory.mkdir(parents=True, exist_ok=True)
    (directory / BUILD_INFO).unlink(missing_ok=True)
    hf_dir = directory / "hf"

    say("collecting the standard library's docstrings" + (f" ({', '.join(recipe.modules)})" if recipe.modules else ""))
    try:
        docs = collect_docstrings(recipe.modules)
    except (subprocess.SubprocessError, OSError, ValueError) as e:
        detail = (getattr(e, "stderr", None) or b"").decode(errors="replace").strip().splitlines()
        raise ExportError(f"could not collect the standard library's docstrings: {detail[-1] if detail else e}") from None
    if recipe.max_docs is not None:
        docs = docs[: recipe.max_docs]
    trained = [d for d in docs if d[1] in recipe.kinds]
    if not trained:
        raise ExportError("found no docstrings to train on")
    chars = sum(len(d) for _, _, d in docs)
    say(f"corpus: {len(docs)} docstrings, {chars / 1e6:.2f} MB")

    texts = training_texts(trained, recipe.seed)
    say(f"training a {recipe.vocab_size}-token BPE tokenizer")
    tokenizer = train_tokenizer([doc for _, _, doc in docs] + texts, recipe.vocab_size)
    save_tokenizer(tokenizer, hf_dir, recipe.context)
    stream = [i for t in texts for i in tokenizer.encode(t, add_special_tokens=False).ids]
    say(f"{len(stream):,} training tokens")

    from .export import export_model, quiet_libraries

    with quiet_libraries():
        model, losses = train_model(stream, recipe, len(tokenizer.get_vocab()), say)
        model.save_pretrained(hf_dir)
    (hf_dir / "generation_config.json").write_text(json.dumps({
        "bos_token_id": tokenizer.token_to_id(BOS),
        "eos_token_id": [tokenizer.token_to_id(EOS), tokenizer.token_to_id(EOT)],
    }, indent=2))

    say(f"exporting to {directory / PTE_NAME} ({recipe.dtype}, context {recipe.context})")
    exported = export_model(
        hf_dir, directory / PTE_NAME, dtype=recipe.dtype, max_ctx_len=recipe.context,
        prefill_chunk=min(recipe.prefill_chunk, recipe.context), force=True,
        progress=(lambda m: progress("    " + m)) if progress else None,
    )
    seconds = time.monotonic() - started
    result.info = {
        "recipe": asdict(recipe),
        "python": sys.version.split()[0],
        "docstrings": len(docs),
        "trained_docstrings": len(trained),
        "corpus_chars": chars,
        "training_tokens": len(stream),
        "parameters": sum(p.numel() for p in model.parameters()),
        "loss_first": losses[0],
        "loss_last": sum(losses[-10:]) / len(losses[-10:]),
        "pte_bytes": exported.file_bytes,
        "seconds": round(seconds, 1),
    }
    (directory / BUILD_INFO).write_text(json.dumps(result.info, indent=2))
    result.built, result.seconds = True, seconds
    return result


# -- corpus -------------------------------------------------------------------


def collect_docstrings(modules: tuple[str, ...] | None = None) -> list[tuple[str, str, str]]:
    """``(qualified name, kind, cleaned docstring)`` from the standard library.

    Imports happen in a child Python, so the caller's process is untouched.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "docs.json"
        env = dict(os.environ, PYTHONHASHSEED="0", PYTHONWARNINGS="ignore")
        subprocess.run(
            [sys.executable, "-m", "llm_executorch_mlx.demo", "collect", str(out), *(modules or ())],
            check=True, capture_output=True, env=env, timeout=300, stdin=subprocess.DEVNULL,
        )
        raw = json.loads(out.read_text())
    docs, seen = [], set()
    for name, kind, doc in raw:
        text = clean_docstring(doc)
        if len(text) >= 40 and text not in seen:
            seen.add(text)
            docs.append((name, kind, text))
    return docs


def _stdlib_names(requested: list[str]) -> list[str]:
    import pkgutil

    names = requested or sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in SKIP_MODULES)
    found = []
    for name in names:
        module = _quiet_import(name)
        if module is None:
            continue
        found.append(name)
        for sub in pkgutil.walk_packages(getattr(module, "__path__", None) or [], name + ".", onerror=lambda _: None):
            if not SKIP_SUBMODULE_PARTS & set(sub.name.split(".")):
                found.append(sub.name)
    return found


def _quiet_import(name: str):
    import contextlib
    import importlib
    import io
    import warnings

    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except BaseException:  # noqa: BLE001  anything a module does on import
        return None


def _collect(out: str, requested: list[str]) -> None:
    """Runs in the child: import, walk, write raw docstrings as JSON."""
    import warnings

    warnings.simplefilter("ignore")
    found: list[tuple[str, str, str]] = []

    def add(qualname: str, kind: str, obj) -> None:
        doc = getattr(obj, "__doc__", None)
        if isinstance(doc, str) and doc.strip():
            found.append((qualname, kind, doc))

    for name in _stdlib_names(requested):
        module = _quiet_import(name)
        if module is None:
            continue
        add(name, "module", module)
        for attr in sorted(dir(module)):
            if attr.startswith("_"):
                continue
            try:
                obj = getattr(module, attr)
            except Exception:  # noqa: BLE001
                continue
            if getattr(obj, "__module__", None) != name:
                continue
            if inspect.isclass(obj):
                add(f"{name}.{attr}", "class", obj)
                for member in sorted(vars(obj)):
                    value = vars(obj)[member]
                    if not member.startswith("_") and callable(value):
                        add(f"{name}.{attr}.{member}", "method", value)
            elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
                add(f"{name}.{attr}", "function", obj)
    pathlib.Path(out).write_text(json.dumps(found))


def clean_docstring(doc: str) -> str:
    """Dedent, drop doctest examples, squeeze blank lines."""
    lines, in_example = [], False
    for line in inspect.cleandoc(doc).splitlines():
        stripped = line.strip()
        if stripped.startswith(">>>"):
            in_example = True
            continue
        if in_example:
            if not stripped:
                in_example = False
            continue
        lines.append(line.rstrip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


_SIGNATURE = re.compile(r"^[\w.]+\(.*\)(\s*->.*)?\.?$")
_QUESTIONS = {
    "module": ("The {q} module", "Tell me about the {q} module.", "What is the {q} module for?"),
    "class": ("The {q} class", "What is {q}?", "Tell me about the {q} class."),
    "function": ("What does {q} do?", "The {q} function", "Explain {q}."),
    "method": ("What does {q} do?", "The {q} method", "Explain {q}."),
}


def answer_text(doc: str, limit: int = 400) -> str | None:
    """The docstring's opening prose, lines unwrapped: a signature line is
    skipped, at most two paragraphs, cut at a sentence end before ``limit``."""
    paragraphs = [p.strip() for p in doc.split("\n\n") if p.strip()]
    if paragraphs and "\n" not in paragraphs[0] and _SIGNATURE.match(paragraphs[0]):
        paragraphs = paragraphs[1:]
    prose = []
    for p in paragraphs[:2]:
        lines = p.splitlines()
        if any(line.startswith((" ", "\t", "-", "*", "|", ":")) for line in lines[1:]):
            break  # a list, table or code: stop at the prose before it
        prose.append(" ".join(line.strip() for line in lines))
    text = "\n\n".join(prose)
    if len(text) > limit:
        cut = text.rfind(". ", 0, limit)
        if cut < 40:
            return None
        text = text[: cut + 1]
    return text if len(text) >= 20 else None


def training_texts(docs: list[tuple[str, str, str]], seed: int) -> list[str]:
    """The training samples, shuffled: conversations of 1-3 turns, each asking
    about an object by name and answered with its docstring's opening."""
    import jinja2

    rng = random.Random(seed)
    template = jinja2.Environment().from_string(CHAT_TEMPLATE)
    pairs = []
    for name, kind, doc in docs:
        answer = answer_text(doc)
        if answer:
            pairs.append((rng.choice(_QUESTIONS[kind]).format(q=name), answer))
    # consecutive pairs stay together (same module), as a user would ask follow-ups
    chats, i = [], 0
    while i < len(pairs):
        n = rng.randint(1, 3)
        messages = []
        for question, answer in pairs[i : i + n]:
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        chats.append(template.render(messages=messages, bos_token=BOS, add_generation_prompt=False))
        i += n
    rng.shuffle(chats)
    return chats


# -- tokenizer ----------------------------------------------------------------


# Llama 3's pre-tokenizer split: runs of newlines are one piece wherever they
# stand, so "<|end_header_id|>\n\n" tokenizes alike at the end of a prompt and
# inside training text (GPT-2's pattern splits them differently).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # the trainer sees text without the special tokens spelled out
    pattern = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
    tok.train_from_iterator((pattern.sub("\n", t) for t in texts), trainer)
    return tok


def save_tokenizer(tok, directory: pathlib.Path, context: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS,
        "eos_token": EOT,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": context,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
    }, indent=2))


# -- model --------------------------------------------------------------------


def train_model(stream: list[int], recipe: Recipe, vocab_size: int, say: Callable[[str], None]):
    import torch
    import transformers

    torch.manual_seed(recipe.seed)
    bos_id, eos_id, eot_id = 0, 1, 4  # SPECIAL_TOKENS order
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.layers,
        num_attention_heads=recipe.heads,
        num_key_value_heads=recipe.kv_heads,
        max_position_embeddings=recipe.context,
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_id=[eos_id, eot_id],
    )
    model = transformers.LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    T = recipe.context
    data = torch.tensor(stream, dtype=torch.long)
    n_blocks = max(1, (len(data) - 1) // T)
    if len(data) < T + 1:
        data = data.repeat(T // max(1, len(data)) + 2)
    blocks = data[: n_blocks * T].view(n_blocks, T)
    generator = torch.Generator().manual_seed(recipe.seed)
    order = torch.randperm(n_blocks, generator=generator)
    epoch_tokens = n_blocks * T
    say(f"training a {recipe.layers}-layer Llama ({n_params / 1e6:.1f}M parameters) for {recipe.steps} steps "
        f"of {recipe.batch_size}x{T} tokens ({recipe.steps * recipe.batch_size * T / epoch_tokens:.1f} epochs)")
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=0.01, fused=True)

    def lr_at(step: int) -> float:
        if step < recipe.warmup:
            return recipe.learning_rate * (step + 1) / recipe.warmup
        progress_ = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
        return recipe.learning_rate * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress_))))

    model.train()
    losses, cursor, t0 = [], 0, time.monotonic()
    report_every = max(1, recipe.steps // 10)
    for step in range(recipe.steps):
        rows = []
        for _ in range(recipe.batch_size):
            if cursor == n_blocks:
                order, cursor = torch.randperm(n_blocks, generator=generator), 0
            rows.append(order[cursor])
            cursor += 1
        batch = blocks[torch.stack(rows)]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % report_every == 0 or step + 1 == recipe.steps:
            elapsed = time.monotonic() - t0
            recent = losses[-report_every:]
            say(f"step {step + 1}/{recipe.steps}: loss {sum(recent) / len(recent):.2f} "
                f"({elapsed / (step + 1):.2f} s/step, {(recipe.steps - step - 1) * elapsed / (step + 1):.0f} s to go)")
    model.eval()
    return model, losses


if __name__ == "__main__":  # python -m llm_executorch_mlx.demo collect OUT [MODULE ...]
    if len(sys.argv) >= 3 and sys.argv[1] == "collect":
        _collect(sys.argv[2], sys.argv[3:])
    else:
        sys.exit("usage: python -m llm_executorch_mlx.demo collect OUT [MODULE ...]")
