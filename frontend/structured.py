"""The request fields that constrain the output to a grammar, read into one StructuredOutput (issue 15).

At most one of them per request (a 400 names the second):
- OpenAI's `response_format`: {"type": "text"} (unconstrained), {"type": "json_object"}, or {"type": "json_schema",
  "json_schema": {"name", "schema", "strict", "description"}} (no schema: any JSON object). Every output
  validates against the schema whatever `strict` says (the compiler's strict mode only narrows it further).
- vLLM's `structured_outputs`: exactly one of `json` (a schema, as an object or its JSON text), `regex`, `choice`
  (a list of strings), `grammar` (EBNF / GBNF, root rule `root`), `json_object` (true), `structural_tag`
  (xgrammar's, as an object or its JSON text); and its older spellings `guided_json`, `guided_regex`,
  `guided_choice`, `guided_grammar`, with `guided_decoding_backend` null, "auto" or "xgrammar" (the only engine).
- Chat `tools` with `tool_choice` (frontend/tools.py), read there into the same StructuredOutput.

Parsing only reads the fields (it may run on the event loop); `compile_check` compiles the spec off the loop
within `ServingContext.grammar_timeout_s`, so an invalid or too slow spec is a 400 naming its field before
anything reaches the engine, and nothing blocks the loop; when every compile thread stays busy with other
grammars for that long, a 429 (`grammar_compiler_busy`: retry), since the spec was never tried. A grammar of
several tools that does not compile names the first tool whose parameters do not compile on their own (compiled
one by one within the same deadline; when none is found in time, `tools`).
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

from actors.engine.grammar import GrammarBusy, GrammarError, grammars
from frontend.body import RequestError, json_field
from frontend.tools import tool_parameters
from messages.sampling_params import GrammarKind, StructuredOutput

_KEYS: dict[str, GrammarKind] = {
    "json": "json",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
    "structural_tag": "structural_tag",
}
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
BACKENDS = (None, "auto", "xgrammar")
# compile_check's waits (up to twice the timeout each) on threads of their own, not the loop's default executor
# (which parses request bodies)
_WAITERS = ThreadPoolExecutor(64, thread_name_prefix="sluice-grammar-wait")


def structured_output(req) -> tuple[StructuredOutput | None, str | None]:
    """The request's StructuredOutput (None: unconstrained) and the field it came from."""
    found: list[tuple[StructuredOutput, str]] = []
    if (fmt := _response_format(req.response_format)) is not None:
        found.append(fmt)
    if req.structured_outputs is not None:
        found.append(_structured_outputs(req.structured_outputs))
    for field, kind in _GUIDED.items():
        if (value := getattr(req, field)) is not None:
            found.append((_spec(kind, value, field), field))
    if req.guided_decoding_backend not in BACKENDS:
        raise RequestError(400, "guided_decoding_backend must be null, 'auto' or 'xgrammar'", "guided_decoding_backend")
    if len(found) > 1:
        first, second = found[0][1], found[1][1]
        raise RequestError(400, f"{second}: only one of {first} and {second} may be given", second)
    return found[0] if found else (None, None)


async def compile_check(spec: StructuredOutput, param: str, ctx) -> None:
    """Compile `spec` off the event loop within ctx.grammar_timeout_s; a 400 naming `param` (or the tool at
    fault, module docstring) if it is invalid."""
    loop = asyncio.get_running_loop()
    compiler = await loop.run_in_executor(
        None, grammars, ctx.model_dir, ctx.vocab_size, tuple(ctx.tokenizer.eos_token_ids)
    )
    deadline = loop.time() + ctx.grammar_timeout_s
    if (error := await _check(compiler, spec, ctx.grammar_timeout_s)) is None:
        return
    if isinstance(error, GrammarBusy):  # the server's state, not the spec's fault: a 429, to be retried
        raise RequestError(429, str(error), type="rate_limit_error", code="grammar_compiler_busy") from error
    parts = tool_parameters(spec) if param == "tools" else []
    for part_param, part in parts:
        if (left := deadline - loop.time()) <= 0:
            break
        part_error = await _check(compiler, part, left)
        if part_error is not None and not isinstance(part_error, GrammarBusy) and loop.time() < deadline:
            param, error = part_param, part_error
            break
    raise RequestError(400, f"{param}: {error}", param) from error


async def _check(compiler, spec: StructuredOutput, timeout: float) -> GrammarError | None:
    try:
        await asyncio.get_running_loop().run_in_executor(_WAITERS, compiler.check, spec, timeout)
    except GrammarError as e:
        return e
    return None


def _response_format(value) -> tuple[StructuredOutput, str] | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(kind="json_object"), "response_format"
    if kind == "json_schema":
        body = value.get("json_schema")
        if not isinstance(body, dict):
            raise RequestError(400, "response_format.json_schema must be an object", "response_format.json_schema")
        schema, param = body.get("schema"), "response_format.json_schema.schema"
        return (StructuredOutput(kind="json_object") if schema is None else _spec("json", schema, param)), param
    raise RequestError(
        400, "response_format.type must be 'text', 'json_object' or 'json_schema'", "response_format.type"
    )


def _structured_outputs(value) -> tuple[StructuredOutput, str]:
    if not isinstance(value, dict):
        raise RequestError(400, "structured_outputs must be an object", "structured_outputs")
    unknown = sorted(set(value) - set(_KEYS) - {"disable_any_whitespace"})
    if unknown:
        param = f"structured_outputs.{unknown[0]}"
        raise RequestError(400, f"{param} is not supported (one of {', '.join(_KEYS)})", param)
    if value.get("disable_any_whitespace") not in (None, True):  # JSON is always compact here (grammar.py)
        param = "structured_outputs.disable_any_whitespace"
        raise RequestError(400, f"{param}: only true is supported (the output JSON is always compact)", param)
    given = [k for k in _KEYS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise RequestError(400, f"structured_outputs needs exactly one of {', '.join(_KEYS)}", "structured_outputs")
    key = given[0]
    return _spec(_KEYS[key], value[key], f"structured_outputs.{key}"), f"structured_outputs.{key}"


def _spec(kind: GrammarKind, value, param: str) -> StructuredOutput:
    """The spec text of one constraint, its shape checked (its language is checked by compiling it)."""
    if kind in ("json", "structural_tag"):
        value = json_field(value, param)  # (JSON text in a string, parsed as bodies are)
        if not isinstance(value, dict) and not (kind == "json" and isinstance(value, bool)):
            raise RequestError(400, f"{param} must be a JSON object", param)
        return StructuredOutput(kind=kind, spec=json.dumps(value, ensure_ascii=False))
    if kind == "json_object":
        return StructuredOutput(kind=kind)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise RequestError(400, f"{param} must be a non-empty list of strings", param)
        return StructuredOutput(kind=kind, spec=json.dumps(value, ensure_ascii=False))
    if not isinstance(value, str) or not value:
        raise RequestError(400, f"{param} must be a non-empty string", param)
    return StructuredOutput(kind=kind, spec=value)
