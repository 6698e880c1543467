"""Reasoning (``<think>...</think>``) as a chat template declares it.

A template that writes ``<think>`` (Qwen3, SmolLM3, DeepSeek R1's distills)
belongs to a model that reasons before it answers; that text streams as
llm's reasoning, not as the answer (reply_parts.py splits it). Whether the
model reasons is the template's switch, ``enable_thinking``, which
``-o reasoning false`` sets; a template without one cannot turn it off.
"""

from __future__ import annotations

from .errors import TextError

THINK = ("<think>", "</think>")
SWITCH = "enable_thinking"


def think_tags(source: str | None) -> tuple[str, str] | None:
    """The reasoning tags a template's jinja ``source`` uses, or None."""
    if source is not None and all(tag in source for tag in THINK):
        return THINK
    return None


def thinking_context(source: str | None, reasoning: bool | None) -> dict:
    """What the template is rendered with for ``-o reasoning`` (None: not given,
    the template's own default)."""
    if reasoning is None:
        return {}
    if source is not None and SWITCH in source:
        return {SWITCH: reasoning}
    if reasoning:
        return {}  # nothing to turn on: the model reasons if its template lets it
    raise TextError(
        f"-o reasoning false: this model's chat template has no switch for reasoning ({SWITCH}); "
        "leave the option out"
    )


def opens_reasoning(prompt_text: str, think: tuple[str, str] | None) -> bool:
    """Whether the prompt's generation prompt has opened the reasoning already
    (some templates end it with ``<think>``), so the reply starts inside it."""
    return think is not None and prompt_text.rstrip().endswith(think[0])
