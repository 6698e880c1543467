"""A reply's text, as it streams, split into reasoning, answer and tool calls.

The splitter sees the text in whatever chunks the decoder gives and holds back
only what could still turn out to be a tag (``<think>``, ``</think>``,
``<tool_call>``), so any chunking of a reply gives the same parts, and a tag
split across tokens is still recognised.

The reasoning is stripped of the newlines around it and the answer of the
newlines after ``</think>``, the whitespace around a call left out: what
templates such as Qwen3's strip when they render the turn back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .tool_calls import ToolCall, ToolFormat


@dataclass
class ReplyParts:
    """What a whole reply said: its reasoning, its answer and its calls."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def _held(text: str, tag: str, space: str | None) -> int:
    """How many characters at the end of ``text`` to hold back: what could
    begin ``tag``, and the run of ``space`` characters (None: any whitespace)
    before it, which is dropped if the tag follows."""
    n = next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)
    rest = text[: len(text) - n]
    return n + len(rest) - len(rest.rstrip(space))


class ReplySplitter:
    """Feed text chunks; get ("reasoning" | "text", text) events back.

    Args:
        think: the (opening, closing) reasoning tags, or None when the
            template has none.
        in_reasoning: the prompt already opened the reasoning (its
            generation prompt ends with the opening tag).
        calls: the tool-call format to read, or None (no tools offered).
    """

    def __init__(self, think: tuple[str, str] | None, in_reasoning: bool = False, calls: ToolFormat | None = None):
        self.think = think
        self.format = calls
        self.parts = ReplyParts()
        self._buf = ""
        self._state = "reasoning" if (think and in_reasoning) else "start"
        self._thought = self._state == "reasoning"  # reasoning may open only once, first
        self._reasoning_begun = False
        self._skip_space = False  # after a call: drop the whitespace that follows it
        self._gap = ""  # the whitespace dropped before the call being read

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[tuple[str, str]]:
        """The events the held text makes once the reply has ended."""
        return self._run(final=True)

    def _run(self, final: bool) -> list[tuple[str, str]]:
        events: list[tuple[str, str]] = []
        while self._step(final, events):
            pass
        for kind, text in events:
            if kind == "reasoning":
                self.parts.reasoning += text
            else:
                self.parts.content += text
        return [(k, t) for k, t in events if t]

    def _step(self, final: bool, events: list) -> bool:
        """Process what the buffer decides in the current state; True when
        the state changed (the buffer is looked at again)."""
        return getattr(self, "_" + self._state)(final, events)

    def _start(self, final, events):
        """Where the answer begins: it may open the reasoning or be a bare call."""
        think = self.think[0] if self.think and not self._thought else None
        openings = ([think] if think else []) + list(self.format.bare_starts if self.format else ())
        head = self._buf.lstrip()
        for tag in openings:
            if head.startswith(tag):
                if tag == think:
                    self._buf, self._state, self._thought = head[len(tag):], "reasoning", True
                else:
                    self._state = "bare_call"
                return True
        if not final and any(tag.startswith(head) for tag in openings):
            return False  # could still open one
        self._state = "answer"
        return True

    def _reasoning(self, final, events):
        closing = self.think[1]
        if not self._reasoning_begun:
            self._buf = self._buf.lstrip("\n")
            if not self._buf and not final:
                return False
            self._reasoning_begun = True
        buf = self._buf
        at = buf.find(closing)
        if at >= 0:
            events.append(("reasoning", buf[:at].rstrip("\n")))
            self._buf, self._state = buf[at + len(closing):], "after_reasoning"
            return True
        keep = 0 if final else _held(buf, closing, "\n")
        events.append(("reasoning", buf[: len(buf) - keep].rstrip("\n") if final else buf[: len(buf) - keep]))
        self._buf = buf[len(buf) - keep:]
        return False

    def _after_reasoning(self, final, events):
        """The newlines after the closing tag, which may still be streaming."""
        self._buf = self._buf.lstrip("\n")
        if not self._buf and not final:
            return False
        self._state = "start"
        return True

    def _answer(self, final, events):
        if self._skip_space:
            self._buf = self._buf.lstrip()
            if not self._buf and not final:
                return False
            self._skip_space = False
        buf = self._buf
        opening = self.format.opening if self.format is not None else None
        at = buf.find(opening) if opening else -1
        if at >= 0:
            before = buf[:at].rstrip()
            events.append(("text", before))
            self._gap = buf[len(before):at]  # given back if the call is text after all
            self._buf, self._state = buf[at + len(opening):], "call"
            return True
        keep = _held(buf, opening, None) if opening and not final else 0
        events.append(("text", buf[: len(buf) - keep]))
        self._buf = buf[len(buf) - keep:]
        return False

    def _call(self, final, events):
        # The first closing tag after which the call parses ends it: a closing
        # tag may sit inside an argument's string.
        buf, opening, closing = self._buf, self.format.opening, self.format.closing
        ends = [i for i in range(len(buf)) if buf.startswith(closing, i)]
        for at in ends:
            call = self.format.parse_call(buf[:at])
            if call is not None:
                self.parts.calls.append(call)
                self._buf, self._state, self._skip_space = buf[at + len(closing):], "answer", True
                return True
        if not final:
            return False  # a later closing tag may still complete it
        end = ends[0] + len(closing) if ends else len(buf)  # not a call: it was text after all
        events.append(("text", self._gap + opening + buf[:end]))
        self._buf, self._state = buf[end:], "answer"
        return True

    def _bare_call(self, final, events):
        """A reply that is a call as a whole is known only once it ends."""
        if not final:
            return False
        call = self.format.parse_call(self._buf)
        if call is None:
            events.append(("text", self._buf))
        else:
            self.parts.calls.append(call)
        self._buf = ""
        return False


def split_reply(text: str, think, in_reasoning: bool, calls: ToolFormat | None) -> ReplyParts:
    """The parts of a whole reply (the same as streaming it in any chunks)."""
    splitter = ReplySplitter(think, in_reasoning, calls)
    splitter.feed(text)
    splitter.finish()
    return splitter.parts
