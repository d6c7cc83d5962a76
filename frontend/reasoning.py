"""Reasoning outputs (issue 29): `sluice serve --reasoning-parser qwen3|deepseek_r1` (vLLM's flag) splits a chat
output's `<think>...</think>` block out of its content, into `message.reasoning` (streamed: `delta.reasoning`), also
named `reasoning_content` (vLLM gives both names); `include_reasoning: false` drops it. Only chat completions are
split; the tool parser (frontend/tool_parser.py) reads only the content.

Where the output starts (`start_phase`): the prompt's last think tag decides, as vLLM reads the prompt's tokens
(a template that opens a think block, as DeepSeek-R1's `<think>\\n`, starts it in REASONING; one that closes an
empty one, as Qwen3's with `enable_thinking: false`, in BEFORE); a prompt without either starts the parser's way:
qwen3 in BEFORE (reasoning only where the output opens a `<think>`), deepseek_r1 in REASONING (the template put the
`<think>` in the prompt: the text before `</think>` is reasoning even without a start tag). A prompt whose last tag
is `</think>` starts in BEFORE, not CONTENT, so a block the output opens is still reasoning (vLLM takes all of that
output for content): a thought kept in the conversation's history must not hide the next one.

The split works on text (the detokenizer's deltas, which may cut a tag anywhere), so tags need not be single tokens:

  phase      input                                           action
  BEFORE     text                                            content
  BEFORE     "<think>"                                       dropped -> REASONING
  BEFORE     (leading) text that cannot begin "<think>"      -> CONTENT
  REASONING  text                                            reasoning
  REASONING  "</think>"                                      dropped -> CONTENT
  REASONING  "<think>"                                       dropped (the template opened the block already)
  CONTENT    anything, tags included                         content
  any        a possible start of a tag it watches, at end    held back until the next feed or finish()
  finish     the held-back text goes where its phase sends text

Unlike vLLM's qwen3 parser, a `<think>` block the length limit cuts off is reasoning whether streamed or not
(vLLM: reasoning streamed, content whole): both paths run this one parser, so they agree.

Structured outputs and tools' grammars (`after_reasoning`): as vLLM, the grammar constrains the output once the
reasoning ends. The grammar becomes an xgrammar structural tag whose first element is the reasoning block (from
REASONING: any text up to `</think>`; from BEFORE: an optional `<think>...</think>`) and whose second is the spec
itself (JSON then allows at most one whitespace character at a time, as tool arguments do, instead of compact
separators), so the engine's grammar path enforces it unchanged. Unlike vLLM, the model cannot end the output
inside the reasoning (the grammar still waits for its part), and a think block may only open the output
(`leading`: the parser then takes a later `<think>` for content, as the grammar did).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

from frontend.body import RequestError
from messages.sampling_params import StructuredOutput

REASONING_PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


class Phase(enum.Enum):
    BEFORE = "before"  # content; a <think> opens the reasoning
    REASONING = "reasoning"
    CONTENT = "content"  # after the reasoning: content for good


_WATCHED = {Phase.BEFORE: (START,), Phase.REASONING: (END, START), Phase.CONTENT: ()}


class ReasoningParser:
    """One output's split, fed its text as it comes (module docstring's table)."""

    def __init__(self, phase: Phase, leading: bool = False):
        self.phase = phase
        self.leading = leading
        self.reasoned = phase is Phase.REASONING  # a reasoning block was opened (its text may be empty)
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The next chunk of output -> (reasoning, content) now safe to emit."""
        buf, self._held = self._held + text, ""
        reasoning: list[str] = []
        content: list[str] = []
        while buf:
            if self.leading and self.phase is Phase.BEFORE and not START.startswith(buf[: len(START)]):
                self.phase = Phase.CONTENT
            out = reasoning if self.phase is Phase.REASONING else content
            tags = _WATCHED[self.phase]
            found = min(((i, tag) for tag in tags if (i := buf.find(tag)) >= 0), default=None)
            if found is None:
                keep = max((k for tag in tags for k in range(1, len(tag)) if buf.endswith(tag[:k])), default=0)
                out.append(buf[: len(buf) - keep])
                self._held = buf[len(buf) - keep :]
                break
            i, tag = found
            out.append(buf[:i])
            buf = buf[i + len(tag) :]
            if tag == END:
                self.phase = Phase.CONTENT
            elif self.phase is Phase.BEFORE:
                self.phase, self.reasoned = Phase.REASONING, True
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The end of the output: the held-back text, as (reasoning, content)."""
        held, self._held = self._held, ""
        return (held, "") if self.phase is Phase.REASONING else ("", held)


@dataclass(frozen=True)
class Reasoning:
    """How a chat request's output is split (ParsedRequest.reasoning)."""

    start: Phase
    leading: bool = False  # a grammar constrains the output: a think block can only open it
    include: bool = True  # include_reasoning (false: the reasoning is dropped)

    def parser(self) -> ReasoningParser:
        return ReasoningParser(self.start, self.leading)

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole output -> (its reasoning, None when it has none, and its content)."""
        parser = self.parser()
        reasoning, content = parser.feed(text)
        more, rest = parser.finish()
        return (reasoning + more if parser.reasoned else None), content + rest


def start_phase(parser: str, prompt: str) -> Phase:
    """The phase an output of `prompt` starts in (module docstring)."""
    opened, closed = prompt.rfind(START), prompt.rfind(END)
    if opened != closed:  # (both -1 when the prompt has neither)
        return Phase.REASONING if opened > closed else Phase.BEFORE
    return Phase.REASONING if parser == "deepseek_r1" else Phase.BEFORE


def request_reasoning(
    parser: str | None, prompt: str, include: bool | None, structured: StructuredOutput | None
) -> Reasoning | None:
    """A chat request's split (None: no --reasoning-parser, its output is all content)."""
    if parser is None:
        return None
    return Reasoning(start_phase(parser, prompt), leading=structured is not None, include=include is not False)


def after_reasoning(spec: StructuredOutput, start: Phase, param: str) -> StructuredOutput:
    """`spec` applied once the reasoning ends (module docstring); a 400 naming `param` if it cannot be."""
    block = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": END}
    if start is Phase.BEFORE:
        block = {"type": "optional", "content": {**block, "begin": START}}
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [block, _format(spec, param)]}}
    return StructuredOutput(kind="structural_tag", spec=json.dumps(tag, ensure_ascii=False))


def _format(spec: StructuredOutput, param: str) -> dict:
    """`spec` as an element of an xgrammar structural tag."""
    from actors.engine.grammar import _choice_ebnf  # (the `sluice` command imports this module: it stays light)

    match spec.kind:
        case "json" | "json_object":
            schema = json.loads(spec.spec) if spec.kind == "json" else {"type": "object"}
            return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}  # (no whitespace loops)
        case "regex":
            return {"type": "regex", "pattern": spec.spec}
        case "grammar":
            return {"type": "grammar", "grammar": spec.spec}
        case "choice":
            return {"type": "grammar", "grammar": _choice_ebnf(json.loads(spec.spec))}
    fmt = json.loads(spec.spec).get("format")  # structural_tag
    if not isinstance(fmt, dict):
        raise RequestError(400, f'{param} must be {{"type": "structural_tag", "format": {{...}}}}', param)
    return fmt
