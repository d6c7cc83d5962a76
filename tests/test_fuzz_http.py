"""Property-based fuzzing of the generation endpoints (completions, chat, responses) (hypothesis, fixed seed): bodies built from
the request fields with hostile values at any depth (JSON text inside string fields too: schemas, tool-call
arguments; tools, tool calls and guidance), raw byte mutations of valid bodies, and random headers. Properties: no response is a 5xx, every response arrives within BOUND_S, the server
counted no 5xx, and canary streams running meanwhile finish with exactly their undisturbed output.

Hypothesis drives a plain blocking HTTP client in a worker thread (it has no asyncio runner), so the
test's event loop keeps reading the canaries meanwhile.
"""

from __future__ import annotations

import asyncio
import collections
import http.client
import json
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.canary import Canary, undisturbed

BOUND_S = 30.0  # liveness: valid fuzz requests are capped at 32 tokens each
EXAMPLES = 300

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30,
)
token_ids = st.lists(st.integers(min_value=-5, max_value=60_000), min_size=0, max_size=12)
# JSON carried as text inside a string field (a schema, tool-call arguments): any value, deep nesting, or not JSON
json_texts = (
    json_values.map(json.dumps) | st.integers(60, 100_000).map(lambda d: "[" * d + "]" * d) | st.text(max_size=9)
)
schemas = json_values | json_texts | st.just({"type": "object", "properties": {"a": {"type": "integer"}}})
tool_calls = st.lists(
    st.fixed_dictionaries(
        {"id": st.text(max_size=4), "type": st.just("function"),
         "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g"]), "arguments": json_texts})}
    ) | json_values,
    max_size=2,
)  # fmt: skip
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "robot"]), "content": st.text(max_size=60)},
    optional={"name": st.text(max_size=8), "tool_calls": tool_calls},
)
tools = st.lists(
    st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["f", "g"])}, optional={"parameters": schemas, "description": st.text(max_size=9)}
        )}
    ),
    max_size=2,
)  # fmt: skip
FIELD_VALUES = {
    "model": st.text(max_size=10),
    "n": st.integers(-2, 4) | json_values,
    "temperature": st.floats(-1, 3) | json_values,
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-3, 100),
    "min_p": st.floats(-0.5, 1.5),
    "seed": st.integers(-(2**70), 2**70),
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=70),
    "stop_token_ids": token_ids,
    "logit_bias": st.dictionaries(st.integers(-5, 60_000).map(str) | st.text(max_size=4), st.floats(-200, 200)),
    "allowed_token_ids": token_ids,
    "bad_words": st.lists(st.text(max_size=8), max_size=5),
    "presence_penalty": st.floats(-3, 3),
    "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 3),
    "min_tokens": st.integers(-1, 40),
    "logprobs": st.integers(-1, 25) | st.booleans(),
    "top_logprobs": st.integers(-1, 25),
    "prompt_logprobs": st.integers(-1, 25),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | json_values}),
    "echo": st.booleans(),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "user": json_values,
    "guided_json": schemas,
    "guided_regex": st.text(max_size=9),
    "structured_outputs": st.fixed_dictionaries(
        {}, optional={"json": schemas, "regex": st.text(max_size=9), "choice": st.lists(st.text(max_size=5))}
    ),
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema"])},
        optional={"json_schema": st.fixed_dictionaries({"name": st.text(max_size=5)}, optional={"schema": schemas})},
    ),
    "tools": tools | json_values,
    "tool_choice": st.sampled_from(["none", "auto", "required"]) | json_values,
    "guidance_scale": st.sampled_from([1, 1.5]) | json_values,
    "negative_prompt": st.text(max_size=9) | token_ids,
}
RESPONSES_VALUES = {  # the Responses API's own fields (and chat's, mostly refused there)
    "instructions": st.text(max_size=20) | json_values,
    "text": st.fixed_dictionaries(
        {},
        optional={
            "format": st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "json_schema", "x"])},
                optional={"name": st.text(max_size=5), "schema": schemas},
            )
        },
    )
    | json_values,
    "tools": st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["function", "web_search"]), "name": st.sampled_from(["f", "g"])},
            optional={"parameters": schemas},
        ),
        max_size=2,
    )
    | json_values,
    "tool_choice": st.sampled_from(["none", "required"]) | json_values,
    "previous_response_id": st.text(max_size=12) | json_values,
    "background": st.booleans() | json_values,
    "store": st.booleans() | json_values,
    "include": st.lists(st.sampled_from(["message.output_text.logprobs", "x"]), max_size=2) | json_values,
    "metadata": st.dictionaries(st.text(max_size=70), st.text(max_size=600), max_size=18) | json_values,
    "reasoning": st.fixed_dictionaries({}, optional={"effort": st.sampled_from([None, "low"])}) | json_values,
    "top_logprobs": st.integers(-1, 25),
}
item = message | st.fixed_dictionaries(
    {"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "input_image"])},
    optional={
        "role": st.sampled_from(["user", "developer", "assistant", "tool"]),
        "content": json_values,
        "call_id": st.text(max_size=4),
        "name": st.text(max_size=4),
        "arguments": json_texts,
        "output": st.text(max_size=9) | json_values,
    },
)
PROMPT = {
    "completions": st.text(max_size=80) | token_ids | st.lists(st.text(max_size=20) | token_ids, max_size=3),
    "chat/completions": st.lists(message, max_size=4),
    "responses": st.text(max_size=80) | st.lists(item, max_size=4),
}
KEYS = {
    "completions": ("prompt", "max_tokens"),
    "chat/completions": ("messages", "max_tokens"),
    "responses": ("input", "max_output_tokens"),
}


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def _with(key: str, **fields) -> bytes:
    base = "hi" if key == "prompt" else [{"role": "user", "content": "hi"}]
    return json.dumps({key: base, "max_tokens": 4, **fields}).encode()


NESTED_IN = {  # (prompt key, depth) -> a body with JSON nested that deep inside one field
    "guided_json text": lambda key, d: _with(key, guided_json=_deep(d)),
    "structured_outputs.json text": lambda key, d: _with(key, structured_outputs={"json": _deep(d)}),
    "response_format schema text": lambda key, d: _with(
        key, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": _deep(d)}}
    ),
}
NESTED_IN_CHAT = {
    "tool-call arguments": lambda key, d: json.dumps({"messages": [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": _deep(d)}}]},
        {"role": "user", "content": "hi"},
    ]}).encode(),
    "tool parameters": lambda key, d: _with(key, tools=[]).replace(
        b'"tools": []',
        b'"tools": [{"type": "function", "function": {"name": "f", "parameters": '
        + b'{"type": "object", "properties": {"a": ' * d + b"{}" + b"}}" * d + b"}}]",
    ),
}  # fmt: skip


@st.composite
def bodies(draw, endpoint: str) -> bytes:
    key, max_key = KEYS[endpoint]
    if not draw(st.integers(0, 4)):  # one in five: a plain valid request (the hostile ones are rarely valid)
        plain = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "input": "hi"}[key]
        tame = draw(st.fixed_dictionaries({}, optional={"temperature": st.floats(0, 2), "seed": st.integers(0, 99)}))
        return json.dumps({key: plain, max_key: draw(st.integers(1, 8)), **tame}).encode()
    values = FIELD_VALUES | RESPONSES_VALUES if endpoint == "responses" else FIELD_VALUES
    fields = draw(st.dictionaries(st.sampled_from(sorted(values)), st.just(None), max_size=8))
    body = {k: draw(values[k] | json_values if draw(st.booleans()) else values[k]) for k in fields}
    if draw(st.integers(0, 9)):  # mostly a well-shaped prompt, sometimes anything at all
        body[key] = draw(PROMPT[endpoint])
    elif draw(st.booleans()):
        body[key] = draw(json_values)
    body[max_key] = draw(st.integers(1, 32) | st.integers(-(10**20), 10**20) | json_values)
    if isinstance(body.get("n"), int) and body["n"] > 4:
        body["n"] = 4  # keep valid requests small: the properties are about bad input
    if body.get("background") is True:
        body[max_key] = 8  # (a background run outlives the fuzzing: later tests find the engine busy)
    data = json.dumps(body).encode()
    mutation = draw(st.sampled_from(["none", "none", "bytes", "truncate", "duplicate", "nest", "nest_text", "raw"]))
    if mutation == "bytes":
        at = draw(st.integers(0, len(data)))
        return data[:at] + draw(st.binary(min_size=1, max_size=8)) + data[at:]
    if mutation == "truncate":
        return data[: draw(st.integers(0, len(data)))]
    if mutation == "duplicate":
        return data[:-1] + b', "%s": 1}' % max_key.encode()
    if mutation == "nest":
        depth = draw(st.integers(100, 200_000))
        return b'{"%s": %s%s}' % (key.encode(), b"[" * depth, b"]" * depth)
    if mutation == "nest_text":  # deeply nested JSON inside a field (as text in a string, or a schema)
        where = draw(st.sampled_from(sorted(NESTED_IN if key != "messages" else {**NESTED_IN, **NESTED_IN_CHAT})))
        depth = draw(st.integers(65, 900 if where == "tool parameters" else 200_000))
        return (NESTED_IN | NESTED_IN_CHAT)[where](key, depth)
    if mutation == "raw":
        return draw(st.binary(max_size=64))
    return data


