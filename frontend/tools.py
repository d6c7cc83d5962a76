"""Chat tools (issue 15): `tools` and `tool_choice` -> the tools the chat template renders, and the grammar that
makes the output a valid call; the output is then parsed into `message.tool_calls` (frontend/tool_parser.py).

Calls follow the Hermes convention, `<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>` (Qwen,
Hermes and most open chat templates), as an xgrammar structural tag whose ARGS is constrained by the function's
`parameters` schema:

  tool_choice                    grammar                                           finish_reason with calls
  "none" (default without tools) none: the output is content (tools still rendered) -
  "auto" (default with tools)    text, and any call the model starts is a valid one tool_calls
                                 (needs --enable-auto-tool-choice --tool-call-parser hermes, as vLLM; else a 400)
  "required"                     one or more calls and nothing else                tool_calls
  {"type": "function", ...}      exactly one call of that function                 tool_calls
`parallel_tool_calls: false` allows one call at most.
"""

from __future__ import annotations

import json
import re

from frontend.body import RequestError
from messages.sampling_params import StructuredOutput

TOOL_CALL_PARSERS = ("hermes",)
MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_BEGIN, _END = '<tool_call>\n{{"name": {}, "arguments": ', "}\n</tool_call>"


def tool_grammar(req, auto_tool_parser: str | None) -> tuple[list[dict] | None, StructuredOutput | None, bool]:
    """(the tools for the chat template, the grammar of the output, whether to parse tool calls out of it)."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise RequestError(400, "tool_choice needs tools", "tool_choice")
        return None, None, False
    tools = _tools(req.tools)
    choice = "auto" if choice is None else choice
    if choice == "none":
        return tools, None, False
    one = req.parallel_tool_calls is False
    if choice == "auto":
        if auto_tool_parser is None:
            raise RequestError(
                400,
                'tool_choice "auto" requires the server to run with --enable-auto-tool-choice and --tool-call-parser',
                "tool_choice",
            )
        fmt = _format("triggered_tags", tools, one, triggers=["<tool_call>"], at_least_one=False)
    elif choice == "required":
        fmt = _format("tags_with_separator", tools, one, separator="\n", at_least_one=True)
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        named = [t for t in tools if t["function"]["name"] == name]
        if not named:
            raise RequestError(400, f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        fmt = _tag(named[0])
    else:
        raise RequestError(
            400, 'tool_choice must be "none", "auto", "required" or {"type": "function", ...}', "tool_choice"
        )
    return (
        tools,
        StructuredOutput(kind="structural_tag", spec=json.dumps({"type": "structural_tag", "format": fmt})),
        True,
    )


def _tools(value) -> list[dict]:
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise RequestError(400, f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    names = set()
    for i, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict):
            raise RequestError(400, f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise RequestError(400, f"tools[{i}].function.name must match {_NAME.pattern}", f"tools[{i}].function.name")
        if name in names:
            raise RequestError(400, f"tools[{i}].function.name {name!r} is not unique", f"tools[{i}].function.name")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise RequestError(400, f"tools[{i}].function.parameters must be a JSON schema object", f"tools[{i}]")
    return value


def _tag(tool: dict) -> dict:
    fn = tool["function"]
    schema = fn.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "tag",
        "begin": _BEGIN.format(json.dumps(fn["name"])),
        "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1},  # no whitespace loops
        "end": _END,
    }


def _format(kind: str, tools: list[dict], one: bool, **options) -> dict:
    return {"type": kind, "tags": [_tag(t) for t in tools], "stop_after_first": one, **options}
