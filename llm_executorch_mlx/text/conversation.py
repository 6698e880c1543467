"""A conversation (role/content messages) to the exact token ids to feed.

Assistant messages this process generated are spliced in as the ids the
model produced, never re-tokenized from their text: re-tokenizing can pick a
different split, which would make the next turn miss the cache.
"""

from __future__ import annotations

from .errors import TextError


def encode_conversation(
    messages: list[dict], template, tokenizer, generated: dict[str, list[int]], add_generation_prompt: bool = True
) -> list[int]:
    """Token ids for ``messages`` as the model should see them this turn.

    Args:
        messages: ``[{"role": ..., "content": ...}, ...]``, oldest first.
        template: a ``ChatTemplate``; a raw one ("none") concatenates each
            message encoded as plain text (BOS once, at the start).
        generated: assistant text -> the ids generated for it.
    """
    if template.is_raw:
        ids: list[int] = []
        for i, m in enumerate(messages):
            known = generated.get(m["content"]) if m["role"] == "assistant" else None
            ids += known if known is not None else tokenizer.encode(m["content"], add_special=(i == 0))
        return ids

    if not messages:
        return []
    rendered = template.render(messages, add_generation_prompt=add_generation_prompt)
    ids, cursor = [], 0
    for k, m in enumerate(messages):
        known = generated.get(m["content"]) if m["role"] == "assistant" and m["content"] else None
        if known is None:
            continue
        # Look for the reply where its turn begins: the text of the earlier
        # messages plus the generation prompt (the reply's own words may also
        # occur earlier, even inside the template's markup).
        opening = template.render(messages[:k], add_generation_prompt=True)
        search_from = max(cursor, len(opening)) if rendered.startswith(opening) else cursor
        at = rendered.find(m["content"], search_from)
        if at < 0:
            continue
        ids += tokenizer.encode(rendered[cursor:at]) + known
        cursor = at + len(m["content"])
    return ids + tokenizer.encode(rendered[cursor:])


def messages_from_llm(prompt_messages) -> list[dict]:
    """Plain role/content dicts from llm's ``prompt.messages`` (text parts only)."""
    out = []
    for m in prompt_messages:
        texts, other = [], []
        for part in m.parts:
            text = getattr(part, "text", None)
            if type(part).__name__ == "TextPart":
                texts.append(text or "")
            elif type(part).__name__ != "ReasoningPart":
                other.append(type(part).__name__)
        if other:
            raise TextError(
                f"this model takes text only; the conversation has {', '.join(sorted(set(other)))}"
            )
        out.append({"role": m.role, "content": "".join(texts)})
    return out
