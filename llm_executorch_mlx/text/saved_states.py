"""Cache states saved on disk, so that a new process starts warm.

After a turn, the session's cache (the exact ids it holds and every layer's
K/V as stored, a quantized history as its three arrays) is saved as one safetensors file; a later process
whose prompt shares a prefix with a state of the same model file and cache
policy loads the longest usable one and prefills only the rest. The format
is in docs/design.md ("Saved cache states").

A state is written to a temp file and renamed, so a reader sees a whole
state or none, and it carries a checksum of its header and arrays, so a
damaged, truncated or foreign file is noticed, deleted and never used; a
Ctrl-C while it is written removes the temp file. The directory is kept
under a byte budget, the least recently used (saved or loaded) states
deleted first. Importing this is cheap: mlx only in load/save.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from .session import common_prefix

FORMAT = 1
SUFFIX = ".safetensors"
SAMPLE_BYTES = 1 << 20  # the model file's content hash reads this much at each end
MAX_HEADER_BYTES = 64 << 20
STALE_TEMP_SECONDS = 3600  # a temp file this old was left by a killed process
LOAD_GAIN = 16  # a state must give a 1/LOAD_GAIN of its length more than a live session (worth_loading)


class StateError(Exception):
    """A state file that cannot be used (damaged, truncated or foreign)."""


class StateDirError(Exception):
    """The states directory cannot be listed or written; the message names it and the fix."""


# what a file another process changed or deleted meanwhile raises: pruning skips it
_RACES = (OSError, StateError, KeyError, TypeError, ValueError)


_identities: dict = {}


def model_identity(path: str) -> dict:
    """What a state's model file must still be: path, size, mtime and a cheap
    content hash (the first and last MiB)."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    if key not in _identities:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            h.update(f.read(SAMPLE_BYTES))
            if st.st_size > SAMPLE_BYTES:
                f.seek(max(SAMPLE_BYTES, st.st_size - SAMPLE_BYTES))
                h.update(f.read())
        _identities[key] = {"path": key[0], "size": key[1], "mtime_ns": key[2], "sample_sha256": h.hexdigest()}
    return _identities[key]


@dataclass
class SavedState:
    path: pathlib.Path
    size: int  # bytes on disk
    used: float  # last saved or loaded (the file's mtime)
    header: dict

    @property
    def ids(self) -> list[int]:
        return self.header["ids"]

    @property
    def floor(self) -> int:
        """The shortest prefix of ``ids`` it can give (ring layers keep only their window)."""
        return self.header["floor"]

    @property
    def replies(self) -> list:
        """[text, ids] of the replies generated in it, to splice as ids again."""
        return self.header.get("replies", [])

    @property
    def cut(self) -> tuple[int, str] | None:
        """The truncation cut its prompt was made with (text/truncation.py), if any."""
        cut = self.header.get("cut")
        if isinstance(cut, list) and len(cut) == 2 and type(cut[0]) is int and isinstance(cut[1], str):
            return cut[0], cut[1]
        return None

    def usable(self, prompt: list[int]) -> int:
        """How many of ``prompt``'s ids this state can give (0: none). One
        prompt id is always left to feed, for the next token's logits."""
        n = min(common_prefix(self.ids, prompt), len(prompt) - 1)
        return n if n > 0 and n >= self.floor else 0


def _field_name(history: str, j: int) -> str:
    """A history's j-th array in the file: ``k.3`` for a float one (one
    array), ``k.3.0``... ``k.3.2`` for a quantized one (``QuantizedKV``'s)."""
    return history if j == 0 else f"{history}.{j}"


def _fields(arrays: dict, history: str) -> list:
    fields = [arrays[history]]
    while _field_name(history, len(fields)) in arrays:
        fields.append(arrays[_field_name(history, len(fields))])
    return fields


def worth_loading(n: int, held: int) -> bool:
    """Whether a state giving ``n`` ids beats a live session holding ``held``.

    Reading a state costs well under a twentieth of prefilling its tokens
    here, plus a new session; and a live session always lacks its last
    reply's final token (generated, never fed), which a state saved from a
    longer reply to the same prompt holds. So a state wins only by more than
    a sixteenth of its length: a few tokens more are prefilled instead.
    """
    return n > held + n // LOAD_GAIN


def _read_header(path: pathlib.Path) -> dict:
    """The state header of a safetensors file, read without its arrays."""
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= MAX_HEADER_BYTES:
            raise StateError("not a safetensors file")
        raw = f.read(n)
    try:
        header = json.loads(json.loads(raw)["__metadata__"]["state"])
        if header["format"] != FORMAT:
            raise StateError(f"format {header['format']!r}, this version reads {FORMAT}")
        if header["header_sha256"] != _header_checksum(header):
            raise StateError("its header's checksum does not match it")
        ids, floor = header["ids"], header["floor"]
        if not (isinstance(ids, list) and ids and all(type(i) is int for i in ids)
                and type(floor) is int and 0 <= floor <= len(ids)):
            raise StateError("its ids or floor are malformed")
    except (ValueError, KeyError, TypeError) as e:
        raise StateError(f"its header is malformed ({type(e).__name__})") from None
    return header


