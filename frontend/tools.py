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

The parameters of every tool in the grammar (all of them, or the named one) must be enforceable: a keyword
xgrammar would not enforce (actors/engine/json_schema.py) is a 400 naming `tools[i].function.parameters` at once.
A schema xgrammar refuses is found by compiling (frontend/structured.py `compile_check`): the named tool's field
is named; with several tools, `tool_parameters` splits the grammar into each tool's schema, compiled one by one
to name the first that fails.
"""

from __future__ import annotations

import json
import re

from actors.engine.json_schema import unsupported
from frontend.body import RequestError, json_field
from messages.sampling_params import StructuredOutput

TOOL_CALL_PARSERS = ("hermes",)
MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_BEGIN, _END = '<tool_call>\n{{"name": {}, "arguments": ', "}\n</tool_call>"


def tool_grammar(req, auto_tool_parser: str | None) -> tuple[list[dict] | None, StructuredOutput | None, str | None]:
    """(the tools for the chat template, the grammar of the output (None: no calls; else they are parsed out of
    it), the field a compile error of the grammar names: "tools" (every tool, `tool_parameters`) or the named
    tool's `parameters`)."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise RequestError(400, "tool_choice needs tools", "tool_choice")
        return None, None, None
    tools = validate_tools(req.tools)
    choice = "auto" if choice is None else choice
    if choice == "none":
        return tools, None, None
    param = "tools"
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
        i = next((i for i, t in enumerate(tools) if t["function"]["name"] == name), None)
        if i is None:
            raise RequestError(400, f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        fmt, param = _tag(tools[i], i), _parameters(i)
    else:
        raise RequestError(
            400, 'tool_choice must be "none", "auto", "required" or {"type": "function", ...}', "tool_choice"
        )
    return (
        tools,
        StructuredOutput(kind="structural_tag", spec=json.dumps({"type": "structural_tag", "format": fmt})),
        param,
    )


def tool_parameters(spec: StructuredOutput) -> list[tuple[str, StructuredOutput]]:
    """A grammar of every tool (field "tools") split into each tool's parameters schema, with its field."""
    fmt = json.loads(spec.spec)["format"]
    if fmt["type"] == "sequence":  # the calls come after a reasoning block (frontend/reasoning.py)
        fmt = fmt["elements"][-1]
    tags = fmt["tags"]
    return [
        (_parameters(i), StructuredOutput(kind="json", spec=json.dumps(tag["content"]["json_schema"])))
        for i, tag in enumerate(tags)
    ]


def validate_tools(value) -> list[dict]:
    """`tools` checked (a 400 naming the field at fault), for the chat template."""
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise RequestError(400, f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    names = set()
    for i, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict):
            raise RequestError(400, f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', f"tools[{i}]")
        json_field(tool, f"tools[{i}]")  # (rendered by the template, walked for its parameters)
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise RequestError(400, f"tools[{i}].function.name must match {_NAME.pattern}", f"tools[{i}].function.name")
        if name in names:
            raise RequestError(400, f"tools[{i}].function.name {name!r} is not unique", f"tools[{i}].function.name")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise RequestError(400, f"{_parameters(i)} must be a JSON schema object", _parameters(i))
    return value


def _parameters(i: int) -> str:
    return f"tools[{i}].function.parameters"


def _tag(tool: dict, i: int) -> dict:
    """Tool i's call; a 400 if its parameters use a keyword the grammar would not enforce."""
    fn = tool["function"]
    schema = fn.get("parameters") or {"type": "object", "properties": {}}
    if problem := unsupported(schema, _parameters(i)):
        raise RequestError(400, problem, _parameters(i))
    return {
        "type": "tag",
        "begin": _BEGIN.format(json.dumps(fn["name"])),
        "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1},  # no whitespace loops
        "end": _END,
    }


def _format(kind: str, tools: list[dict], one: bool, **options) -> dict:
    return {"type": kind, "tags": [_tag(t, i) for i, t in enumerate(tools)], "stop_after_first": one, **options}
