"""Request bodies: bytes -> a typed msgspec Struct, or a RequestError (400) naming the field.

Strict JSON is checked before any field is read: UTF-8 only, no duplicate keys at any depth (two
values for one key would let a proxy in front of us and Sluice read different requests), no
NaN/Infinity, no integer longer than Python's 4300 digits, no lone UTF-16 surrogate (`"\\ud800"`:
no tokenizer can encode it), nesting no deeper than the interpreter's recursion limit.

Parsing is json's C scanner with Python hooks for numbers and objects, then msgspec's `convert`
validates the types: the hooks let a worker thread drop the GIL between elements, so parsing a
16 MB body off the event loop never stalls it (msgspec's decoder or a hook-free scanner hold the
GIL throughout: 150-300 ms for 16 MB of token ids, measured).

JSON a request carries *inside* a field is held to the same rules, by the same parser: JSON text in a string (a
schema given as text, an assistant's tool-call arguments) and any value walked or rendered after parsing (schemas,
tools, chat messages) must nest at most MAX_JSON_DEPTH lists and objects (`json_field`, `strict_json`): code that
walks a value recursively, or json.dumps it, never meets a RecursionError, and any failure is a 400 naming the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import TypeVar

import msgspec

from frontend.openai_format import error_body, error_type

T = TypeVar("T")

_AT = re.compile(r"(?: - at `key` in | - at )`\$\.?([^`]*)`$")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
MAX_JSON_DEPTH = 64  # lists and objects in a value walked or rendered after parsing (schemas, tools, messages)


class RequestError(Exception):
    """An error answered with an OpenAI error body; `param` names the offending field."""

    def __init__(
        self, status: int, message: str, param: str | None = None, type: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or error_type(status)
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


class _Malformed(ValueError):
    pass


def _object(pairs: list[tuple[str, object]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Malformed(f"duplicate key {key!r}")
            seen.add(key)
    return obj


def _constant(name: str):
    raise _Malformed(f"{name} is not a JSON number")


def _int(s: str) -> int:
    return int(s)  # a Python frame per number: the GIL can change hands (and > 4300 digits raise)


def _float(s: str) -> float:
    return float(s)


def _no_lone_surrogate(obj) -> None:
    try:
        msgspec.json.encode(obj)  # a surrogate pair was joined into one character; a lone one cannot encode
    except UnicodeEncodeError as e:
        raise _Malformed("a string holds a lone UTF-16 surrogate") from e


def strict_json(text: str | bytes, max_depth: int | None = None) -> object:
    """JSON text parsed with the body's guarantees (module docstring), nesting no deeper than `max_depth`
    containers (None: the interpreter's recursion limit); raises ValueError saying what is wrong."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        obj = json.loads(text, object_pairs_hook=_object, parse_int=_int, parse_float=_float, parse_constant=_constant)
        if _SURROGATE_ESCAPE.search(text):
            _no_lone_surrogate(obj)
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 ({e.reason} at byte {e.start})") from e
    except RecursionError as e:
        raise ValueError("nested too deeply") from e
    if max_depth is not None:
        check_depth(obj, max_depth)
    return obj


def check_depth(value, max_depth: int) -> None:
    """Raise ValueError if `value` nests more than `max_depth` lists and objects; level by level, no recursion."""
    level, depth = [value], 0
    while level := [v for v in level if isinstance(v, (dict, list))]:
        depth += 1
        if depth > max_depth:
            raise ValueError(f"nested deeper than {max_depth} levels")
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v)]


def json_field(value, param: str) -> object:
    """A field's JSON value that is walked or rendered later (a schema, tools, a chat message): as it is, or parsed
    from the JSON text in a string, nesting at most MAX_JSON_DEPTH; a 400 naming `param` otherwise."""
    try:
        if isinstance(value, str):
            return strict_json(value, MAX_JSON_DEPTH)
        check_depth(value, MAX_JSON_DEPTH)
    except ValueError as e:
        raise RequestError(400, f"{param} is not valid JSON: {e}", param) from e
    return value


def decode_body(body: bytes, type_: type[T], refused: Mapping[str, Callable[[object], bool | str]] = {}) -> T:
    """`refused`: top-level fields of the API that are not honoured -> whether a value is their no-op (present
    with anything else, the field is refused, naming it; a verdict that is a string says why)."""
    try:
        obj = strict_json(body)
    except ValueError as e:  # JSONDecodeError, _Malformed, an integer too long, not UTF-8, too deep
        raise RequestError(400, f"Invalid JSON body: {e}") from e
    if isinstance(obj, dict):
        for key, noop in refused.items():
            if key in obj and (verdict := noop(obj[key])) is not True:
                why = f": {verdict}" if isinstance(verdict, str) else ""
                raise RequestError(400, f"{key} is not supported{why}", key)
    try:
        return msgspec.convert(obj, type_, str_keys=True)
    except msgspec.ValidationError as e:
        msg = str(e)
        m = _AT.search(msg)
        if m is None:
            top = re.match(r"Object missing required field `([^`]*)`$", msg)  # (a top-level field: named)
            raise RequestError(400, f"Invalid request body: {msg}", top and top.group(1)) from e
        param = m.group(1).replace("[...]", "")  # msgspec's placeholder for a dict value
        missing = re.match(r"Object missing required field `([^`]*)`", msg)
        if missing:
            param = f"{param}.{missing.group(1)}" if param else missing.group(1)
        if "at `key` in" in msg and isinstance(keyed := obj.get(param) if isinstance(obj, dict) else None, dict):
            bad = [repr(k) for k in keyed if not _int_key(k)]  # (logit_bias: the one map keyed by integers)
            says = "is not a token id" if len(bad) == 1 else "are not token ids"
            raise RequestError(400, f"{param}: {', '.join(bad[:8])} {says}", param) from e
        raise RequestError(400, f"Invalid value for '{param}': {msg[: m.start()]}", param) from e
    except RecursionError as e:
        raise RequestError(400, "Invalid JSON body: nested too deeply") from e


def _int_key(key: str) -> bool:
    try:
        msgspec.convert({key: 0}, dict[int, int], str_keys=True)
    except msgspec.ValidationError:
        return False
    return True


def token_ids(value) -> list[int] | None:
    """value as a list of token ids, or None when it is not one."""
    try:
        return msgspec.convert(value, list[int])  # C-speed; rejects bools, floats, nesting
    except msgspec.ValidationError:
        return None
