"""Tool calls out of the model's text, in the Hermes convention (frontend/tools.py), incrementally: content text
streams as it comes and each call as OpenAI streams it (a first delta with id, type and name, then fragments of
its arguments), the same parser serving whole responses (`parse_tool_calls`), so both agree.

A call is `<tool_call>` WS `{` WS `"name"` WS `:` WS NAME WS `,` WS `"arguments"` WS `:` WS ARGS WS `}` WS
`</tool_call>` with ARGS a JSON object (the grammar writes exactly `<tool_call>\\n{"name": "f", "arguments": ...}\\n
</tool_call>`; the parser is lenient about whitespace). ARGS ends where its braces balance outside strings, so
no look-ahead is needed: every argument character is streamed as soon as it is read.

  state    input                                      action
  TEXT     "<tool_call>"                              the text before it out -> HEADER
  TEXT     a possible start of "<tool_call>" at end   held back until the next feed or finish()
  TEXT     whitespace alone since the last call       held back: dropped if a call follows, or the end after one
  HEADER   the header up to `"arguments":`            first delta (id, name, arguments "") -> ARGS
  HEADER   "</tool_call>" or a header it cannot be    the call's raw text becomes content -> TEXT
  ARGS     characters of ARGS                         argument fragments; -> TAIL once ARGS closes
  TAIL     WS `}` WS `</tool_call>`                   the call is complete -> TEXT
  TAIL     anything else                              the call is complete; the text goes on as content -> TEXT
  finish   in HEADER: raw text is content; in ARGS: the call as far as it got (length cut it); in TAIL: complete
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_TAIL = re.compile(r"\s*\}\s*" + re.escape(CLOSE))
_MAX_HEADER = 4096  # characters of a header before it is taken for text


@dataclass
class ToolCallDelta:
    """One OpenAI streaming tool-call delta."""

    index: int  # the call's index in the message
    id: str | None = None  # on the call's first delta only
    name: str | None = None  # on the call's first delta only
    arguments: str = ""  # a fragment of the arguments' JSON text


class State(enum.Enum):
    TEXT = "text"
    HEADER = "header"
    ARGS = "args"
    TAIL = "tail"


class ToolCallParser:
    def __init__(self):
        self.state = State.TEXT
        self.calls: list[dict] = []  # complete calls (and one cut off by the end), OpenAI message shape
        self._buf = ""  # text read and not yet consumed
        self._depth, self._in_string, self._escape = 0, False, False
        self._texty = False  # the stretch of text since the last call has more than whitespace (it is content)

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """The next chunk of output -> (content now safe to emit, tool-call deltas)."""
        return _apart(self.pieces(text))

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The end of the output: flush what was held back."""
        return _apart(self.last_pieces())

    def pieces(self, text: str) -> list[str | ToolCallDelta]:
        """`feed`'s content and deltas in the order the output wrote them."""
        self._buf += text
        out: list = []
        while self._step(out, out):
            pass
        return out

    def last_pieces(self) -> list[str | ToolCallDelta]:
        """`finish`'s content and deltas in the order the output wrote them."""
        out = self.pieces("")
        buf, self._buf = self._buf, ""
        if self.state is State.TEXT:
            out.append(buf if self._texty or buf.strip() or not self.calls else "")
        elif self.state is State.HEADER:
            out.append(OPEN + buf)
        # ARGS (cut off: the call stays as far as it got) or TAIL (complete): nothing more to emit
        self.state = State.TEXT
        return out

    # ---------------------------------------------------------------- states

    def _step(self, content: list, deltas: list) -> bool:
        """Consume what the current state can; whether to go on."""
        buf = self._buf
        if self.state is State.TEXT:
            i = buf.find(OPEN)
            if i >= 0:
                if self._texty or buf[:i].strip():  # a whitespace-only stretch between calls is dropped
                    content.append(buf[:i])
                self._buf, self.state, self._texty = buf[i + len(OPEN) :], State.HEADER, False
                return True
            keep = next((k for k in range(min(len(OPEN) - 1, len(buf)), 0, -1) if OPEN.startswith(buf[-k:])), 0)
            if self._texty or buf[: len(buf) - keep].strip():
                content.append(buf[: len(buf) - keep])
                self._buf, self._texty = buf[len(buf) - keep :], True
            return False
        if self.state is State.HEADER:
            m = _HEADER.match(buf)
            complete = m is not None and m.end() < len(buf)  # (whitespace may follow the colon: wait for ARGS)
            if complete:
                try:
                    name = json.loads(m.group(1))
                except ValueError:
                    name = None
                if buf[m.end()] == "{" and isinstance(name, str):
                    call = {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function"}
                    self.calls.append({**call, "function": {"name": name, "arguments": ""}})
                    deltas.append(ToolCallDelta(len(self.calls) - 1, call["id"], name))
                    self._buf, self.state = buf[m.end() :], State.ARGS
                    self._depth, self._in_string, self._escape = 0, False, False
                    return True
            if complete or CLOSE in buf or len(buf) > _MAX_HEADER or not (m or _could_be_header(buf)):
                content.append(OPEN + buf[:1])  # not a call: its text is content, read on from the next char
                self._buf, self.state, self._texty = buf[1:], State.TEXT, True
                return True
            return False
        if self.state is State.ARGS:
            end = self._scan(buf)
            fragment = buf if end is None else buf[:end]
            if fragment:
                self.calls[-1]["function"]["arguments"] += fragment
                deltas.append(ToolCallDelta(len(self.calls) - 1, arguments=fragment))
            self._buf = "" if end is None else buf[end:]
            if end is not None:
                self.state = State.TAIL
            return end is not None
        m = _TAIL.match(buf)  # TAIL
        if m:
            self._buf = buf[m.end() :]
        elif _could_be(buf, "}" + CLOSE):
            return False
        self.state = State.TEXT
        return True

    def _scan(self, text: str) -> int | None:
        """Where ARGS ends in `text` (the index after its closing brace), tracking depth across feeds."""
        for i, c in enumerate(text):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None


def _apart(pieces: list[str | ToolCallDelta]) -> tuple[str, list[ToolCallDelta]]:
    return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if not isinstance(p, str)]


def _could_be(buf: str, literal: str) -> bool:
    """Whether `buf`, whitespace aside, may still grow into `literal`."""
    squeezed = "".join(buf.split())
    return literal.startswith(squeezed)


def _could_be_header(buf: str) -> bool:
    """Whether `buf` may still grow into a header (a cheap check: its first characters)."""
    squeezed = "".join(buf.split())
    prefix = '{"name":'
    return prefix.startswith(squeezed) if len(squeezed) < len(prefix) else squeezed.startswith(prefix)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """A whole output -> (its content, None when calls leave only whitespace, and its tool calls)."""
    parser = ToolCallParser()
    content, _ = parser.feed(text)
    rest, _ = parser.finish()
    content += rest
    return (content if content.strip() or not parser.calls else None), parser.calls
