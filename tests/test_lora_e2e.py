"""LoRA adapters served end to end (one server: a tiny Llama with three PEFT adapters, --max-loras 2, two of them
held at once, --max-cpu-loras 2: the third is read from disk when wanted, evicting one): the `openai`
client picks an adapter by `model` and gets PEFT's greedy tokens and logprobs, concurrent requests of the base and
every adapter each get their own (the cap makes one wait its turn), a guided request's companion and a beam
search run the request's adapter, /v1/models lists the adapters with the base as
parent, an unknown adapter is a 404 naming it, a request with the prompt another adapter cached finds nothing of it;
and a bad adapter stops the server at startup with a message naming it."""

from __future__ import annotations

import asyncio
import json
import shutil

import openai
import pytest
import torch

from actors.engine.config import EngineConfig, LoraConfig, LoraModule
from frontend.http_base import HttpConfig
from frontend.launch import start_server
from frontend.preflight import build_processes
from gpu.loading.config import ModelLoadError
from tests.conftest import API_KEY, ServerHandle
from tests.lora_adapters import make_adapter, peft_reference
from tests.waits import eventually

PROMPT = list(range(1000, 1040))  # 40 tokens: two and a half KV blocks
NEW_TOKENS = 8
TOL = 1e-3


@torch.no_grad()
def peft_greedy(base, adapter, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """PEFT's greedy tokens and their logprobs."""
    model, ids, logprobs = peft_reference(base, adapter), list(prompt), []
    for _ in range(n):
        lp = model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
        ids.append(int(lp.argmax()))
        logprobs.append(float(lp.max()))
    return ids[len(prompt) :], logprobs


@pytest.fixture(scope="module")
def adapters(family_dir_of, tmp_path_factory):
    base, root = family_dir_of("llama"), tmp_path_factory.mktemp("adapters")
    made = {f"ad{i}": make_adapter(base, root / f"ad{i}", seed=10 + i, r=4 * (i + 1)) for i in range(4)}
    return base, made  # (ad3: loaded while serving)


@pytest.fixture(scope="module")
async def lora_server(adapters):
    base, made = adapters
    modules = [LoraModule(name=n, path=str(p)) for n, p in made.items() if n != "ad3"]
    lora = LoraConfig(modules=modules, max_loras=2, max_cpu_loras=2)
    engine = EngineConfig(model=str(base), max_model_len=256, max_num_seqs=8, num_kv_blocks=96, engine_threads=1,
                          lora=lora)  # fmt: skip
    http = HttpConfig(port=0, served_model_name=["base"], api_key=API_KEY, lora_runtime_updates=True)
    srv = await start_server(engine, http, log_level="WARNING")
    yield (handle := ServerHandle(srv, base, API_KEY))
    await handle.close_clients()
    await srv.stop()


async def complete(client, model: str, prompt=PROMPT):
    out = await client.completions.create(
        model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0.0, logprobs=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    return out.choices[0].token_ids, out.choices[0].logprobs.token_logprobs


async def test_each_adapter_is_pefts_alone_and_mixed(lora_server, adapters):
    base, made = adapters
    client = lora_server.client()
    names = ["base", "ad0", "ad1", "ad2"]
    expected = {n: peft_greedy(base, made.get(n), PROMPT, NEW_TOKENS) for n in names}
    assert len({tuple(t) for t, _ in expected.values()}) == len(names), "the adapters must change the greedy tokens"
    for name in names:  # alone
        tokens, logprobs = await complete(client, name)
        assert tokens == expected[name][0], name
        assert max(abs(a - b) for a, b in zip(logprobs, expected[name][1], strict=True)) < TOL, name
    # mixed: every model twice at once, in an interleaved order (three adapters over a cap of two)
    got = await asyncio.gather(*(complete(client, name) for name in names * 2))
    for name, (tokens, _) in zip(names * 2, got, strict=True):
        assert tokens == expected[name][0], f"{name} in a mixed batch"

    async def evicted() -> bool:  # (three adapters through two slots: one was read from disk, one evicted)
        return await lora_server.metric("sluice:lora_evictions_total") >= 1

    await eventually(evicted, "an adapter evicted", 30.0)


@torch.no_grad()
def peft_guided(base, adapter, prompt: list[int], n: int, scale: float) -> list[int]:
    """Greedy tokens of l_u + scale (l_c - l_u), l_u the logits after the BOS token alone (CFG's default companion)."""
    model, out = peft_reference(base, adapter), []
    for _ in range(n):
        cond = model(torch.tensor([prompt + out])).logits[0, -1]
        uncond = model(torch.tensor([[1, *out]])).logits[0, -1]
        out.append(int((uncond + scale * (cond - uncond)).argmax()))
    return out


async def test_guidance_and_beam_search_run_the_adapter(lora_server, adapters):
    """A CFG request's companion runs its adapter too; a beam search (width 1: greedy) runs it."""
    base, made = adapters
    client, prompt = lora_server.client(), PROMPT[:12]
    extra = {"ignore_eos": True, "return_token_ids": True}
    guided = await client.completions.create(model="ad2", prompt=prompt, max_tokens=6, temperature=0.0,
                                             extra_body={**extra, "guidance_scale": 1.5})  # fmt: skip
    expected = peft_guided(base, made["ad2"], prompt, 6, 1.5)
    assert guided.choices[0].token_ids == expected
    assert expected not in (peft_guided(base, None, prompt, 6, 1.5), peft_greedy(base, made["ad2"], prompt, 6)[0])
    beam = await client.completions.create(model="ad1", prompt=prompt, max_tokens=6, temperature=0.0,
                                           extra_body={**extra, "use_beam_search": True})  # fmt: skip
    assert beam.choices[0].token_ids == peft_greedy(base, made["ad1"], prompt, 6)[0]


async def test_models_lists_the_adapters(lora_server, adapters):
    client = lora_server.client()
    cards = {m.id: m for m in (await client.models.list()).data}
    assert set(cards) == {"base", "ad0", "ad1", "ad2"}
    assert cards["ad1"].parent == "base" and cards["ad1"].root == str(adapters[1]["ad1"])
    assert cards["base"].parent is None
    with pytest.raises(openai.NotFoundError, match="ad9"):
        await client.completions.create(model="ad9", prompt="hi", max_tokens=1)


async def test_an_adapter_finds_no_prefix_another_cached(lora_server):
    client, prompt = lora_server.client(), list(range(2000, 2040))
    first = await client.completions.create(model="ad0", prompt=prompt, max_tokens=1, temperature=0.0)
    again = await client.completions.create(model="ad0", prompt=prompt, max_tokens=1, temperature=0.0)
    other = await client.completions.create(model="ad1", prompt=prompt, max_tokens=1, temperature=0.0)
    assert not first.usage.prompt_tokens_details or not first.usage.prompt_tokens_details.cached_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == 32  # (its two full blocks)
    assert not other.usage.prompt_tokens_details or not other.usage.prompt_tokens_details.cached_tokens


def _bad(adapter, case: str):
    config = json.loads((adapter / "adapter_config.json").read_text())
    if case == "rank":
        config["r"] = 64
    elif case == "dora":
        config["use_dora"] = True
    elif case == "modules_to_save":
        config["modules_to_save"] = ["lm_head"]
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    if case == "missing":
        (adapter / "adapter_model.safetensors").unlink()


@pytest.mark.parametrize(
    "case, message",
    [("rank", "rank 64 exceeds --max-lora-rank 16"), ("dora", "DoRA"), ("modules_to_save", "modules_to_save"),
     ("missing", "no adapter_model.safetensors")],
)  # fmt: skip
def test_a_bad_adapter_is_refused_at_startup(adapters, tmp_path, case, message):
    import shutil

    base, made = adapters
    bad = shutil.copytree(made["ad0"], tmp_path / "bad")
    _bad(bad, case)
    lora = LoraConfig(modules=[LoraModule(name="bad", path=str(bad))])
    engine = EngineConfig(model=str(base), max_model_len=256, num_kv_blocks=64, lora=lora)
    with pytest.raises(ModelLoadError, match=message) as e:
        build_processes(engine, HttpConfig(port=0), memory_check=False)
    assert "--lora-modules bad" in str(e.value)


async def post(server, path: str, body: dict, key: str = API_KEY) -> tuple[int, str]:
    async with server.session().post(f"{server.url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        return r.status, await r.text()


async def test_an_adapter_loaded_and_unloaded_while_serving(lora_server, adapters):
    """vLLM's endpoints: a load, then requests name it (PEFT's tokens); loading it again is a no-op, another
    adapter under its name or the base's name a 400, a bad one a 400 naming lora_path; unloading it while a stream
    of it runs lets the stream end as it would have, then its name is a 404."""
    base, made = adapters
    client, path = lora_server.client(), str(made["ad3"])
    assert (await post(lora_server, "/v1/load_lora_adapter", {"lora_name": "ad3", "lora_path": path}, "bad"))[0] == 401
    status, text = await post(lora_server, "/v1/load_lora_adapter", {"lora_name": "ad3", "lora_path": path})
    assert status == 200 and "ad3" in text
    tokens, _ = await complete(client, "ad3")
    assert tokens == peft_greedy(base, made["ad3"], PROMPT, NEW_TOKENS)[0]
    assert "ad3" in {m.id for m in (await client.models.list()).data}
    assert (await post(lora_server, "/v1/load_lora_adapter", {"lora_name": "ad3", "lora_path": path}))[0] == 200
    for body, param in (({"lora_name": "ad3", "lora_path": str(made["ad0"])}, "lora_name"),
                        ({"lora_name": "base", "lora_path": path}, "lora_name"),
                        ({"lora_name": "ad9", "lora_path": path + "-missing"}, "lora_path")):  # fmt: skip
        status, text = await post(lora_server, "/v1/load_lora_adapter", body)
        assert status == 400 and json.loads(text)["error"]["param"] == param, text
    long = {"max_tokens": 150, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    whole = await client.completions.create(model="ad3", prompt=PROMPT, **long)
    stream = await client.completions.create(model="ad3", prompt=PROMPT, stream=True, **long)
    text = ""
    async for chunk in stream:
        if not text and chunk.choices[0].text:  # (the first token out: unloaded while the rest is generated)
            assert (await post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "ad3"}))[0] == 200
        text += chunk.choices[0].text
    assert text == whole.choices[0].text
    with pytest.raises(openai.NotFoundError, match="ad3"):
        await complete(client, "ad3")
    assert (await post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "ad3"}))[0] == 404


