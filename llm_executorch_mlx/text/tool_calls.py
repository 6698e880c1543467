"""Tool calls as a chat template's model family writes them.

A template that renders ``tools`` tells the model how to call one, and the
model answers in that family's format. We read the family from the template's
own text, never guess: a template whose format is not one of these gets a
clear refusal.

- ``hermes`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number of them, with text around them.
- ``smollm3`` (SmolLM3): Hermes' ``<tool_call>`` JSON, but the template
  takes the tools as ``xml_tools=`` and renders no ``tool_calls``: a turn
  that called goes back as its text, calls written in it (conversation.py).
- ``llama3_json`` (Llama 3.1, 3.2, 3.3): the whole reply is one JSON object,
  ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``.

mlx-lm's parsers for these are ``json.loads`` of the tagged text, and the
package brings transformers with it at run time: not worth the dependency.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .errors import TextError

SUPPORTED = "Qwen2.5/Qwen3/Hermes/SmolLM3 <tool_call> JSON, Llama 3.1/3.2 JSON"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ToolFormat:
    """One family's call syntax. ``opening``/``closing``: the tags around a
    call (what could begin ``opening`` is held back from the streamed
    answer); ``bare_starts``: how a reply that is a call as a whole begins,
    known only once the reply ends."""

    family: str
    opening: str | None = None
    closing: str | None = None
    bare_starts: tuple[str, ...] = ()
    arguments_key: str = "arguments"  # what the call's JSON names its arguments
    tools_key: str = "tools"  # the template variable the tools are rendered from
    calls_in_content: bool = False  # the template renders no tool_calls: calls go back as text

    def template_context(self, tools: list[dict]) -> dict:
        """What the template renders ``tools`` (tool_definitions) from. SmolLM3's
        ``xml_tools`` takes each function bare, as its model card passes them."""
        if self.tools_key == "xml_tools":
            return {"xml_tools": [t["function"] for t in tools]}
        return {self.tools_key: tools}

    def write_call(self, call: ToolCall) -> str:
        """``call`` as the template tells the model to write one."""
        body = json.dumps({"name": call.name, self.arguments_key: call.arguments}, ensure_ascii=False)
        return body if self.opening is None else f"{self.opening}\n{body}\n{self.closing}"

    def call_schema(self, name: str, parameters: dict) -> dict:
        """The JSON schema of a call of the tool ``name`` (what a forced call writes)."""
        return {
            "type": "object",
            "properties": {"name": {"const": name}, self.arguments_key: parameters},
            "required": ["name", self.arguments_key],
        }

    def parse_call(self, text: str) -> ToolCall | None:
        """The call written in ``text`` (between the tags, or the whole bare
        reply), or None when it is not one."""
        body = text.strip()
        if self.opening is None and body.startswith(_PYTHON_TAG):
            body = body[len(_PYTHON_TAG):].strip()
        return _call_from_json(body)


_PYTHON_TAG = "<|python_tag|>"


def _call_from_json(text: str) -> ToolCall | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments")
    if arguments is None:
        arguments = value.get("parameters", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], arguments)


def tool_format(source: str | None) -> ToolFormat:
    """The call format a chat template's ``source`` asks for; a TextError
    when it renders no tools or in a format we do not read."""
    if source is not None and "tools" in source:
        if "xml_tools" in source and "<tool_call>" in source:
            return ToolFormat("smollm3", "<tool_call>", "</tool_call>", tools_key="xml_tools",
                              calls_in_content="tool_calls" not in source)
        if "<tool_call>" in source:
            return ToolFormat("hermes", "<tool_call>", "</tool_call>")
        if "<|eot_id|>" in source and '"parameters": ' in source:
            return ToolFormat("llama3_json", bare_starts=("{", _PYTHON_TAG), arguments_key="parameters")
    raise TextError(
        "tools are not supported for this model's chat template: it does not render tools in a "
        f"format we read ({SUPPORTED})"
    )


def tool_definitions(tools) -> list[dict]:
    """llm's tools as chat templates take them (OpenAI's function form)."""
    return [
        {"type": "function", "function": {
            "name": t.name,
            "description": t.description or "",
            "parameters": t.input_schema or {"type": "object", "properties": {}},
        }}
        for t in tools
    ]


def forced_tools(choice: str, tools: list[dict] | None, messages: list[dict]) -> list[dict] | None:
    """The tools the reply must call one of under ``-o tool_choice choice``,
    or None when the model decides.

    Only a reply to the user is forced: once the last message is a tool's
    result, the call has been made, and forcing another would loop.
    """
    if choice == "auto":
        return None
    if not tools:
        raise TextError(f"-o tool_choice {choice} needs tools to call: offer some with -T/--tool or --functions")
    names = [t["function"]["name"] for t in tools]
    if choice != "required" and choice not in names:
        raise TextError(
            f"tool_choice must be auto, required or the name of a tool offered ({', '.join(names)}), got {choice!r}"
        )
    if messages and messages[-1]["role"] == "tool":
        return None
    return tools if choice == "required" else [tools[names.index(choice)]]
