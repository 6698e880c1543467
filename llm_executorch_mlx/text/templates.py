"""Chat templates: the tokenizer's own (jinja), the seed runner's built-ins, or none."""

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..options import OPTIONS
from .errors import TextError
from .tokenizer import Tokenizer

TEMPLATE_NAMES = OPTIONS["chat"].choices  # "auto", the built-ins below, "none"
# Tokens that close an assistant turn, most specific first, looked for in a jinja template.
_TURN_ENDS = ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<turn|>", "<|end|>")


class ChatTemplate:
    """Turns a conversation into prompt text.

    ``name``: the template used ("auto" for the tokenizer's own). ``turn_end``:
    the token text that closes an assistant turn, or None. ``is_raw``: True for
    "none", where the prompt is passed through as plain text.
    """

    name: str
    turn_end: str | None = None
    is_raw: bool = False

    def render(self, messages: Sequence[Mapping], add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` (dicts with "role" and "content"),
        ending with the assistant's opening when ``add_generation_prompt``."""
        raise NotImplementedError


class _Raw(ChatTemplate):
    name = "none"
    is_raw = True

    def render(self, messages, add_generation_prompt=True):
        raise TextError("the 'none' chat template does not render conversations")


@dataclass(frozen=True)
class _Format:
    """A built-in template: exact strings of the seed runner's ``wrap_turn``."""

    bos: str
    turn: str  # one message, from "{role}" and "{content}"
    opening: str  # the assistant turn the model completes
    roles: Mapping[str, str]  # message role -> role written; absent: merged into next user turn
    turn_end: str


_BUILTINS = {
    "llama3": _Format(
        bos="<|begin_of_text|>",
        turn="<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>",
        opening="<|start_header_id|>assistant<|end_header_id|>\n\n",
        roles={"system": "system", "user": "user", "assistant": "assistant"},
        turn_end="<|eot_id|>",
    ),
    # Gemma has no system turn: system text opens the next user turn, as its own template does.
    "gemma": _Format(
        bos="<bos>",
        turn="<start_of_turn>{role}\n{content}<end_of_turn>\n",
        opening="<start_of_turn>model\n",
        roles={"user": "user", "assistant": "model"},
        turn_end="<end_of_turn>",
    ),
    "gemma4": _Format(
        bos="<bos>",
        turn="<|turn>{role}\n{content}<turn|>\n",
        opening="<|turn>model\n",
        roles={"system": "system", "user": "user", "assistant": "model"},
        turn_end="<turn|>",
    ),
}
# The tokens whose presence in a vocabulary marks each built-in's model family.
_MARKERS = {
    "llama3": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "gemma4": ("<|turn>", "<turn|>"),
    "gemma": ("<start_of_turn>", "<end_of_turn>"),
}


class _Builtin(ChatTemplate):
    def __init__(self, name: str):
        self.name = name
        self._format = _BUILTINS[name]
        self.turn_end = self._format.turn_end

    def render(self, messages, add_generation_prompt=True):
        fmt = self._format
        parts = [fmt.bos]
        pending = []  # system texts waiting for the next user turn
        for message in messages:
            role, content = _role_and_content(message, self.name)
            if role not in fmt.roles:
                pending.append(content)
                continue
            if role == "user":
                content, pending = "\n\n".join([*pending, content]), []
            parts.append(fmt.turn.format(role=fmt.roles[role], content=content))
        if pending:
            parts.append(fmt.turn.format(role="user", content="\n\n".join(pending)))
        if add_generation_prompt:
            parts.append(fmt.opening)
        return "".join(parts)


def _role_and_content(message: Mapping, template: str) -> tuple[str, str]:
    role, content = message.get("role"), message.get("content")
    if role not in ("system", "user", "assistant"):
        raise TextError(
            f"chat template '{template}' has no role {role!r}: use system, user or assistant"
        )
    if not isinstance(content, str):
        raise TextError(
            f"chat template '{template}' needs text content, got {type(content).__name__}"
        )
    return role, content


class _Jinja(ChatTemplate):
    """The tokenizer's own template, rendered as transformers' apply_chat_template does."""

    name = "auto"

    def __init__(self, source: str, tokenizer: Tokenizer):
        try:
            self._template = _compiled(source)
        except jinja2.TemplateSyntaxError as e:
            raise TextError(
                f"the chat template of {tokenizer.path} does not parse (line {e.lineno}): {e}"
            ) from e
        specials = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}
        self._specials = {key: value for key, value in specials.items() if value is not None}
        self.turn_end = next((t for t in _TURN_ENDS if t in source), None)
        if self.turn_end is None and "eos_token" in source:
            self.turn_end = tokenizer.eos_token

    def render(self, messages, add_generation_prompt=True):
        # As transformers does: plain dicts, and a None-valued key counts as absent.
        messages = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        try:
            return self._template.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._specials,
            )
        # A template is a program: it can fail with any Python error, not only jinja's.
        except Exception as e:
            raise TextError(f"chat template: {e}") from e


class _GenerationTag(Extension):
    """Accepts transformers' {% generation %} block (it marks assistant text); renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


class _Namespace(jinja2.utils.Namespace):
    """A namespace() that refuses underscore names, as transformers' sandbox does."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with '_'")


def _environment() -> ImmutableSandboxedEnvironment:
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = _Namespace
    return env


@functools.lru_cache(maxsize=16)
def _compiled(source: str) -> jinja2.Template:
    """A template's source compiled once per process (~10 ms each turn otherwise)."""
    return _environment().from_string(source)


def resolve_template(name: str, tokenizer: Tokenizer) -> ChatTemplate:
    """The chat template called ``name``: one of ``TEMPLATE_NAMES``, or an alias
    of one ("0" for "none"), in any case.

    "auto" is the tokenizer's own chat template; a tokenizer without one gets the
    built-in whose turn tokens its vocabulary has, else "none".
    """
    key = name.strip().lower()
    key = OPTIONS["chat"].aliases.get(key, key)
    if key == "none":
        return _Raw()
    if key in _BUILTINS:
        return _Builtin(key)
    if key != "auto":
        *others, last = TEMPLATE_NAMES
        raise TextError(f"unknown chat template '{name}': use {', '.join(others)} or {last}")
    if tokenizer.chat_template is not None:
        return _Jinja(tokenizer.chat_template, tokenizer)
    for builtin, markers in _MARKERS.items():
        if all(tokenizer.token_to_id(m) is not None for m in markers):
            return _Builtin(builtin)
    return _Raw()
