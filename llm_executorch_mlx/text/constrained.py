"""Constrained decoding: a JSON schema and a tokenizer to the tokens each step may take.

llguidance compiles the schema to a grammar and, from the tokens so far,
computes which next tokens keep the output a prefix of a valid document (a
bitmask over the vocabulary, a few microseconds a step). Its token table is
built once per tokenizer: from the tokenizer.json itself, from tiktoken's
ranks, or from sentencepiece's pieces as bytes.

A forced tool call (``-o tool_choice``) is a Lark grammar of the template
family's call syntax around one ``%json`` sub-grammar per tool. A tag the
tokenizer holds as a special token (Qwen's ``<tool_call>``) is named by its
id (``<[id]>``): llguidance never lets text spell a special token, so a
quoted tag would be unreachable there; elsewhere the tag is plain text.

Documents are written compactly (one spelling of each separator, no free
whitespace) and objects take only the properties their schema names, unless
it says otherwise: a model cannot pad a document or grow it forever with
keys nobody asked for.
"""

from __future__ import annotations

import functools
import json

import llguidance
import mlx.core as mx
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
from llguidance.tiktoken import lltokenizer_from_encoding

from .errors import TextError

_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Keywords that already say what an object's other properties may be.
_OPEN_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema):
    """``schema`` with ``additionalProperties: false`` on every object schema
    that lists properties and says nothing about others. A document valid
    under the result is valid under ``schema``."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("enum", "const", "default", "examples") else closed_objects(v)) for k, v in schema.items()}
    if isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN_KEYWORDS):
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=8)
def token_table(tokenizer, n_vocab: int, end_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of ``tokenizer`` (the bytes of every token id below
    ``n_vocab``), ending documents with ``end_ids``; built once (~0.5 s for
    a 49k vocabulary)."""
    try:
        if tokenizer.kind == "huggingface":
            return llguidance.LLTokenizer(tokenizer.path.read_text(), n_vocab=n_vocab, eos_token=list(end_ids))
        if tokenizer.kind == "tiktoken":
            return lltokenizer_from_encoding(tokenizer.encoding, n_vocab=n_vocab, eos_token=list(end_ids))
        return llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_SentencePieceBytes(tokenizer.processor, end_ids)), n_vocab=n_vocab,
            eos_token=list(end_ids),
        )
    except Exception as e:  # llguidance says why (an unknown pre-tokenizer, a vocabulary it cannot read)
        raise TextError(f"schemas and forced tool calls cannot use the tokenizer {tokenizer.path}: "
                        f"llguidance cannot read it ({e})") from None


class _SentencePieceBytes:
    """A sentencepiece model as llguidance's TokenizerWrapper reads one: each
    piece's bytes ("▁" a space, "<0xNN>" its byte, control pieces empty)."""

    def __init__(self, sp, end_ids):
        self.eos_token_id = end_ids[0]
        self.bos_token_id = sp.bos_id() if sp.bos_id() >= 0 else None
        self.tokens, self.special_token_ids = [], []
        for i in range(sp.vocab_size()):
            piece = sp.id_to_piece(i)
            if sp.is_byte(i):
                self.tokens.append(bytes([int(piece[3:5], 16)]))
            elif sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
                self.tokens.append(b"")
                self.special_token_ids.append(i)
            else:
                self.tokens.append(piece.replace("\u2581", " ").encode("utf-8"))
        self._byte_ids = {self.tokens[i][0]: i for i in range(len(self.tokens)) if sp.is_byte(i)}

    def __call__(self, text: bytes) -> list[int]:
        # sentencepiece's own encode would add its dummy-prefix space; bytes alone spell any text
        return [self._byte_ids[b] for b in text]


def _schema_grammar(schema) -> str:
    if not isinstance(schema, dict):
        raise TextError(f"a schema must be a JSON object, got {type(schema).__name__}")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(closed_objects(schema), overrides=_JSON_OPTIONS)
    except ValueError as e:
        raise TextError(f"the schema is not usable: {e}") from None


def _lark_tag(tag: str, tokenizer, table) -> str:
    """``tag`` in Lark: its special token's id where the tokenizer has one, else its text."""
    ids = tokenizer.encode(tag)
    if len(ids) == 1 and table.is_special_token(ids[0]):
        return f"<[{ids[0]}]>"
    return json.dumps(tag)


