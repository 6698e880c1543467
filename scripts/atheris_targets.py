"""Coverage-guided fuzz targets (atheris), one per reader of untrusted bytes.

    python scripts/atheris_targets.py TARGET [libFuzzer flags] [corpus dirs]

TARGET is one of:

- ``pte``: the container reader (``PteFile``) and the MLX graph reader
  (``decode_graph``, with its checks); the first byte picks which.
- ``metadata``: ``read_metadata`` on constant-method values and a forward
  signature built from the bytes (ints of every width, bools, strings,
  floats, lists, None), as a corrupt file's EValues would give it.
- ``tokenizer``: ``load_tokenizer`` and ``resolve_template`` on a
  tokenizer.json, tiktoken or sentencepiece file, a tokenizer_config.json
  beside a good tokenizer, or a chat template, then encoding, decoding and
  rendering one turn; the first byte picks which.

Anything but ``PteError`` (pte, metadata) or ``TextError`` (tokenizer) is
a finding: atheris prints its traceback and stops. ``scripts/fuzz_pte.py
--atheris-runs N`` seeds and runs all three.
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile

import atheris

with atheris.instrument_imports():
    from llm_executorch_mlx.runtime.errors import PteError
    from llm_executorch_mlx.runtime.pte.container import PteFile
    from llm_executorch_mlx.runtime.pte.graph import decode_graph
    from llm_executorch_mlx.runtime.pte.metadata import ForwardSignature, read_metadata
    from llm_executorch_mlx.text import TextError, load_tokenizer, resolve_template

WORK = pathlib.Path(tempfile.mkdtemp(prefix="atheris-"))


def pte(data: bytes) -> None:
    kind, body = (data[0] % 2, data[1:]) if data else (0, b"")
    try:
        if kind == 0:
            path = WORK / "model.pte"
            path.write_bytes(body)
            PteFile(path).close()
        else:
            decode_graph(body)
    except PteError:
        pass


# The names read_metadata reads, both vocabularies (and one it does not).
METADATA_NAMES = (
    "get_max_ctx_len", "get_max_context_len", "get_max_seq_len", "get_prefill_chunk_size",
    "get_vocab_size", "get_bos_id", "get_eos_ids", "get_eos_id", "use_kv_cache", "enable_dynamic_shape",
    "get_n_caches", "get_kv_heads", "get_head_dims", "get_windows", "get_activation_dtype",
    "get_logits_to_keep_mode", "get_something_else",
)
DTYPE_NAMES = ("fp32", "fp16", "bf16", "uint16", "int64", "bool", "")


def _value(fdp: atheris.FuzzedDataProvider, depth: int = 0):
    kind = fdp.ConsumeIntInRange(0, 7 if depth == 0 else 5)
    if kind == 0:
        return fdp.ConsumeIntInRange(-2, 70000)
    if kind == 1:
        return fdp.ConsumeInt(fdp.ConsumeIntInRange(1, 9))  # up to 72-bit, signed
    if kind == 2:
        return fdp.ConsumeBool()
    if kind == 3:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 12))
    if kind == 4:
        return fdp.ConsumeRegularFloat()
    if kind == 5:
        return None
    return [_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 6 if kind == 6 else 300))]


def metadata(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    raw = {name: _value(fdp) for name in METADATA_NAMES if fdp.ConsumeBool()}
    forward = None
    if fdp.ConsumeBool():
        bound = fdp.ConsumeIntInRange(-1, 4096)
        forward = ForwardSignature(
            n_inputs=fdp.ConsumeIntInRange(0, 4),
            token_bound=None if bound < 0 else bound,
            logits_shape=tuple(fdp.ConsumeIntInRange(-1, 70000) for _ in range(fdp.ConsumeIntInRange(0, 4))),
            logits_dtype=fdp.PickValueInList(list(DTYPE_NAMES)),
            graph_dtype=fdp.PickValueInList([*DTYPE_NAMES, None]),
        )
    try:
        read_metadata(raw, forward).as_dict()
    except PteError:
        pass


GOOD_TOKENIZER = WORK / "good" / "tokenizer.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "template")  # .model: tiktoken or sentencepiece


def tokenizer(data: bytes) -> None:
    kind, body = (data[0] % len(TOKENIZER_FILES), data[1:]) if data else (0, b"")
    name = TOKENIZER_FILES[kind]
    directory = WORK / "case"
    directory.mkdir(exist_ok=True)
    for old in directory.iterdir():
        old.unlink()
    if name in ("tokenizer_config.json", "template"):
        (directory / "tokenizer.json").write_bytes(GOOD_TOKENIZER.read_bytes())
        config = body if name == "tokenizer_config.json" else _config_with_template(body)
        (directory / "tokenizer_config.json").write_bytes(config)
        path = directory / "tokenizer.json"
    else:
        path = directory / name
        path.write_bytes(body)
    try:
        tok = load_tokenizer(path)
        tok.decode(tok.encode("Hello there <|eot_id|>"))
        resolve_template("auto", tok).render([{"role": "user", "content": "hi"}])
    except TextError:
        pass


def _config_with_template(body: bytes) -> bytes:
    import json

    return json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                       "chat_template": body.decode("utf-8", "replace")}).encode()


TARGETS = {"pte": pte, "metadata": metadata, "tokenizer": tokenizer}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(TARGETS)}}} [libFuzzer flags] [corpus dirs]")
    target = TARGETS[sys.argv.pop(1)]
    if target is tokenizer:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
        from models import make_tokenizer

        make_tokenizer(GOOD_TOKENIZER.parent)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    atheris.Setup(sys.argv, target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
