"""One response's output text -> its output items and the Responses API's semantic stream events.

The text is split as chat's is (frontend/reasoning.py, then frontend/tool_parser.py: the same parsers, so a response
says what the chat completion would) into items, each written as it comes:

  item           opened by                       events, in order
  reasoning      reasoning text                  output_item.added, content_part.added, reasoning_text.delta...,
                                                 reasoning_text.done, content_part.done, output_item.done
  message        content text                    output_item.added, content_part.added, output_text.delta...,
                                                 output_text.done, content_part.done, output_item.done
  function_call  a call's first delta            output_item.added, function_call_arguments.delta...,
                                                 function_call_arguments.done, output_item.done
An item is done when another opens or the response ends. The response's own events frame them: response.created,
then response.queued (background) or response.in_progress, response.in_progress again once a queued run starts,
and one of response.completed / .incomplete (the length limit: incomplete_details.reason max_output_tokens) /
.failed (with its error) / .cancelled. Every event carries its sequence_number, from 0; an event is
`event: TYPE` and `data: JSON` (no [DONE], as OpenAI's). Items cut by the end are `incomplete`.
"""

from __future__ import annotations

import msgspec

from frontend import openai_format as fmt
from frontend.responses_api.items import new_id
from frontend.responses_api.request import ResponsesCall
from frontend.tokenizer import Tokenizer
from frontend.tool_parser import ToolCallDelta, ToolCallParser
from messages.wire import TokenLogprobs

_encode = msgspec.json.Encoder().encode
TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed",
            "cancelled": "response.cancelled"}  # fmt: skip
_PART = {"message": ("output_text", "response.output_text"), "reasoning": ("reasoning_text", "response.reasoning_text")}