def _header_checksum(header: dict) -> str:
    """sha256 of the header less its checksums: what listing a state checks
    before using its ids and replies, without reading its arrays."""
    rest = {k: v for k, v in header.items() if k not in ("checksum", "header_sha256")}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def _checksum(header: dict, arrays: dict) -> str:
    """CRC-32 over the header's checksum and the arrays' bytes, by name: it
    catches a damaged or truncated file, at ~3x the speed of sha256 here."""
    import mlx.core as mx

    crc = zlib.crc32(_header_checksum(header).encode())
    for name in sorted(arrays):
        crc = zlib.crc32(memoryview(arrays[name].view(mx.uint8)), zlib.crc32(name.encode(), crc))
    return f"crc32:{crc:08x}"


class StateStore:
    """The saved states in one directory.

    Args:
        budget: most bytes the directory may hold; 0 turns saving off.
        notice: says a one-line note (a damaged file that was deleted).
    """

    def __init__(self, directory, budget: int, notice: Callable[[str], None]):
        self.directory = pathlib.Path(directory)
        self.budget = budget
        self.notice = notice

    @staticmethod
    def key(identity: dict, policy: dict) -> str:
        """What a file name starts with: its model identity and cache policy, hashed."""
        text = json.dumps({"model": identity, "policy": policy}, sort_keys=True)
        return hashlib.sha1(text.encode()).hexdigest()[:16]

    def _entries(self) -> list[pathlib.Path]:
        """Every entry of the directory (none when it does not exist yet).

        Raises:
            StateDirError: the path is a file, a link to nothing, or cannot be read.
        """
        try:
            return [self.directory / name for name in os.listdir(self.directory)]
        except FileNotFoundError:
            if self.directory.is_symlink():
                raise StateDirError(f"{self.directory} is a link to {os.readlink(self.directory)}, which does not "
                                    f"exist: create that directory or delete the link") from None
            return []
        except OSError as e:
            if self.directory.is_file():
                raise StateDirError(f"{self.directory} is a file, not the directory of saved cache states: "
                                    f"move or delete it") from None
            raise StateDirError(f"cannot read the saved cache states in {self.directory} "
                                f"({e.strerror or type(e).__name__}): fix or delete that path") from None

    def _files(self, pattern: str = "*" + SUFFIX, strict: bool = False) -> list[pathlib.Path]:
        """The states matching ``pattern`` (temp files never match). A
        directory that cannot be read holds none, unless ``strict`` (then
        StateDirError): a turn goes on cold, and its save says why."""
        try:
            entries = self._entries()
        except StateDirError:
            if strict:
                raise
            return []
        return [p for p in entries if p.match(pattern) and not p.name.startswith(".")]

    def _damaged(self, path: pathlib.Path, why: str, inode: int | None = None) -> None:
        """Note and delete a damaged state, unless it was replaced meanwhile."""
        done = "deleted it"
        try:
            if inode is None or os.stat(path).st_ino == inode:
                path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:  # a directory under a state's name, say
            done = f"could not delete it ({e.strerror or type(e).__name__}): delete it by hand"
        self.notice(f"[pte] ignored the saved cache state {path.name}: {why}; {done}")

    def _state(self, path: pathlib.Path) -> SavedState | None:
        try:
            st = os.stat(path)
            return SavedState(path, st.st_size, st.st_mtime, _read_header(path))
        except FileNotFoundError:
            return None  # deleted by another process meanwhile
        except StateError as e:
            self._damaged(path, str(e))
        except OSError as e:
            self._damaged(path, f"unreadable ({e.strerror or type(e).__name__})")
        return None

    def states(self, identity: dict, policy: dict) -> list[SavedState]:
        """The states of this model file and policy, most recently used first."""
        found = []
        for path in self._files(self.key(identity, policy) + "-*" + SUFFIX):
            state = self._state(path)
            if state is None:
                continue
            if state.header.get("model") != identity or state.header.get("policy") != policy:
                self._damaged(path, "it belongs to another model or cache policy than its name says")
                continue
            found.append(state)
        return sorted(found, key=lambda s: s.used, reverse=True)

    def all(self) -> list[SavedState]:
        """Every readable state, most recently used first (damaged ones noted and deleted).

        Raises:
            StateDirError: the directory cannot be read.
        """
        found = [s for s in map(self._state, self._files(strict=True)) if s is not None]
        return sorted(found, key=lambda s: s.used, reverse=True)

    def load(self, state: SavedState, n: int, cache) -> bool | None:
        """Restore the first ``n`` ids of ``state`` into ``cache``: True; False
        (the file noted and deleted) when it turns out damaged; None when
        another process deleted or replaced it meanwhile."""
        import mlx.core as mx

        try:
            f = open(state.path, "rb")
        except OSError:
            return None  # deleted by another process meanwhile
        inode = os.fstat(f.fileno()).st_ino
        try:
            with f:
                arrays, meta = mx.load(f, format="safetensors", return_metadata=True)
                mx.eval(list(arrays.values()))
            header = json.loads(meta["state"])
            if header.get("checksum") != _checksum(header, arrays):
                raise StateError("its checksum does not match its contents")
            if header["ids"][:n] != state.ids[:n] or n < header["floor"]:
                return None  # replaced by another process with a state that no longer fits
            layers = [(first, _fields(arrays, f"k.{i}"), _fields(arrays, f"v.{i}"))
                      for i, first in enumerate(header["layers"])]
            cache.restore(n, header["floor"], layers)
            mx.eval(cache.state)
        except Exception as e:  # mlx's reader raises RuntimeError/ValueError, restore PteError
            cache.clear()
            self._damaged(state.path, str(e) if isinstance(e, StateError) else f"unreadable ({type(e).__name__})",
                          inode)
            return False
        try:
            os.utime(state.path)  # recently used: evicted last
        except OSError:
            pass
        return True

    def save(self, identity: dict, policy: dict, cache, ids: list[int], replies: list,
             cut: tuple[int, str] | None = None) -> pathlib.Path | None:
        """Save ``cache`` (holding ``ids``; its prompt made with the truncation
        ``cut``) atomically; drop the states it supersedes and the least
        recently used ones past the budget. None when it does not fit the
        budget.

        Raises:
            StateDirError: the directory cannot be read (``OSError``: nor written).
        """
        import mlx.core as mx

        if not ids or cache.length != len(ids):
            return None
        from ..runtime.kv_storage import fields_of

        floor, layers = cache.snapshot()
        arrays = {}
        for i, (_, K, V) in enumerate(layers):
            for name, history in ((f"k.{i}", K), (f"v.{i}", V)):
                for j, field in enumerate(fields_of(history)):
                    arrays[_field_name(name, j)] = mx.contiguous(field)
        if sum(a.nbytes for a in arrays.values()) > self.budget:
            return None
        mx.eval(list(arrays.values()))
        header = {"format": FORMAT, "model": identity, "policy": policy, "ids": list(ids), "floor": floor,
                  "layers": [first for first, _, _ in layers], "replies": replies}
        if cut is not None:
            header["cut"] = list(cut)
        header["header_sha256"] = _header_checksum(header)
        header["checksum"] = _checksum(header, arrays)
        key = self.key(identity, policy)
        path = self.directory / f"{key}-{hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:16]}{SUFFIX}"
        self._entries()  # a path that cannot hold states is our StateDirError, not mkdir's OSError
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                mx.save_safetensors(f, arrays, metadata={"state": json.dumps(header)})
            os.replace(tmp, path)
        except BaseException:  # a Ctrl-C too: no temp file is left behind
            with contextlib.suppress(*_RACES):
                os.unlink(tmp)
            raise
        self._prune(identity, policy, path, ids)
        return path

    def _prune(self, identity: dict, policy: dict, kept: pathlib.Path, ids: list[int]) -> None:
        key = self.key(identity, policy)
        files = []
        for path in self._files():
            if path == kept:
                continue
            if path.name.startswith(key + "-"):
                # a state the new one extends is superseded: the next turn
                # continues the new one (only going back to an older turn of
                # a model with ring layers could have used the older state)
                with contextlib.suppress(*_RACES):
                    old = _read_header(path)["ids"]
                    if len(old) < len(ids) and ids[: len(old)] == old:
                        path.unlink()
                        continue
            else:
                with contextlib.suppress(*_RACES):
                    model = _read_header(path).get("model", {})
                    if model.get("path") == identity["path"] and model != identity:
                        path.unlink()  # its model file changed: never usable again
                        continue
            with contextlib.suppress(*_RACES):
                st = os.stat(path)
                files.append((st.st_mtime, st.st_size, path))
        with contextlib.suppress(*_RACES):
            total = os.stat(kept).st_size + sum(size for _, size, _ in files)
            for _, size, path in sorted(files):
                if total <= self.budget:
                    break
                with contextlib.suppress(*_RACES):
                    path.unlink()
                total -= size
        now = time.time()
        for tmp in self.directory.glob(".*.tmp"):
            with contextlib.suppress(*_RACES):
                if now - os.stat(tmp).st_mtime > STALE_TEMP_SECONDS:
                    tmp.unlink()

    def clear(self) -> tuple[int, int]:
        """Delete every state; (files, bytes) deleted.

        Raises:
            StateDirError: the directory cannot be read.
        """
        count = size = 0
        for path in self._files(strict=True) + [p for p in self._entries() if p.match(".*.tmp")]:
            with contextlib.suppress(*_RACES):
                n = os.stat(path).st_size
                path.unlink()
                count, size = count + 1, size + n
        return count, size
