"""A conversation (role/content messages) to the exact token ids to feed.

Assistant messages this process generated are spliced in as the ids the
model produced, never re-tokenized from their text: re-tokenizing can pick a
different split, which would make the next turn miss the cache. A reply with
reasoning or tool calls is remembered under ``message_key`` (what llm hands
back is its parts, not its text) and spliced where the template renders it as
the model wrote it; where the template renders it otherwise (Qwen3 drops the
reasoning of turns before the last question), its rendering is encoded.
"""

from __future__ import annotations

import json

from .errors import TextError

MAX_REMEMBERED_REPLIES = 256  # per program; the oldest are forgotten


class ReplyMemory:
    """Per loaded program: assistant text -> the ids generated for it."""

    def __init__(self):
        self._by_program: dict = {}

    def of(self, key) -> dict[str, list[int]]:
        """The replies one program generated (the mapping ``encode_conversation`` reads)."""
        return self._by_program.setdefault(key, {})

    def remember(self, key, text: str, ids: list[int]) -> None:
        replies = self.of(key)
        replies[text] = ids
        while len(replies) > MAX_REMEMBERED_REPLIES:
            del replies[next(iter(replies))]

    def drop(self, key) -> None:
        """Forget the replies of one program."""
        self._by_program.pop(key, None)

    def clear(self) -> None:
        self._by_program.clear()


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
        if m["role"] != "assistant":
            continue
        key = message_key(m)
        known = generated.get(key) if key else None
        if known is None:
            continue
        written = m["content"] if key == m["content"] else tokenizer.decode(known)
        # Look for the reply where its turn begins: the text of the earlier
        # messages plus the generation prompt (the reply's own words may also
        # occur earlier, even inside the template's markup).
        opening = template.render(messages[:k], add_generation_prompt=True)
        search_from = max(cursor, len(opening)) if rendered.startswith(opening) else cursor
        found = _locate(rendered, written, search_from, known, tokenizer)
        if found is None:
            continue
        at, length, reply_ids = found
        ids += tokenizer.encode(rendered[cursor:at]) + reply_ids
        cursor = at + length
    return ids + tokenizer.encode(rendered[cursor:])


def reply_start(messages: list[dict], template, tokenizer, generated: dict[str, list[int]]) -> int | None:
    """Token offset where the last assistant reply of ``messages`` begins; None without one."""
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not replies:
        return None
    return len(encode_conversation(messages[: replies[-1]], template, tokenizer, generated, False))


def _locate(rendered: str, content: str, start: int, ids: list[int], tokenizer):
    """Where the reply sits in ``rendered`` and the ids to splice there.

    Templates often strip a reply (Llama 3's ``| trim``); then the ids are the
    generated run, less at most two tokens at each end, that decodes to
    exactly the stripped text. None when the reply cannot be matched.
    """
    at = rendered.find(content, start)
    if at >= 0:
        return at, len(content), ids
    stripped = content.strip()
    at = rendered.find(stripped, start) if stripped else -1
    if at < 0:
        return None
    for a in range(min(3, len(ids))):
        for b in range(len(ids), max(a, len(ids) - 3), -1):
            if tokenizer.decode(ids[a:b]) == stripped:
                return at, len(stripped), ids[a:b]
    return None


def message_key(message: dict) -> str:
    """What a reply's ids are remembered under: its text, or, for a reply with
    reasoning or tool calls, all of what it said (arguments in key order)."""
    if not message.get("reasoning_content") and not message.get("tool_calls"):
        return message.get("content") or ""
    calls = [[c["function"]["name"], c["function"]["arguments"]] for c in message.get("tool_calls") or []]
    return json.dumps([message.get("reasoning_content") or "", message.get("content") or "", calls], sort_keys=True)


def calls_as_text(messages: list[dict], fmt, think, tokenizer, generated: dict[str, list[int]]) -> list[dict]:
    """``messages`` for a template that renders no ``tool_calls`` (SmolLM3's
    renders an assistant turn's content alone): each turn that called becomes
    the text the model wrote. That is its ids' text where they were generated
    here, remembered in ``generated`` under that text too so they are spliced;
    else its reasoning in ``think`` tags, its text and its calls as ``fmt``
    (a ToolFormat) writes them.
    """
    from .tool_calls import ToolCall

    out = []
    for m in messages:
        if m["role"] != "assistant" or not m.get("tool_calls"):
            out.append(m)
            continue
        ids = generated.get(message_key(m))
        if ids is not None:
            text = tokenizer.decode(ids)
            generated.setdefault(text, ids)
        else:
            calls = [fmt.write_call(ToolCall(c["function"]["name"], c["function"]["arguments"]))
                     for c in m["tool_calls"]]
            reasoning = m.get("reasoning_content")
            head = f"{think[0]}\n{reasoning}\n{think[1]}\n" if reasoning and think else ""
            text = head + "\n".join(t for t in [m.get("content") or "", *calls] if t)
        out.append({"role": "assistant", "content": text})
    return out


def assistant_message(content: str, reasoning: str = "", calls=()) -> dict:
    """An assistant message as chat templates take it (transformers' form)."""
    message = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
        ]
    return message


def messages_from_llm(prompt_messages) -> list[dict]:
    """Chat-template messages from llm's ``prompt.messages``: text, reasoning,
    tool calls, and each tool result as a message of role "tool"."""
    from .tool_calls import ToolCall

    out = []
    for m in prompt_messages:
        texts, reasoning, calls, results, other = [], [], [], [], []
        for part in m.parts:
            kind = type(part).__name__
            if kind == "TextPart":
                texts.append(part.text or "")
            elif kind == "ReasoningPart":
                reasoning.append(part.text or "")
            elif kind == "ToolCallPart":
                calls.append(ToolCall(part.name, dict(part.arguments or {})))
            elif kind == "ToolResultPart":
                results.append({"role": "tool", "content": part.output or "", "name": part.name})
            else:
                other.append(kind)
        if other:
            raise TextError(
                f"this model takes text only; the conversation has {', '.join(sorted(set(other)))}"
            )
        if m.role == "assistant":
            out.append(assistant_message("".join(texts), "".join(reasoning), calls))
        elif results:
            out += results
        else:
            out.append({"role": m.role, "content": "".join(texts)})
    return out
