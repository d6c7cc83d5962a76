"""The JSON-schema keywords xgrammar (0.2.8) compiles into no constraint, found before compiling (issue 15).

xgrammar accepts these and then lets a violating value through (each measured: tests/test_json_schema.py
shows the compiled grammar accepting a value the keyword forbids), so a schema using one would be accepted
and not honoured. `unsupported(schema)` names the first by its path in the schema; `Grammars.compile` refuses
the spec with it (over HTTP: a 400 naming the request field). Refused:

- `not`; `if` / `then` / `else`; `contains`, `minContains`, `maxContains`; `uniqueItems: true`;
  `dependentRequired`, `dependentSchemas`, `dependencies`;
- `allOf` with more than one subschema (one is fine: pydantic wraps a described `$ref` in it);
- a constraint beside `anyOf`, `oneOf`, `allOf`, `$ref`, `enum` or `const` (xgrammar keeps only that keyword;
  annotations beside it are fine, and so is a `type` that every `enum` / `const` value has);
- `multipleOf` except a whole number on `"type": "integer"`;
- `minLength` / `maxLength` beside `pattern` or `format` (the length is dropped);
- a string `format` xgrammar does not know (it would be no constraint at all; JSON Schema makes `format` an
  annotation, but a client sending one on a string means it; OpenAPI's `int32`, `int64`, `float`, `double` on
  numbers stay annotations);
- a `$ref` outside the schema (`#...` only: nothing is fetched).

Accepted as xgrammar reads it: `oneOf` is enforced as `anyOf` (a value matching two branches passes; pydantic's
discriminated unions, the common use, have disjoint branches). Annotations (`title`, `description`, `examples`,
`default`, `$comment`, `contentEncoding`, ...) constrain nothing in JSON Schema and are ignored.
"""

from __future__ import annotations

from collections.abc import Iterator

STRING_FORMATS = frozenset(
    ("email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri", "uri-reference",
     "uri-template", "json-pointer", "relative-json-pointer")
)  # fmt: skip
NEVER = ("not", "if", "then", "else", "contains", "minContains", "maxContains", "dependentRequired",
         "dependentSchemas", "dependencies")  # fmt: skip
ALONE = ("anyOf", "oneOf", "allOf", "$ref", "enum", "const")  # xgrammar drops every constraint beside these
CONSTRAINTS = frozenset(
    ("type", "properties", "required", "additionalProperties", "patternProperties", "propertyNames", "minProperties",
     "maxProperties", "items", "prefixItems", "additionalItems", "unevaluatedItems", "unevaluatedProperties",
     "minItems", "maxItems", "uniqueItems", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
     "multipleOf", "minLength", "maxLength", "pattern", "format", *NEVER, *ALONE)
)  # fmt: skip
ONE_SCHEMA = ("items", "additionalItems", "additionalProperties", "propertyNames", "unevaluatedItems",
              "unevaluatedProperties", "contains", "not", "if", "then", "else")  # fmt: skip
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}


def unsupported(schema, path: str = "") -> str | None:
    """'<path>: <why>' for the first keyword of `schema` xgrammar would not enforce, or None."""
    if not isinstance(schema, dict):
        return None
    here = path or "the schema"
    if problem := _keyword(schema):
        return f"{here}: {problem} is not supported (the grammar engine cannot enforce it)"
    for key, sub in _subschemas(schema):
        if problem := unsupported(sub, f"{path}.{key}" if path else key):
            return problem
    return None


def structural_tag_schemas(tag) -> Iterator[dict]:
    """Every JSON schema inside an xgrammar structural tag (the values of its `json_schema` keys)."""
    if isinstance(tag, dict):
        for key, value in tag.items():
            if key == "json_schema" and isinstance(value, dict):
                yield value
            else:
                yield from structural_tag_schemas(value)
    elif isinstance(tag, list):
        for value in tag:
            yield from structural_tag_schemas(value)


def _keyword(s: dict) -> str | None:
    if found := next((k for k in NEVER if k in s), None):
        return f"'{found}'"
    if s.get("uniqueItems") is True:
        return "'uniqueItems'"
    if isinstance(s.get("allOf"), list) and len(s["allOf"]) > 1:
        return "'allOf' with more than one subschema"
    if alone := next((k for k in ALONE if k in s), None):
        beside = sorted(CONSTRAINTS.intersection(s) - {alone} - ({"type"} if _typed_values(s, alone) else set()))
        if beside:
            return f"'{beside[0]}' beside '{alone}'"
    if "multipleOf" in s and not (s.get("type") == "integer" and _whole(s["multipleOf"])):
        return "'multipleOf' (only a whole number on an integer type is)"
    length = next((k for k in ("minLength", "maxLength") if k in s), None)
    if length and (shape := next((k for k in ("pattern", "format") if k in s), None)):
        return f"'{length}' beside '{shape}'"
    if "format" in s and s["format"] not in STRING_FORMATS and _may_be_string(s):
        return f"'format': {s['format']!r} (known: {', '.join(sorted(STRING_FORMATS))})"
    if isinstance(s.get("$ref"), str) and not s["$ref"].startswith("#"):
        return f"'$ref' outside the schema ({s['$ref']!r})"
    return None


def _typed_values(s: dict, alone: str) -> bool:
    """`enum` / `const` whose every value has the schema's `type` (which then constrains nothing more)."""
    if alone not in ("enum", "const"):
        return False
    values = s["enum"] if alone == "enum" else [s["const"]]
    types = s.get("type") if isinstance(s.get("type"), list) else [s.get("type")]
    return isinstance(values, list) and all(any(_has_type(v, t) for t in types) for v in values)


def _has_type(value, t) -> bool:
    if t == "null":
        return value is None
    if isinstance(value, bool):
        return t == "boolean"
    if t == "integer" and isinstance(value, float):
        return value.is_integer()
    return t in TYPES and isinstance(value, TYPES[t])


def _subschemas(s: dict) -> Iterator[tuple[str, object]]:
    for key in ONE_SCHEMA:
        if isinstance(s.get(key), dict):
            yield key, s[key]
    for key in SCHEMA_LISTS:
        if isinstance(s.get(key), list):
            yield from ((f"{key}[{i}]", sub) for i, sub in enumerate(s[key]))
    for key in SCHEMA_MAPS:
        if isinstance(s.get(key), dict):
            yield from ((f"{key}.{name}", sub) for name, sub in s[key].items())


def _may_be_string(s: dict) -> bool:
    t = s.get("type")
    return t is None or t == "string" or (isinstance(t, list) and "string" in t)


def _whole(x) -> bool:
    return isinstance(x, int) or (isinstance(x, float) and x.is_integer())
