"""Each family's tiny checkpoint (tests/family_models.py) served by the whole server answers the `openai` client with
HF transformers' greedy tokens (prompt longer than the sliding window, decoding past it), streamed chat included;
and a model directory that cannot be served stops the server at startup with a message naming the problem."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from actors.engine.config import EngineConfig
from frontend.http_base import HttpConfig
from frontend.launch import start_server
from gpu.loading.config import ModelLoadError
from tests.conftest import ServerHandle
from tests.family_models import FAMILIES

PROMPT = list(range(1000, 1020))  # 20 tokens: longer than the window (8)
NEW_TOKENS = 12


@torch.no_grad()
def hf_greedy(model_dir, prompt: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
async def test_family_is_served(family, family_dir_of):
    model_dir = family_dir_of(family)
    engine = EngineConfig(model=str(model_dir), max_model_len=256, max_num_seqs=4, num_kv_blocks=64, engine_threads=1)
    srv = await start_server(engine, HttpConfig(port=0), log_level="WARNING")
    handle = ServerHandle(srv, model_dir)
    try:
        client = handle.client()
        out = await client.completions.create(
            model=None,
            prompt=PROMPT,
            max_tokens=NEW_TOKENS,
            temperature=0.0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert out.choices[0].token_ids == hf_greedy(model_dir, PROMPT, NEW_TOKENS)
        chat = [{"role": "user", "content": "Hello there"}]
        whole = await client.chat.completions.create(model=None, messages=chat, max_tokens=8, temperature=0.0)
        stream = await client.chat.completions.create(
            model=None, messages=chat, max_tokens=8, temperature=0.0, stream=True
        )
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert streamed == whole.choices[0].message.content
    finally:
        await handle.close_clients()
        await srv.stop()


def _broken(model_dir, tmp_path, case: str):
    shutil.copytree(model_dir, tmp_path, dirs_exist_ok=True)
    raw = json.loads((tmp_path / "config.json").read_text())
    if case == "architecture":
        raw["architectures"] = ["FalconForCausalLM"]
    elif case == "shape":
        raw["moe_intermediate_size"] = 48
    else:  # a shard listed in the index but missing
        (tmp_path / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}})
        )
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("architecture", "unsupported architecture ['FalconForCausalLM']; supported: LlamaForCausalLM"),
        ("shape", "experts.0.down_proj.weight has shape (64, 32), expected (64, 48)"),
        ("shard", "shards listed in model.safetensors.index.json are missing: ['model-00002-of-00002.safetensors']"),
    ],
)
async def test_unservable_model_fails_at_startup_naming_it(case, message, family_dir_of, tmp_path):
    model_dir = _broken(family_dir_of("qwen3_moe"), tmp_path, case)
    engine = EngineConfig(model=str(model_dir), max_model_len=256, num_kv_blocks=64, engine_threads=1)
    with pytest.raises(ModelLoadError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        srv = await start_server(engine, HttpConfig(port=0), log_level="WARNING")
        await srv.stop()
