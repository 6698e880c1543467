"""Registered models: a small JSON file under ``llm.user_dir()``.

Written atomically (a temp file renamed over the old one), so a crash or a
refused registration leaves the previous file intact, and changed only
inside ``editing()``, which holds an exclusive lock on a file beside it from
the read to the write, so two commands at once cannot lose each other's
entries. Reading never fails the caller: ``llm models`` must work even when
the file or a model is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Iterator

try:
    import fcntl
except ImportError:  # not POSIX: no lock (MLX runs on Linux and macOS)
    fcntl = None

import llm

FILENAME = "executorch-mlx.json"
MODEL_PREFIX = "pte:"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # a model's name or alias


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


class RegistryError(Exception):
    """The registry file exists but cannot be read safely."""


def load_entries(strict: bool = False) -> dict[str, Entry]:
    """Registered models by name.

    Lenient (for ``llm models``): a missing or unreadable file reads as empty
    and a damaged entry is skipped. Strict (before writing): a file that
    cannot be read in full raises ``RegistryError``, so nothing is lost by
    writing it back.
    """
    path = registry_path()
    try:
        data = json.loads(path.read_text())
        models = data["models"]
        if not isinstance(models, dict):
            raise TypeError("'models' is not an object")
    except FileNotFoundError:
        return {}
    except OSError as e:
        if strict:
            raise RegistryError(f"cannot read {path}: {e.strerror}") from None
        return {}
    except (ValueError, TypeError, KeyError) as e:
        if strict:
            raise RegistryError(f"{path} is damaged ({e}): fix or delete it") from None
        return {}
    entries = {}
    for name, fields in models.items():
        try:
            entries[name] = _entry(name, fields)
        except TypeError as e:
            if strict:
                raise RegistryError(f"{path}: entry {name!r} is damaged ({e}): fix or delete it") from None
    return entries


# What each field of a saved entry must be (the file is the user's to edit).
_FIELD_TYPES = {"path": str, "tokenizer": str, "chat": str, "aliases": list, "summary": dict}


def _entry(name: str, fields) -> Entry:
    if not isinstance(fields, dict):
        raise TypeError(f"it is {type(fields).__name__}, not an object")
    for key, value in fields.items():
        kind = _FIELD_TYPES.get(key)
        if kind is not None and not isinstance(value, kind):
            raise TypeError(f"its {key} is {value!r}, not {kind.__name__}")
    if not all(isinstance(a, str) for a in fields.get("aliases", [])):
        raise TypeError("its aliases are not all names")
    return Entry(name=name, **fields)


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


@contextlib.contextmanager
def editing() -> Iterator[dict[str, Entry]]:
    """The registry read in full (strictly, see ``load_entries``) under an
    exclusive lock; what the caller leaves in it is saved on a normal exit."""
    path = registry_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "a")
    except OSError as e:
        raise RegistryError(f"cannot write the registry {path}: {e.strerror} ({e.filename})") from None
    with lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        entries = load_entries(strict=True)
        yield entries
        try:
            save_entries(entries)
        except OSError as e:
            raise RegistryError(f"cannot write the registry {path}: {e.strerror}") from None


def find_entry(name_or_alias: str) -> Entry | None:
    name = name_or_alias.removeprefix(MODEL_PREFIX)
    entries = load_entries()
    if name in entries:
        return entries[name]
    for e in entries.values():
        if name_or_alias in e.aliases or name in e.aliases:
            return e
    return None


def layers_text(windows: list[int]) -> str:
    """A model's cache layers in a few words: '30 layers: 30 flat'."""
    flat = sum(1 for w in windows if w == 0)
    rings: dict[int, int] = {}
    for w in windows:
        if w:
            rings[w] = rings.get(w, 0) + 1
    parts = [f"{flat} flat"] + [f"{n} ring(window {w})" for w, n in sorted(rings.items())]
    return f"{len(windows)} layers: " + " + ".join(parts)
