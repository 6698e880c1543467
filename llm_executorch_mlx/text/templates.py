"""Chat templates: the tokenizer's own (jinja), the seed runner's built-ins, or none."""

import copy
import functools
import json
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, optimizeconst
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

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
    source: str | None = None  # the jinja text of a tokenizer's own template

    def bound(self, **context) -> "ChatTemplate":
        """This template rendering with ``context`` too (``tools``, a switch such
        as ``enable_thinking``); only a tokenizer's own template takes any."""
        if context:
            raise TextError(f"chat template '{self.name}' takes no {', '.join(sorted(context))}")
        return self

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
        except RecursionError:  # jinja's parser recurses once per nested expression
            raise TextError(f"the chat template of {tokenizer.path} nests too deeply to parse") from None
        self.source = source
        specials = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}
        self._specials = {key: value for key, value in specials.items() if value is not None}
        self._context = {"tools": None, "documents": None}
        self.turn_end = next((t for t in _TURN_ENDS if t in source), None)
        if self.turn_end is None and "eos_token" in source:
            self.turn_end = tokenizer.eos_token

    def bound(self, **context):
        twin = copy.copy(self)
        twin._context = {**self._context, **context}
        return twin

    def render(self, messages, add_generation_prompt=True):
        # As transformers does: plain dicts, and a None-valued key counts as absent.
        messages = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        _bounds.deadline = time.monotonic() + RENDER_SECONDS
        parts, size = [], 0
        try:
            for part in self._template.generate(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **self._context,
                **self._specials,
            ):
                size += len(part)
                _check_size(size)
                parts.append(part)
            return "".join(parts)
        # A template is a program: it can fail with any Python error, not only jinja's.
        except Exception as e:
            raise TextError(f"chat template: {e}") from e
        finally:
            _bounds.deadline = None


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


# A hostile template must not hang a prompt or exhaust memory: rendering stops
# past these (real templates take milliseconds and a prompt's worth of text).
RENDER_SECONDS = 10.0
RENDER_CHARS = 1 << 24
_bounds = threading.local()


def _check_time() -> None:
    deadline = getattr(_bounds, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise jinja2.exceptions.SecurityError(f"rendering took more than {RENDER_SECONDS:g} s")


def _check_size(n: int) -> None:
    if n > RENDER_CHARS:
        raise jinja2.exceptions.SecurityError(f"it makes a text of more than {RENDER_CHARS} characters")


_HUGE_WIDTH = re.compile(r"\d{%d,}" % len(str(RENDER_CHARS)))


def _check_widths(fmt: str) -> None:
    """A format string's field widths fit the size bound ("%099999999d" does not)."""
    if _HUGE_WIDTH.search(fmt):
        raise jinja2.exceptions.SecurityError("a format field width is too large")


class _BoundedRange:
    """The sandbox's range (at most 100,000 items), checking the time as it goes."""

    def __init__(self, *args):
        self._range = safe_range(*args)

    def __len__(self):
        return len(self._range)

    def __iter__(self):
        for i in self._range:
            _check_time()
            yield i


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles ``a ~ b`` to a join that checks the result's size."""

    @optimizeconst
    def visit_Concat(self, node, frame):
        self.write("environment.bounded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, with every call, attribute, operator and join checking
    the render's deadline and the sizes of the texts and lists it makes."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def bounded_join(self, parts):
        _check_time()
        texts = [str(p) for p in parts]
        _check_size(sum(map(len, texts)))
        return "".join(texts)

    def call_binop(self, context, operator, left, right):
        _check_time()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    _check_size(len(seq) * n)
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            _check_size(len(left) + len(right))
        elif operator == "**" and isinstance(right, int) and right > 64:
            raise jinja2.exceptions.SecurityError(f"power {right} is too large")
        elif operator == "%" and isinstance(left, str):
            _check_widths(left)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (the sandbox's own signature)
        _check_time()
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool) and value > RENDER_CHARS:
                raise jinja2.exceptions.SecurityError(f"a call with the argument {value} is too large")
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value):  # str.format and format_map, as the sandbox wraps them
        if getattr(value, "__name__", None) in ("format", "format_map") and isinstance(
            getattr(value, "__self__", None), str
        ):
            _check_widths(value.__self__)
        return super().wrap_str_format(value)

    def getattr(self, obj, attribute):
        _check_time()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _check_time()
        return super().getitem(obj, argument)


def _environment() -> ImmutableSandboxedEnvironment:
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.globals["range"] = _BoundedRange
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
