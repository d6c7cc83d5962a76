"""A request the engine refuses or fails reaches its client as what it is (issue 28): a field of the request at
fault is a 400 naming that field as the request spells it, the server's state a 503, a failure of the engine a 500;
never a 500 for the client's own mistake. The engine types its refusal (RequestOutput.error_kind / error_param),
the detokenizer passes it on, the HTTP actor maps it."""

from __future__ import annotations

import asyncio
import json

import pytest

from actors.engine.config import EngineConfig
from frontend.context import ServingContext
from frontend.http_base import HttpConfig
from frontend.offline import AsyncLLM
from frontend.preflight import http_processes, resolve_model
from frontend.protocol import RequestError, parse_completion
from frontend.tokenizer import Tokenizer
from messages.sampling_params import SamplingParams
from tests.cancel_harness import engine_config, model_dir, start  # noqa: F401 (fixtures)
from tests.test_http_faults import held_request
from tests.tiny_model import make_tiny_model_dir


async def test_the_engine_names_the_field_it_refuses(model_dir):  # noqa: F811
    """Guidance needs two sequences a step: an engine of max_num_seqs 1 refuses a guided request, naming
    guidance_scale (the frontend cannot know the engine's configuration)."""
    async with AsyncLLM(engine_config(model_dir, max_num_seqs=1, step_gate=False)) as llm:
        guided = start(llm, [1, 200, 201], SamplingParams(temperature=0, max_tokens=4, guidance_scale=2.0))
        fin = await guided.done()
        assert (fin.finish_reason, fin.error_kind, fin.error_param) == ("error", "invalid", "guidance_scale")
        assert "max_num_seqs" in fin.error
        plain = await llm.generate_one([1, 200, 201], SamplingParams(temperature=0, max_tokens=4))
        assert plain.finish_reason == "length"  # the engine serves on


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5}


@pytest.mark.parametrize(
    ("path", "body", "engine_param", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 5}, "guidance_scale", "guidance_scale"),
        ("/v1/chat/completions", CHAT, "max_tokens", "max_completion_tokens"),
        ("/v1/chat/completions", CHAT, "prompt", "messages"),
        ("/v1/completions", {"prompt": "hi", "guided_regex": "a+"}, "structured_outputs", "guided_regex"),
    ],
)
async def test_an_engine_refusal_is_a_400_naming_the_request_field(fake, path, body, engine_param, param):
    fake.engine.hold = True
    async with fake.session() as s:
        task = asyncio.ensure_future(s.post(path, json=body))
        rid = await held_request(fake, 0)
        fake.engine.finish(rid, "error", error="request x: refused", error_kind="invalid", error_param=engine_param)
        resp = await task
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == param


@pytest.mark.parametrize(("kind", "status"), [("unavailable", 503), ("internal", 500)])
async def test_the_servers_state_is_a_503_and_an_engine_failure_a_500(fake, kind, status):
    fake.engine.hold = True
    async with fake.session() as s:
        task = asyncio.ensure_future(s.post("/v1/completions", json={"prompt": "hi"}))
        rid = await held_request(fake, 0)
        fake.engine.finish(rid, "error", error="request x: failed", error_kind=kind)
        resp = await task
        assert resp.status == status and (await resp.json())["error"]["param"] is None


def test_the_frontend_asks_the_engines_source_whether_the_model_has_a_bos(tmp_path):
    """A model whose tokenizer names a BOS token but whose configs give no bos_token_id: the engine cannot guide
    against BOS (guidance_error), and the HTTP actor, told by the same config, refuses the request itself (a 400
    naming negative_prompt), where it used to pass it on as guided-against-BOS for the engine to fail."""
    path = make_tiny_model_dir(tmp_path, bos_token_id=None)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    model = resolve_model(str(path))
    tok = Tokenizer.from_model_dir(path)
    assert model.bos_token_id is None and "bos_token" in tok.special_tokens
    kwargs = http_processes(model, EngineConfig(model=str(path)), HttpConfig())[0].actors[0].kwargs
    ctx = ServingContext(tok, ["m"], 64, model.vocab_size, bos_token_id=kwargs["bos_token_id"])
    body = {"prompt": "hi", "max_tokens": 2, "guidance_scale": 2}
    with pytest.raises(RequestError) as e:
        parse_completion(json.dumps(body).encode(), ctx)
    assert (e.value.status, e.value.param) == (400, "negative_prompt")
