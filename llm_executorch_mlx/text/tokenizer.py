"""Load a tokenizer file, whatever its format, behind one interface."""

import contextlib
import functools
import json
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path

import tokenizers

from .errors import TextError
from .sidecar import Sidecar, read_sidecar

# Looked for, in this order, when a directory is given instead of a file.
_FILE_NAMES = ("tokenizer.json", "tokenizer.model")
# A tiktoken file is lines of "<base64 token bytes> <rank>".
_TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+={0,2} \d+")


class Tokenizer(ABC):
    """A tokenizer with its special tokens and chat template.

    ``bos_token``/``eos_token`` and ``bos_id``/``eos_ids`` come from
    tokenizer_config.json, special_tokens_map.json and generation_config.json
    beside the file, else from the tokenizer model itself; ``chat_template`` from
    chat_template.jinja or tokenizer_config.json. Any of them may be None/empty.
    """

    kind: str

    def __init__(self, path: Path, sidecar: Sidecar):
        self.path = path
        self.chat_template = sidecar.chat_template
        native_bos, native_eos = self._native_specials()
        named_bos = self.token_to_id(sidecar.bos_token) if sidecar.bos_token else None
        bos_ids = (named_bos, sidecar.bos_token_id, native_bos)
        self.bos_id = next((i for i in bos_ids if i is not None), None)
        self.bos_token = sidecar.bos_token or self.id_to_token(self.bos_id)
        named_eos = self.token_to_id(sidecar.eos_token) if sidecar.eos_token else None
        eos_ids = [i for i in (named_eos, *sidecar.eos_token_ids) if i is not None]
        if not eos_ids and native_eos is not None:
            eos_ids = [native_eos]
        self.eos_ids = tuple(dict.fromkeys(eos_ids))
        self.eos_token = sidecar.eos_token or self.id_to_token(next(iter(self.eos_ids), None))

    @abstractmethod
    def encode(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids of ``text``, as the tokenizer encodes it (tokenizer.json and
        tiktoken turn special-token text into those tokens). ``add_special`` adds
        what the tokenizer adds around a sequence, e.g. BOS."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``, special tokens included; broken UTF-8 becomes U+FFFD."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """The number of token ids, added and special tokens included."""

    @abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """The id of the single token spelled ``token``, or None."""

    def id_to_token(self, token_id: int | None) -> str | None:
        """The spelling of token ``token_id`` in the vocabulary, or None."""
        if token_id is None or not 0 <= token_id < self.vocab_size:
            return None
        return self._spell(token_id)

    @functools.cached_property
    def vocabulary(self) -> tuple[str | None, ...]:
        """Every id's spelling, in id order: tokenizers with the same one give
        an id the same meaning (a draft model's must be its target's)."""
        return tuple(self._spell(i) for i in range(self.vocab_size))

    @abstractmethod
    def _spell(self, token_id: int) -> str | None:
        """id_to_token for an id within the vocabulary."""

    def _native_specials(self) -> tuple[int | None, int | None]:
        # BOS and EOS ids the model format itself records, used when no side file names them.
        return None, None


class _HuggingFace(Tokenizer):
    kind = "huggingface"

    def __init__(self, path: Path, sidecar: Sidecar, text: str):
        try:
            self._tok = tokenizers.Tokenizer.from_str(text)
        except Exception as e:
            raise TextError(f"{path} does not load as a tokenizer.json: {e}") from e
        super().__init__(path, sidecar)

    def encode(self, text, add_special=False):
        return self._tok.encode(text, add_special_tokens=add_special).ids

    def decode(self, ids):
        return self._tok.decode(list(ids), skip_special_tokens=False)

    @property
    def vocab_size(self):
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token):
        return self._tok.token_to_id(token)

    def _spell(self, token_id):
        return self._tok.id_to_token(token_id)