def _call_grammar(fmt, tools, tokenizer, table) -> str:
    """One call of one of ``tools`` in ``fmt``'s syntax (tool_calls.ToolFormat)."""
    calls = []
    for tool in tools:
        schema = fmt.call_schema(tool["function"]["name"], tool["function"]["parameters"])
        calls.append("%json " + json.dumps({**closed_objects(schema), "x-guidance": _JSON_OPTIONS}))
    rules = [f"call: {' | '.join(f'call_{i}' for i in range(len(calls)))}"]
    rules += [f"call_{i}: {c}" for i, c in enumerate(calls)]
    if fmt.opening is None:
        start = "start: call"
    else:
        opening, closing = (_lark_tag(tag, tokenizer, table) for tag in (fmt.opening, fmt.closing))
        start = f'start: {opening} "\\n" call "\\n" {closing}'
    try:
        return llguidance.LLMatcher.grammar_from_lark("\n".join([start, *rules]))
    except ValueError as e:
        raise TextError(f"the tools' schemas cannot force a call: {e}") from None


class Constraint:
    """What the reply may still become (a schema's document, or a forced tool
    call): a mask over the next token's logits.

    ``advance(token)`` after each token is read on the host, ``apply(logits)``
    before the next one is sampled: the mask goes to the device as a plain
    array, so it adds no device sync to the step.
    """

    def __init__(self, schema: dict | None, tokenizer, n_vocab: int, end_ids, call=None):
        """``n_vocab``: the model's logits width (at least the tokenizer's);
        ``end_ids``: the stop tokens a finished document may end with;
        ``call``: (ToolFormat, tool definitions) to force one call of one of
        them instead of a schema's document."""
        n_vocab = max(n_vocab, tokenizer.vocab_size)
        self.end_ids = tuple(sorted(end_ids))
        self.what = "the schema" if call is None else "a call of the tools offered"
        if not self.end_ids:
            raise TextError("constrained replies need a stop token to end them: the tokenizer and model name none")
        self.tokenizer = tokenizer
        table = token_table(tokenizer, n_vocab, self.end_ids)
        grammar = _schema_grammar(schema) if call is None else _call_grammar(*call, tokenizer, table)
        problem = llguidance.LLMatcher.validate_grammar(grammar, table)
        if problem:
            usable = "the schema is not usable" if call is None else "the tools' schemas cannot force a call"
            raise TextError(f"{usable}: {problem.splitlines()[0]}")
        self._matcher = llguidance.LLMatcher(table, grammar, log_level=0)
        self._bits = allocate_token_bitmask(1, n_vocab)
        self._ids: list[int] = []
        self.n_vocab = n_vocab
        self._allowed()  # a schema this tokenizer cannot start is refused before any step runs

    @property
    def complete(self) -> bool:
        """Whether the tokens so far form a whole document (or call)."""
        return self._matcher.is_accepting()

    def advance(self, token: int) -> None:
        """Take the token the model produced (one the last mask allowed)."""
        if not self._matcher.consume_token(token):
            # llguidance's mask lets a token through where no token can spell the bytes the schema forces
            raise self._cannot_write()
        self._ids.append(token)

    def apply(self, logits: mx.array) -> mx.array:
        """``logits`` [vocab] with every token the schema does not allow next at -inf (lazy)."""
        allowed = self._allowed()
        n = logits.shape[-1]
        if n != self.n_vocab:
            allowed = np.pad(allowed, (0, max(0, n - self.n_vocab)))[:n]
        return mx.where(mx.array(allowed), logits, -mx.inf)

    def _allowed(self) -> np.ndarray:
        if self._matcher.is_stopped():  # a whole document that cannot grow: only an end
            allowed = np.zeros(self.n_vocab, dtype=bool)
            allowed[list(self.end_ids)] = True
            return allowed
        fill_next_token_bitmask(self._matcher, self._bits)
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.n_vocab].view(bool)
        if self._matcher.is_error() or not allowed.any():
            raise self._cannot_write()
        return allowed

    def _cannot_write(self) -> TextError:
        written = self.tokenizer.decode(self._ids)
        return TextError(
            f"no token of the tokenizer {self.tokenizer.path.name} can continue the JSON "
            f"{json.dumps(written)} as {self.what} requires: this tokenizer cannot write "
            + ("that schema" if self.what == "the schema" else "such a call")
        )
