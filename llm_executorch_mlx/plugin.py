"""The llm Model for registered .pte files: options, execute, usage."""

from __future__ import annotations

import sys

import click
import llm
from pydantic import Field, create_model, field_validator

from .options import OPTIONS
from .registry import Entry, find_entry

STATES_DIRNAME = "executorch-mlx-states"
_mlx_ready = False  # MLX's backend was found usable in this process


def _check(cls, value, info):
    # None means not given: the declared default applies when the turn runs.
    return value if value is None else OPTIONS[info.field_name].check(value)


class InputError(llm.ModelError, click.ClickException):
    """A model file, tokenizer or template that cannot be used: an
    ``llm.ModelError`` to Python callers, and a one-line ``Error: ...`` from
    commands that do not catch model errors themselves (``llm chat``)."""


class PteModel(llm.Model):
    can_stream = True
    supports_schema = True  # the sampler only takes tokens the schema allows (text/constrained.py)
    supports_tools = True  # where the chat template renders tools (text/tool_calls.py); else a clear error

    # One field per declared option (options.py); Option.check refuses a bad value, saying what would do.
    Options = create_model(
        "Options",
        __base__=llm.Options,
        __validators__={"check": field_validator("*")(classmethod(_check))},
        **{o.name: (o.type | None, Field(None, description=o.help)) for o in OPTIONS.values()},
    )

    def __init__(self, entry: Entry):
        self.entry = entry
        self.model_id = entry.model_id

    def execute(self, prompt, stream, response, conversation):
        global _mlx_ready
        if not _mlx_ready:  # the check reads package metadata (~10 ms): once per process
            from .mlx_backend import MlxBackendError, require

            try:
                require()
            except MlxBackendError as e:
                raise InputError(str(e)) from None
            _mlx_ready = True
        from .distributed import GroupError, group, lost, quiet_unless_first, shared_seed
        from .runtime.errors import PteError
        from .text.conversation import messages_from_llm
        from .text.errors import TextError
        from .text.turn import Turn, TurnOptions

        o = prompt.options
        stop = o.stop if isinstance(o.stop, list) else ([o.stop] if o.stop else [])
        given = {k: v for k, v in o.model_dump().items() if v is not None and k != "stop"}
        given.setdefault("chat", self.entry.chat)
        try:
            split = group() is not None  # one rank of an mlx.launch group (distributed.py)
            if split:
                quiet_unless_first(response)
                if "seed" not in given:
                    given["seed"] = shared_seed()
            turn = Turn(
                self.entry.path,
                self.entry.tokenizer,
                messages_from_llm(prompt.messages),
                TurnOptions(stop=stop, **given),
                state_dir=None if split else saved_states_dir(),  # a rank's cache is not a model's
                schema=prompt.schema,
                tools=_tool_definitions(prompt),
                draft_model=_draft_files(given.get("draft", "none"), split),
            )
            _advise_on_blas_once()
            yield from _stream_parts(turn, response)
        except (PteError, TextError, GroupError) as e:
            raise InputError(str(e)) from None
        except RuntimeError as e:  # MLX's, where a rank of the group ended
            if lost(e) is None:
                raise
            raise InputError(lost(e)) from None
        r = turn.result
        response.set_usage(input=r.prompt_tokens, output=r.output_tokens, details={"cached": r.cached_tokens})
        response.response_json = r.stats


def _draft_files(draft: str, split: bool) -> tuple[str, str] | None:
    """The (.pte, tokenizer) files of the registered model ``-o draft`` names;
    None for none and ngram."""
    if draft in ("none", "ngram"):
        return None
    if split:
        raise InputError(f"-o draft {draft}: a draft model does not run across an mlx.launch group; "
                         "use -o draft ngram")
    entry = find_entry(draft)
    if entry is None:
        raise InputError(f"-o draft {draft}: no registered model has that name; `llm pte models` lists them "
                         "(or use -o draft ngram)")
    return entry.path, entry.tokenizer


def _tool_definitions(prompt) -> list[dict] | None:
    """The function tools the prompt offers, as chat templates take them."""
    from .text.tool_calls import tool_definitions

    tools = [t for t in prompt.tools if isinstance(t, llm.Tool)]
    return tool_definitions(tools) if tools else None


def _stream_parts(turn, response):
    """The turn's answer as text and its reasoning as llm's reasoning events;
    its tool calls added to the response."""
    from llm.parts import StreamEvent

    for kind, text in turn.events():
        yield text if kind == "text" else StreamEvent(type=kind, chunk=text)
    for call in turn.parts.calls:
        response.add_tool_call(llm.ToolCall(name=call.name, arguments=call.arguments))


def saved_states_dir():
    """Where cache states are saved between processes (text/saved_states.py)."""
    return llm.user_dir() / STATES_DIRNAME


def _advise_on_blas_once() -> None:
    """Tell a CPU user once (per llm user dir and message) that MLX runs on
    its slow reference BLAS, and how to fix it (runtime/cpu/blas.py)."""
    from .runtime.cpu import blas
    from .runtime.dtypes import on_cpu

    advice = blas.load_fast_blas().advice
    if advice is None or not on_cpu():
        return
    marker = llm.user_dir() / "executorch-mlx-blas-advice.txt"
    try:
        if marker.read_text() == advice:
            return
    except OSError:
        pass
    print(f"note: {advice}", file=sys.stderr)
    marker.write_text(advice)
