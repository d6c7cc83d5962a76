"""A decoder served as an embedder (Qwen3-Embedding's recipe): a tiny random Qwen3 that HF builds (its sliding
window shorter than the inputs), saved with sentence-transformers' files pooling its last token, normalized, served
behind /v1/embeddings: each input's embedding against HF's own Qwen3Model forward of that input alone; the same bits
alone and in a batch of concurrent clients; inputs over the step's budget run alone; mean pooling (--pooler-config)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import numpy as np
import pytest
import torch
import transformers

from gpu.kernels import native
from gpu.loading.encoder_config import DecoderPooling, is_pooling_model, pooling_config
from gpu.loading.errors import ModelLoadError
from tests.family_models import make_family_dir

LENS = [1, 6, 19, 40, 90, 150]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    path = make_family_dir(tmp_path_factory.mktemp("qwen3"), "qwen3")
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]))  # fmt: skip
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    return path


@pytest.fixture(scope="module")
async def served(embedder):
    from actors.engine.config import EngineConfig
    from frontend.http_base import HttpConfig
    from frontend.launch import start_server

    engine = EngineConfig(model=str(embedder), max_model_len=256, max_num_batched_tokens=128)
    srv = await start_server(engine, HttpConfig(port=0, served_model_name=["m"]), log_level="WARNING")
    yield srv
    await srv.stop()


def inputs(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in LENS]


def hf_states(path, ids: list[list[int]]) -> list[torch.Tensor]:
    model = transformers.AutoModel.from_pretrained(path).eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([x])).last_hidden_state[0] for x in ids]


async def embed(s: aiohttp.ClientSession, body: dict) -> np.ndarray:
    async with s.post("/v1/embeddings", json={"encoding_format": "float", **body}) as resp:
        assert resp.status == 200, await resp.text()
        return np.asarray([d["embedding"] for d in (await resp.json())["data"]])


def test_a_decoder_with_a_pooling_module_is_served_for_pooling(embedder):
    assert is_pooling_model(embedder)
    config = pooling_config(embedder)
    assert isinstance(config, DecoderPooling) and config.pooling.pooling_type == "LAST" and config.pooling.normalize


async def test_last_token_embeddings_are_hfs_alone_and_batched(served, embedder):
    ids = inputs(0)
    ref = [h[-1] / h[-1].norm() for h in hf_states(embedder, ids)]
    async with aiohttp.ClientSession(served.url) as s:
        batched = await embed(s, {"input": ids})  # (steps of 1, 6, 19 and 40 tokens, then 90, then 150: over the
        # 128-token budget, alone)
        alone = await asyncio.gather(*(embed(s, {"input": [x]}) for x in ids))
    for i, want in enumerate(ref):
        np.testing.assert_allclose(batched[i], want.numpy(), atol=2e-5)
        if native.ops() is not None:
            assert np.array_equal(alone[i][0], batched[i]), i


def test_mean_pooling_by_pooler_config_in_process(embedder):
    """(the engine's model in this process: gpu/runner/pooling.py, pooled as --pooler-config says)"""
    from gpu.layers.pooling import pool
    from gpu.runner.pooling import CausalStates

    config = pooling_config(embedder, '{"pooling_type": "MEAN", "normalize": false}')
    ids = inputs(1)[:3]
    lens = [len(x) for x in ids]
    states = CausalStates(config.model, 128, 8)(torch.tensor([t for x in ids for t in x]), lens)
    got = pool(states, lens, config.pooling.pooling_type, config.pooling.normalize)
    for i, h in enumerate(hf_states(embedder, ids)):
        torch.testing.assert_close(got[i], h.mean(0), atol=2e-5, rtol=1e-4)


def test_a_yes_no_reranker_scores_pairs_as_hfs_last_logits(embedder):
    """--pooler-config's classifier_from_token (vLLM's, Qwen3-Reranker's recipe): a pair's score is the softmax's
    P(yes) over the "no" and "yes" logits of its last token, the texts concatenated by the tokenizer's template."""
    from frontend.scoring import pair_inputs
    from frontend.tokenizer import Tokenizer
    from gpu.runner.pooling import CausalStates

    config = pooling_config(embedder, '{"classifier_from_token": ["no", "yes"]}')
    assert config.labels == ("yes",) and config.score_sigmoid
    no, yes = config.score_tokens

    class Ctx:
        tokenizer, max_model_len = Tokenizer.from_model_dir(embedder), 128

    pairs = [("Query: is the sky blue?", "Document: the sky is blue."), ("Query: a", "Document: b c d e")]
    ids, _ = pair_inputs(pairs, Ctx, None, "documents")
    model = CausalStates(config.model, 128, 8, score_tokens=config.score_tokens)
    lens = [len(x) for x in ids]
    got = torch.sigmoid(model.classify(model(torch.tensor([t for x in ids for t in x]), lens), lens)[:, 0])
    hf = transformers.AutoModelForCausalLM.from_pretrained(embedder).eval()
    for i, x in enumerate(ids):
        assert x == Ctx.tokenizer.encode(pairs[i][0] + pairs[i][1])  # (no special tokens between the two here)
        with torch.no_grad():
            last = hf(input_ids=torch.tensor([x])).logits[0, -1]
        assert abs(got[i] - torch.softmax(last[[no, yes]], 0)[1]) < 1e-5
    for bad in ('{"classifier_from_token": ["no"]}', '{"classifier_from_token": ["no", "not-a-token-xyz"]}',
                '{"classifier_from_token": ["no", "yes"], "normalize": true}'):  # fmt: skip
        with pytest.raises(ModelLoadError, match="classifier_from_token"):
            pooling_config(embedder, bad)


def test_a_plain_decoder_is_served_for_pooling_when_the_flags_say_so(tmp_path):
    from actors.engine.config import EngineConfig
    from frontend.preflight import serves_pooling

    plain = make_family_dir(tmp_path / "plain", "llama")  # (no sentence-transformers files: a generation model)
    assert not serves_pooling(EngineConfig(model=str(plain)))
    assert serves_pooling(EngineConfig(model=str(plain), runner="pooling"))
    assert serves_pooling(EngineConfig(model=str(plain), pooler_config='{"classifier_from_token": ["no", "yes"]}'))
    assert not serves_pooling(EngineConfig(model=str(plain), runner="generate", pooler_config="{}"))


def test_a_bare_decoders_checkpoint_is_read_for_pooling_and_refused_for_generation(tmp_path):
    """Qwen3-Embedding's own files: `Qwen3Model` (no LM head, its tensors named without "model.")."""
    from actors.engine.config import EngineConfig
    from frontend.http_base import HttpConfig
    from frontend.preflight import build_processes
    from gpu.runner.pooling import CausalStates
    from tests.tiny_model import save_with_tokenizer

    causal = transformers.AutoModelForCausalLM.from_pretrained(make_family_dir(tmp_path / "causal", "qwen3"))
    bare = save_with_tokenizer(causal.model, tmp_path / "bare")
    assert json.loads((bare / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    config = pooling_config(bare)
    assert config.model.headless and config.pooling.pooling_type == "LAST"
    ids = inputs(2)[:3]
    lens = [len(x) for x in ids]
    states = CausalStates(config.model, 128, 8)(torch.tensor([t for x in ids for t in x]), lens)
    for got, want in zip(states.split(lens), hf_states(bare, ids), strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    with pytest.raises(ModelLoadError, match="bare decoder"):
        build_processes(EngineConfig(model=str(bare), runner="generate"), HttpConfig(port=0), memory_check=False)
