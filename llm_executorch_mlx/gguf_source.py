"""A GGUF file as an export source: dequantized into a Hugging Face directory.

transformers reads GGUF files itself (with the ``gguf`` package): the
tokenizer, its chat template and the weights, dequantized to float. It
refuses to ``save_pretrained`` such a model ("quantized with gguf and is not
serializable"), so the weights go into a plain model built from the same
config without its ``quantization_config``, which saves normally. The
exporter then reads that directory like any other.

Needs the ``export`` extra (torch, transformers, gguf, accelerate); imported
lazily.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import pathlib
import tempfile
from dataclasses import dataclass

# GGUF tensor types that store weights as they were trained (no dequantization).
FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}


@dataclass(frozen=True)
class GgufSummary:
    """What a GGUF file stores, read from its header."""

    path: pathlib.Path
    architecture: str
    name: str | None
    file_type: str | None  # llama.cpp's name for the whole file, e.g. MOSTLY_Q4_1
    tensor_types: dict[str, int]  # GGUF tensor type -> how many tensors

    @property
    def quantized_types(self) -> list[str]:
        return sorted(t for t in self.tensor_types if t not in FLOAT_TYPES)

    @property
    def storage(self) -> str:
        """e.g. 'Q4_1 (210 tensors), Q8_0 (1), F32 (61)'."""
        items = sorted(self.tensor_types.items(), key=lambda kv: -kv[1])
        return ", ".join(f"{t} ({n}{' tensors' if i == 0 else ''})" for i, (t, n) in enumerate(items))


class GgufError(Exception):
    """A GGUF file that cannot be read or converted; the message is one line."""


def is_gguf(path: str | os.PathLike) -> bool:
    p = pathlib.Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


def read_summary(path: str | os.PathLike) -> GgufSummary:
    import gguf

    path = pathlib.Path(path).expanduser().absolute()
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, KeyError, IndexError) as e:
        raise GgufError(f"{path} is not a readable GGUF file: {e}") from None

    def text(key: str) -> str | None:
        field = reader.fields.get(key)
        return None if field is None else str(field.contents())

    file_type = None
    field = reader.fields.get("general.file_type")
    if field is not None:
        try:
            file_type = gguf.LlamaFileType(int(field.contents())).name
        except ValueError:
            file_type = str(field.contents())
    types = collections.Counter(t.tensor_type.name for t in reader.tensors)
    return GgufSummary(path, text("general.architecture") or "?", text("general.name"), file_type, dict(types))


def convert_to_hf(path: str | os.PathLike, directory: str | os.PathLike) -> GgufSummary:
    """Write ``path``'s model, dequantized to fp32, and its tokenizer (with the
    chat template) into ``directory`` as a Hugging Face model directory."""
    import torch
    import transformers

    summary = read_summary(path)
    directory = pathlib.Path(directory)
    name = summary.path.name
    # transformers also reads tokenizer and config files beside the GGUF: give it the GGUF alone
    with tempfile.TemporaryDirectory(prefix="llm-pte-gguf-source-") as alone:
        os.symlink(summary.path, pathlib.Path(alone) / name)
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(alone, gguf_file=name)
            with contextlib.redirect_stderr(io.StringIO()):  # its per-tensor progress bar
                loaded = transformers.AutoModelForCausalLM.from_pretrained(alone, gguf_file=name, dtype=torch.float32)
        except (ValueError, KeyError, OSError, RuntimeError, NotImplementedError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise GgufError(
                f"transformers {transformers.__version__} cannot load {name} ({summary.architecture}): {first}"
            ) from None
    config = loaded.config
    del config.quantization_config  # what makes save_pretrained refuse
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=False, assign=True)
    model.tie_weights()
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta:
        raise GgufError(f"{summary.path.name} has no values for {', '.join(meta[:3])}: not a complete model")
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    _add_rope_theta(directory / "config.json")
    return summary


def _add_rope_theta(config_path: pathlib.Path) -> None:
    """transformers 5 writes ``rope_parameters`` only; older readers (mlx-lm,
    llama.cpp's converter) look for the top-level ``rope_theta``."""
    config = json.loads(config_path.read_text())
    theta = (config.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None and "rope_theta" not in config:
        config["rope_theta"] = theta
        config_path.write_text(json.dumps(config, indent=2) + "\n")
