"""JSON-schema keywords xgrammar would not enforce are refused (actors/engine/json_schema.py): each refused case is
shown to be needed (xgrammar 0.2.8's grammar for it lets a violating value through), each
is found by its path in nested schemas and in structural tags, and Grammars.compile refuses the spec; what xgrammar
does enforce passes."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from actors.engine.grammar import GrammarError, grammars
from actors.engine.json_schema import structural_tag_schemas, unsupported
from messages.sampling_params import StructuredOutput
from tests.cancel_harness import model_dir  # noqa: F401 (fixture)

EOS, VOCAB = 2, 49152  # the tiny model's
INT_ARRAY = {"type": "array", "items": {"type": "integer"}}
AB = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
# name: (schema, a value the schema forbids that xgrammar's grammar accepts, what the refusal names)
REFUSED = {
    "not": ({"type": "integer", "not": {"const": 1}}, 1, "'not'"),
    "if-then": ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 6}}, 9, "'if'"),
    "contains": (INT_ARRAY | {"contains": {"const": 5}}, [1], "'contains'"),
    "uniqueItems": (INT_ARRAY | {"uniqueItems": True}, [1, 1], "'uniqueItems'"),
    "dependentRequired": (AB | {"dependentRequired": {"a": ["b"]}}, {"a": 1}, "'dependentRequired'"),
    "dependencies": (AB | {"dependencies": {"a": ["b"]}}, {"a": 1}, "'dependencies'"),
    "allOf": ({"allOf": [{"type": "integer", "minimum": 1}, {"maximum": 3}]}, 7, "'allOf'"),
    "beside-anyOf": (AB | {"required": ["a"], "anyOf": [{"required": ["b"]}, {}]}, {"b": 1}, "beside 'anyOf'"),
    "beside-allOf": ({"type": "integer", "maximum": 3, "allOf": [{"minimum": 0}]}, 7, "'maximum' beside 'allOf'"),
    "beside-ref": ({"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x", "maximum": 3}, 7, "beside '$ref'"),
    "enum-of-another-type": ({"type": "string", "enum": ["a", 1]}, 1, "'type' beside 'enum'"),
    "beside-enum": ({"type": "string", "maxLength": 1, "enum": ["a", "bb"]}, "bb", "'maxLength' beside 'enum'"),
    "multipleOf-number": ({"type": "number", "multipleOf": 0.5}, 0.3, "'multipleOf'"),
    "multipleOf-untyped": ({"multipleOf": 3}, 4, "'multipleOf'"),
    "pattern-length": ({"type": "string", "pattern": "^[a-c]+$", "maxLength": 2}, "abcabc", "'maxLength'"),
    "format-length": ({"type": "string", "format": "email", "maxLength": 5}, "ab@example.com", "beside"),
    "unknown-format": ({"type": "string", "format": "bogus"}, "x", "'format'"),
    "untyped-format": ({"format": "bogus"}, "x", "'format'"),
    "remote-ref": ({"$ref": "http://example.com/s.json"}, 1, "'$ref'"),
}
ENFORCED = {  # what xgrammar does enforce: (schema, a value it must refuse)
    "multipleOf-integer": ({"type": "integer", "multipleOf": 3}, 4),
    "one-allOf": ({"allOf": [{"type": "integer", "maximum": 3}]}, 7),
    "oneOf-disjoint": ({"oneOf": [{"const": 1}, {"const": 2}]}, 3),
    "described-anyOf": ({"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None, "title": "X"}, "s"),
    "typed-enum": ({"type": "string", "enum": ["a", "b"], "title": "Color"}, "c"),  # pydantic's enums
    "email": ({"type": "string", "format": "email"}, "nope"),
    "pattern": ({"type": "string", "pattern": "^[a-c]+$"}, "xyz"),
    "local-ref": ({"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x", "description": "d"}, "s"),
    "integer-format": ({"type": "integer", "format": "int32"}, 1.5),  # (an annotation: the type still holds)
    "bounded-array": (INT_ARRAY | {"minItems": 2, "maxItems": 3}, [1]),
    "required": (AB | {"required": ["a"]}, {"b": 1}),
}


@pytest.fixture(scope="module")
def compiler(model_dir):  # noqa: F811
    return grammars(str(model_dir), VOCAB, (EOS,))


def matches(compiler, schema: dict, value) -> bool:
    """Whether xgrammar's grammar for `schema` accepts `value` written as the engine writes JSON (json.dumps's
    separators, no other whitespace)."""
    compiled = compiler._compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    m = xgr.GrammarMatcher(compiled)
    return m.accept_string(json.dumps(value)) and m.accept_token(EOS)


@pytest.mark.parametrize("name", REFUSED)
def test_each_refused_keyword_is_one_xgrammar_does_not_enforce(compiler, name):
    schema, violating, named = REFUSED[name]
    assert matches(compiler, schema, violating), "xgrammar enforces it now: the rule can go"
    problem = unsupported(schema)
    assert problem is not None and named in problem and "not supported" in problem, problem
    with pytest.raises(GrammarError, match="not supported"):
        compiler.compile(StructuredOutput(kind="json", spec=json.dumps(schema)))


@pytest.mark.parametrize("name", ENFORCED)
def test_what_xgrammar_enforces_is_accepted(compiler, name):
    schema, violating = ENFORCED[name]
    assert unsupported(schema) is None
    assert not matches(compiler, schema, violating)
    compiler.compile(StructuredOutput(kind="json", spec=json.dumps(schema)))


def test_found_by_path_anywhere_but_never_in_names_or_values():
    nested = {
        "type": "object",
        "properties": {
            "not": {"type": "integer"},  # a property named like a keyword is a name
            "tags": {"anyOf": [{"type": "null"}, INT_ARRAY | {"uniqueItems": True}]},
        },
        "default": {"not": 1},  # values are not schemas
    }
    assert unsupported(nested) == (
        "properties.tags.anyOf[1]: 'uniqueItems' is not supported (the grammar engine cannot enforce it)"
    )
    del nested["properties"]["tags"]
    assert unsupported(nested) is None
    assert unsupported({"$defs": {"x": {"not": {}}}}).startswith("$defs.x: 'not'")
    assert unsupported({"items": [{"type": "string"}, {"if": {}}]}).startswith("items[1]: 'if'")
    assert unsupported({"uniqueItems": False}) is None and unsupported({"allOf": [{}], "title": "t"}) is None


def test_structural_tags_are_checked_schema_by_schema(compiler):
    good, bad = {"type": "object"}, {"type": "object", "properties": {"a": {"not": {}}}}
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<tool_call>"],
            "tags": [
                {
                    "type": "tag",
                    "begin": f"<tool_call>{n}",
                    "content": {"type": "json_schema", "json_schema": s},
                    "end": "</tool_call>",
                }
                for n, s in (("a", good), ("b", bad))
            ],
        },
    }
    assert list(structural_tag_schemas(tag)) == [good, bad]
    with pytest.raises(GrammarError, match=r"properties\.a: 'not' is not supported"):
        compiler.compile(StructuredOutput(kind="structural_tag", spec=json.dumps(tag)))
    tag["format"]["tags"].pop()
    compiler.compile(StructuredOutput(kind="structural_tag", spec=json.dumps(tag)))