class _Tiktoken(Tokenizer):
    """A tiktoken file, with the Llama 3 special tokens and split pattern
    pytorch_tokenizers assumes for it (as ExecuTorch's runners do)."""

    kind = "tiktoken"

    def __init__(self, path: Path, sidecar: Sidecar):
        TiktokenTokenizer = _import_pytorch_tokenizers(path).TiktokenTokenizer
        try:
            self._tt = TiktokenTokenizer(model_path=str(path))
        except Exception as e:
            raise TextError(f"{path} looks like a tiktoken file but does not load: {e}") from e
        super().__init__(path, sidecar)

    def encode(self, text, add_special=False):
        # The C++ runners parse special-token text in prompts; tiktoken must be told to.
        return self._tt.encode(text, bos=add_special, eos=False, allowed_special="all")

    def decode(self, ids):
        return self._tt.decode(list(ids))

    @property
    def vocab_size(self):
        return self._tt.n_words

    def token_to_id(self, token):
        try:
            return self._tt.model.encode_single_token(token)
        except KeyError:
            return None

    def _spell(self, token_id):
        try:
            return self._tt.model.decode_single_token_bytes(token_id).decode("utf-8", "replace")
        except KeyError:
            return None

    def _native_specials(self):
        return self._tt.bos_id, self._tt.eos_id

    @property
    def encoding(self):
        """The ``tiktoken.Encoding`` (its ranks, special tokens and split pattern)."""
        return self._tt.model


class _SentencePiece(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, path: Path, sidecar: Sidecar):
        Llama2cTokenizer = _import_pytorch_tokenizers(path).Llama2cTokenizer
        try:
            # pytorch_tokenizers' Python sentencepiece loader; it keeps the processor.
            self._sp = Llama2cTokenizer(model_path=str(path)).sp_model
        except Exception as e:
            raise TextError(
                f"{path} is not a tokenizer: expected a tokenizer.json, "
                "a tiktoken file or a sentencepiece model"
            ) from e
        super().__init__(path, sidecar)

    def encode(self, text, add_special=False):
        ids = self._sp.encode(text)
        if add_special and self._sp.bos_id() >= 0:
            ids.insert(0, self._sp.bos_id())
        return ids

    def decode(self, ids):
        return self._sp.decode(list(ids))

    @property
    def vocab_size(self):
        return self._sp.vocab_size()

    def token_to_id(self, token):
        # piece_to_id answers unk for an unknown piece.
        token_id = self._sp.piece_to_id(token)
        return token_id if self._sp.id_to_piece(token_id) == token else None

    def _spell(self, token_id):
        return self._sp.id_to_piece(token_id)

    def _native_specials(self):
        bos, eos = self._sp.bos_id(), self._sp.eos_id()
        return (bos if bos >= 0 else None), (eos if eos >= 0 else None)

    @property
    def processor(self):
        """The ``sentencepiece.SentencePieceProcessor`` (its pieces and their kinds)."""
        return self._sp


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a HF tokenizer.json, a tiktoken file or a sentencepiece model, told
    apart by content; a directory means its tokenizer.json or tokenizer.model."""
    path = Path(path)
    if path.is_dir():
        found = next((path / n for n in _FILE_NAMES if (path / n).is_file()), None)
        if found is None:
            raise TextError(f"no {' or '.join(_FILE_NAMES)} in {path}")
        path = found
    if not path.is_file():
        raise TextError(f"tokenizer file not found: {path}")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TextError(f"cannot read tokenizer {path}: {e.strerror}") from e
    sidecar = read_sidecar(path.parent)
    if data.lstrip()[:1] == b"{":
        return _HuggingFace(path, sidecar, _tokenizer_json(path, data))
    if _TIKTOKEN_LINE.fullmatch(data.split(b"\n", 1)[0].rstrip(b"\r")):
        return _Tiktoken(path, sidecar)
    return _SentencePiece(path, sidecar)


def _tokenizer_json(path: Path, data: bytes) -> str:
    try:
        text = data.decode("utf-8")
        model = json.loads(text).get("model")
    except ValueError as e:
        raise TextError(f"{path} is not valid JSON: {e}") from e
    except AttributeError:
        model = None
    if not isinstance(model, dict):
        raise TextError(f"{path} is JSON but not a tokenizer.json: it has no 'model'")
    return text


def _import_pytorch_tokenizers(path: Path):
    # Its C++ extension logs a line to stderr on import; keep the CLI's stderr clean.
    try:
        with _quiet_stderr():
            import pytorch_tokenizers
    except ImportError as e:
        raise TextError(f"reading {path} needs pytorch_tokenizers: {e}") from e
    return pytorch_tokenizers


@contextlib.contextmanager
def _quiet_stderr():
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
