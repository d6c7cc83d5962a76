"""Responses input items -> chat messages, function tools -> chat tools: what the chat template renders.

`input` is a string (one user message) or a list of items, each checked here (a 400 names `input[i]...`) and kept
as an item of the conversation with only the keys below (`type` made explicit, an `id` added where it has none, a
`status` kept when it is one of the API's, string content as one text part, a part's own keys only), which is what
`input_items` lists and `previous_response_id` carries on. Nothing else an item holds is kept: what is stored is
what is rendered, or what the API lists (a response's own output items are kept so too for its continuation,
without their logprobs: `continued`). `id` and `call_id` are strings of at most MAX_ID characters.

  item                                                  chat message
  {"type": "message"?, "role", "content"}               {"role", "content"}: user, system, developer (-> system)
                                                        with input_text parts; assistant with output_text or
                                                        refusal parts; a string is one part
  {"type": "function_call", "call_id", "name",          a tool call of an assistant message: consecutive calls
   "arguments"}                                         join the assistant message just before them, if any
  {"type": "function_call_output", "call_id", "output"} {"role": "tool", "tool_call_id", "content"}
  {"type": "reasoning", ...}                            none: templates drop earlier turns' reasoning (as chat);
                                                        kept as {"type", "id", "summary": []}, its text dropped

Images, files, audio, hosted tools' calls and item references are refused, naming the field.
"""

from __future__ import annotations

import uuid

from frontend.body import RequestError

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_PARTS = {"assistant": ("output_text", "refusal")}  # a role's text parts (other roles: input_text)
_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
STATUSES = ("in_progress", "completed", "incomplete")
MAX_ID = 256  # characters of an item's id or call_id


def new_id(kind: str) -> str:
    return f"{_PREFIX[kind]}_{uuid.uuid4().hex}"


def input_items(value) -> list[dict]:
    """`input` checked and made items (module docstring)."""
    if isinstance(value, str):
        return [{"type": "message", "id": new_id("message"), "role": "user", "content": _text_parts(value)}]
    if not isinstance(value, list) or not value:
        raise RequestError(400, "input must be a string or a non-empty list of items", "input")
    return kept(value, "input")


def continued(output: list[dict]) -> list[dict]:
    """A response's output items as its continuation carries them on: as input items are kept (no logprobs)."""
    return kept(output, "output")


def kept(items: list, field: str) -> list[dict]:
    """Items checked and kept with their own keys only (module docstring); a 400 names `field[i]...`."""
    return [_item(item, f"{field}[{i}]") for i, item in enumerate(items)]


def _item(item, field: str) -> dict:
    if not isinstance(item, dict):
        raise RequestError(400, f"{field} must be an object", field)
    kind = item.get("type", "message")
    if not isinstance(kind, str) or kind not in _PREFIX:
        raise RequestError(
            400, f"{field}.type {kind!r} is not supported: message, function_call, function_call_output or reasoning",
            f"{field}.type",
        )  # fmt: skip
    kept = {"type": kind, "id": _id(item, field, "id", new_id(kind))}
    if (status := item.get("status")) in STATUSES:
        kept["status"] = status
    if kind == "message":
        return kept | _message(item, field)
    if kind == "function_call":
        _strings(item, field, "name", "arguments")
        return kept | {"call_id": _id(item, field, "call_id"), "name": item["name"], "arguments": item["arguments"]}
    if kind == "function_call_output":
        output = item.get("output")
        if isinstance(output, list):
            output = _join(_parts(output, f"{field}.output", ("input_text",)))
        elif not isinstance(output, str):
            raise RequestError(400, f"{field}.output must be a string or a list of input_text parts", f"{field}.output")
        return kept | {"call_id": _id(item, field, "call_id"), "output": output}
    return kept | {"summary": []}  # reasoning: never rendered


def _message(item: dict, field: str) -> dict:
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise RequestError(400, f"{field}.role must be one of {', '.join(ROLES)}; got {role!r}", f"{field}.role")
    content = item.get("content")
    if isinstance(content, str):
        content = _text_parts(content, "output_text" if role == "assistant" else "input_text")
    else:
        content = _parts(content, f"{field}.content", _PARTS.get(role, ("input_text",)))
    return {"role": role, "content": content}


def _text_parts(text: str, kind: str = "input_text") -> list[dict]:
    return [{"type": kind, "text": text} | ({"annotations": []} if kind == "output_text" else {})]


def _parts(parts, field: str, kinds: tuple[str, ...]) -> list[dict]:
    """A list of text parts of `kinds`, each with its own keys only (a 400 naming the part otherwise)."""
    if not isinstance(parts, list):
        raise RequestError(400, f"{field} must be a string or a list of content parts", field)
    kept = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if kind == "refusal" else "text"
        if kind not in kinds or not isinstance(part.get(key), str):
            raise RequestError(
                400, f"{field}[{j}] must be a {' or '.join(kinds)} part (images, files and audio are not supported)",
                f"{field}[{j}]",
            )  # fmt: skip
        kept.append({"type": kind, key: part[key]} if kind != "output_text" else _text_parts(part[key], kind)[0])
    return kept


def _join(parts: list[dict]) -> str:
    """The text of kept parts."""
    return "\n".join(part["refusal"] if part["type"] == "refusal" else part["text"] for part in parts)


def _id(item: dict, field: str, key: str, default: str | None = None) -> str:
    value = item.get(key, default)
    if not isinstance(value, str) or len(value) > MAX_ID:
        raise RequestError(400, f"{field}.{key} must be a string of at most {MAX_ID} characters", f"{field}.{key}")
    return value


def _strings(item: dict, field: str, *keys: str) -> None:
    for key in keys:
        if not isinstance(item.get(key), str):
            raise RequestError(400, f"{field}.{key} must be a string", f"{field}.{key}")


def chat_messages(items: list[dict]) -> tuple[list[dict], list[int]]:
    """The conversation's items (checked) as chat messages, and the index of the item each message starts at."""
    messages: list[dict] = []
    starts: list[int] = []
    joins = False  # a call joins the assistant message before it (or the call before it)
    for i, item in enumerate(items):
        kind = item["type"]
        if kind == "message":
            role = item["role"]
            messages.append({"role": ROLES[role], "content": _join(item["content"])})
            starts.append(i)
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            if joins:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                starts.append(i)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
            starts.append(i)
        if kind != "reasoning":
            joins = kind == "function_call" or (kind == "message" and item["role"] == "assistant")
    return messages, starts


def chat_tools(tools) -> list[dict] | None:
    """Function tools in chat's shape; any other tool (web_search, file_search, ...) is refused, naming it."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError(400, "tools must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise RequestError(
                400, f"tools[{i}].type {kind!r} is not supported: only function tools (no hosted tools)",
                f"tools[{i}].type",
            )  # fmt: skip
        function = {k: v for k, v in tool.items() if k in ("name", "description", "parameters", "strict")}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice):
    """tool_choice in chat's shape: "none", "auto", "required" or {"type": "function", "name"}."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "name"}',
                       "tool_choice")  # fmt: skip