async def test_an_adapter_whose_files_break_fails_its_requests_alone(lora_server, adapters, tmp_path):
    """An adapter registered, run, then its weights file overwritten and its slot taken by others: the next request
    naming it fails saying its files changed, and the base model's request beside it gets its tokens; once the file
    is mended, the next request reads it again and gets the adapter's tokens (a failure does not stick)."""
    base, made = adapters
    client, path = lora_server.client(), tmp_path / "ad5"
    shutil.copytree(made["ad3"], path)
    assert (await post(lora_server, "/v1/load_lora_adapter", {"lora_name": "ad5", "lora_path": str(path)}))[0] == 200
    good = await complete(client, "ad5")
    weights = path / "adapter_model.safetensors"
    intact = weights.read_bytes()
    weights.write_bytes(intact[:-8] + bytes(8))  # (the tail of a tensor: parses, hashes otherwise)
    for other in ("ad0", "ad1"):  # (--max-cpu-loras 2: ad5's slot goes)
        await complete(client, other)
    broken, plain = await asyncio.gather(complete(client, "ad5"), complete(client, "base"), return_exceptions=True)
    assert isinstance(broken, openai.APIStatusError) and "changed" in str(broken), broken
    assert plain[0] == peft_greedy(base, None, PROMPT, NEW_TOKENS)[0]
    weights.write_bytes(intact)
    assert (await complete(client, "ad5"))[0] == good[0]
    assert (await post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "ad5"}))[0] == 200