class ResponseWriter:
    def __init__(self, call: ResponsesCall, tokenizer: Tokenizer):
        self.call = call
        self.tokenizer = tokenizer
        p = call.parsed
        self.thoughts = p.reasoning.parser() if p.reasoning is not None else None
        self.tools = ToolCallParser() if p.tool_calls else None
        self.status = "queued" if call.background else "in_progress"
        self.output: list[dict] = []
        self.events: list[bytes] = []  # every event so far, encoded (index: sequence_number)
        self.usage: dict | None = None
        self.error: dict | None = None
        self.incomplete: dict | None = None
        self._item: dict | None = None  # the item being written
        self._logprobs: list[dict] = []  # logprobs not yet given to a text delta
        self._reasoning = []  # every reasoning text (its tokens are counted at the end)
        self._calls: dict[int, dict] = {}  # the tool parser's index of a call -> its item

    @property
    def id(self) -> str:
        return self.call.parsed.request_id

    @property
    def ended(self) -> bool:
        return self.status in TERMINAL

    def response(self) -> dict:
        """The Response object now."""
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.call.created_at,
            "status": self.status,
            "error": self.error,
            "incomplete_details": self.incomplete,
            "output": self.output,
            "usage": self.usage,
            **self.call.echo(),
        }

    def start(self) -> None:
        self._emit("response.created", response=self.response())
        self._emit("response.queued" if self.status == "queued" else "response.in_progress", response=self.response())

    def feed(self, text: str, token_ids: list[int], logprobs: list[TokenLogprobs]) -> None:
        """The next output of the run."""
        if self.status == "queued":
            self.status = "in_progress"
            self._emit("response.in_progress", response=self.response())
        lps = []
        if self.call.parsed.logprobs is not None and token_ids:
            lps = fmt.chat_logprobs(token_ids, TokenLogprobs.join(logprobs), self.tokenizer)["content"]
        reasoning, content = self.thoughts.feed(text) if self.thoughts is not None else ("", text)
        self._write(reasoning, self.tools.pieces(content) if self.tools is not None else [content], lps)

    def finish(self, status: str, usage: dict, error: dict | None = None) -> None:
        """The end: `status` completed, incomplete (the length limit), failed or cancelled."""
        reasoning, content = self.thoughts.finish() if self.thoughts is not None else ("", "")
        pieces = [content] if self.tools is None else self.tools.pieces(content) + self.tools.last_pieces()
        self._write(reasoning, pieces, [])
        self._close("completed" if status == "completed" else "incomplete")
        self.status, self.error = status, error
        if status == "incomplete":
            self.incomplete = {"reason": "max_output_tokens"}
        thought = "".join(self._reasoning)
        reasoning_tokens = len(self.tokenizer.encode(thought, add_special_tokens=False)) if thought else 0
        self.usage = {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage["total_tokens"],
        }
        self._emit(TERMINAL[status], response=self.response())

    def fail(self, message: str) -> None:
        """The run broke (a bug): it ends `failed` as it is."""
        self.status, self.error = "failed", {"code": "server_error", "message": message}
        self._emit(TERMINAL["failed"], response=self.response())

    # ------------------------------------------------------------ items

    def _write(self, reasoning: str, pieces: list[str | ToolCallDelta], logprobs: list[dict]) -> None:
        """Reasoning, then the content's text and calls in their order. Logprobs go to the message's next text;
        those of a feed that wrote only reasoning or calls are theirs, and dropped."""
        if reasoning:
            self._reasoning.append(reasoning)
            self._text("reasoning", reasoning)
        self._logprobs += logprobs
        wrote = {"text": False, "call": False}
        for piece in pieces:
            if isinstance(piece, ToolCallDelta):
                self._call(piece)
                wrote["call"] = True
            elif piece:
                self._text("message", piece)
                wrote["text"] = True
        if not wrote["text"] and (reasoning or wrote["call"]):
            self._logprobs = []

    def _text(self, kind: str, text: str) -> None:
        part_kind, event = _PART[kind]
        if self._item is None or self._item["type"] != kind:
            part = {"type": part_kind, "text": ""} | ({"annotations": [], "logprobs": []} if kind == "message" else {})
            item = {"id": new_id(kind), "type": kind, "status": "in_progress", "content": []}
            if kind == "message":
                item["role"] = "assistant"
            else:
                item["summary"] = []
            self._open(item)
            item["content"].append(part)
            self._emit("response.content_part.added", **self._where(), part=part)
        part = self._item["content"][0]
        part["text"] += text
        extra = {}
        if kind == "message":
            extra["logprobs"], self._logprobs = self._logprobs, []
            part["logprobs"] += extra["logprobs"]
        self._emit(f"{event}.delta", **self._where(), delta=text, **extra)

    def _call(self, d: ToolCallDelta) -> None:
        if d.id is not None:
            call_id = "call_" + d.id.rsplit("-", 1)[-1]
            self._calls[d.index] = item = {"id": new_id("function_call"), "type": "function_call",
                                           "status": "in_progress", "call_id": call_id, "name": d.name,
                                           "arguments": ""}  # fmt: skip
            self._open(item)
        if d.arguments:
            item = self._calls[d.index]
            item["arguments"] += d.arguments
            self._emit("response.function_call_arguments.delta", **self._where(False, item), delta=d.arguments)

    def _open(self, item: dict) -> None:
        self._close("completed")
        self._item = item
        self.output.append(item)
        self._emit("response.output_item.added", output_index=len(self.output) - 1, item=item)

    def _close(self, status: str) -> None:
        item, self._item = self._item, None
        if item is None:
            return
        if item["type"] == "function_call":
            done = {"arguments": item["arguments"], "name": item["name"]}
            self._emit("response.function_call_arguments.done", **self._where(False, item), **done)
        else:
            part = item["content"][0]
            extra = {"logprobs": part["logprobs"]} if item["type"] == "message" else {}
            self._emit(f"{_PART[item['type']][1]}.done", **self._where(True, item), text=part["text"], **extra)
            self._emit("response.content_part.done", **self._where(True, item), part=part)
        item["status"] = status
        self._emit("response.output_item.done", output_index=self.output.index(item), item=item)

    def _where(self, part: bool = True, item: dict | None = None) -> dict:
        item = item or self._item
        where = {"item_id": item["id"], "output_index": self.output.index(item)}
        return where | ({"content_index": 0} if part else {})

    def _emit(self, kind: str, **body) -> None:
        data = _encode({"type": kind, "sequence_number": len(self.events), **body})
        self.events.append(b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n")
