"""Registered models: a small JSON file under ``llm.user_dir()``.

Written atomically (a temp file renamed over the old one), so a crash or a
refused registration leaves the previous file intact. Reading never fails
the caller: ``llm models`` must work even when the file or a model is gone.
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
from dataclasses import asdict, dataclass, field

import llm

FILENAME = "executorch-mlx.json"
MODEL_PREFIX = "pte:"


@dataclass
class Entry:
    name: str
    path: str
    tokenizer: str
    chat: str = "auto"
    aliases: list[str] = field(default_factory=list)
    summary: dict = field(default_factory=dict)  # facts shown by `llm pte models`

    @property
    def model_id(self) -> str:
        return MODEL_PREFIX + self.name


def registry_path() -> pathlib.Path:
    return pathlib.Path(llm.user_dir()) / FILENAME


def load_entries() -> dict[str, Entry]:
    """Registered models by name; an unreadable file reads as empty."""
    try:
        data = json.loads(registry_path().read_text())
        return {name: Entry(name=name, **fields) for name, fields in data.get("models", {}).items()}
    except (OSError, ValueError, TypeError):
        return {}


def save_entries(entries: dict[str, Entry]) -> None:
    path = registry_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"models": {name: {k: v for k, v in asdict(e).items() if k != "name"} for name, e in entries.items()}}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".executorch-mlx-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def find_entry(name_or_alias: str) -> Entry | None:
    name = name_or_alias.removeprefix(MODEL_PREFIX)
    entries = load_entries()
    if name in entries:
        return entries[name]
    for e in entries.values():
        if name_or_alias in e.aliases or name in e.aliases:
            return e
    return None