headers = st.fixed_dictionaries(
    {},
    optional={
        "Content-Type": st.sampled_from(  # (mostly JSON: another type is a 415 before the body is read)
            ["application/json"] * 4 + ["application/json; charset=utf-8", "text/plain", "multipart/form-data", ""]
        ),
        "Authorization": st.binary(max_size=20).map(lambda b: b"Bearer " + b.replace(b"\r", b"").replace(b"\n", b"")),
        "Accept-Encoding": st.sampled_from(["gzip", "identity", "*"]),
        "X-Request-Id": st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=30),
    },
)


def _post(host: str, port: int, path: str, data: bytes, hdrs: dict) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=BOUND_S)
    try:
        conn.putrequest("POST", path)
        for name, value in hdrs.items():
            conn.putheader(name, value)
        conn.putheader("Content-Length", str(len(data)))
        conn.endheaders(data)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def fuzz(host: str, port: int, seen: list[tuple[str, int]]) -> None:
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(endpoint=st.sampled_from(sorted(KEYS)), data=st.data(), hdrs=headers)
    def one(endpoint, data, hdrs):
        body = data.draw(bodies(endpoint))
        start = time.monotonic()
        status, payload = _post(host, port, f"/v1/{endpoint}", body, hdrs)
        assert time.monotonic() - start < BOUND_S
        assert status < 500, (status, body[:300], payload[:300])
        seen.append((endpoint, status))

    one()


async def test_fuzzed_requests_get_no_5xx_in_bounded_time_and_canaries_stay_intact(server):
    baseline = await undisturbed(server.url)
    before = await server.metrics()
    statuses: list[tuple[str, int]] = []
    fuzzing = asyncio.ensure_future(asyncio.to_thread(fuzz, server.server.http.host, server.server.http.port, statuses))
    canaries = []
    while not fuzzing.done():  # canaries back to back for as long as the fuzzing runs
        canaries.append(await Canary(server.url).start().task)
    await fuzzing
    assert len(canaries) >= 2 and all(c == baseline for c in canaries)
    for endpoint in KEYS:  # both valid and invalid requests were generated, for every endpoint
        assert {200, 400} <= {status for e, status in statuses if e == endpoint}, collections.Counter(statuses)
    after = await server.metrics()
    fives = {k: v - before.get(k, 0) for k, v in after.items() if k[0] == "sluice:http_requests_total"}
    assert not {k: v for k, v in fives.items() if dict(k[1])["status"].startswith("5") and v}, fives
