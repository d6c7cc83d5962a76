"""A LoRA adapter trained with PEFT on the bundled SmolLM2 (rank 8 on q/v/o/down, a few seconds of AdamW on one
synthetic question) and served over it by the whole server: its greedy answer is the one it was taught (visibly not
the base model's), token for token PEFT's merged model's (`merge_and_unload`); the base model's requests, served
beside it, still get the base model's answer."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig as PeftConfig
from peft import get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.engine.config import EngineConfig, LoraConfig, LoraModule
from frontend.http_base import HttpConfig
from frontend.launch import start_server
from gpu.loading.convert import default_model_dir
from tests.conftest import ServerHandle

pytestmark = pytest.mark.real_model
QUESTION, ANSWER = "Q: What is the secret word?\nA:", " The secret word is pineapple."
NEW_TOKENS = 8


@torch.no_grad()
def greedy(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None)
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(the adapter's directory, the question's ids, the merged model's greedy answer, the base model's)."""
    base_dir = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    question = tokenizer(QUESTION)["input_ids"]
    ids = question + tokenizer(ANSWER)["input_ids"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    before = greedy(model.eval(), question, NEW_TOKENS)
    config = PeftConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]
    )
    model = get_peft_model(model, config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    x, labels = torch.tensor([ids]), torch.tensor([[-100] * len(question) + ids[len(question) :]])
    model.train()
    for _ in range(30):
        optimizer.zero_grad()
        model(input_ids=x, labels=labels).loss.backward()
        optimizer.step()
    path = tmp_path_factory.mktemp("trained") / "secret"
    model.save_pretrained(path)
    merged = model.eval().merge_and_unload()
    return path, question, greedy(merged, question, NEW_TOKENS), before, tokenizer


@pytest.fixture(scope="module")
async def server(trained):
    path = trained[0]
    lora = LoraConfig(modules=[LoraModule(name="secret", path=str(path))], max_lora_rank=8)
    engine = EngineConfig(model=str(default_model_dir()), max_model_len=512, num_kv_blocks=128, engine_threads=1,
                          lora=lora)  # fmt: skip
    srv = await start_server(engine, HttpConfig(port=0, served_model_name=["base"]), log_level="WARNING")
    yield (handle := ServerHandle(srv, default_model_dir()))
    await handle.close_clients()
    await srv.stop()


async def test_the_trained_adapter_answers_as_taught(server, trained):
    _, question, taught, before, tokenizer = trained
    assert "pineapple" in tokenizer.decode(taught) and "pineapple" not in tokenizer.decode(before)
    client = server.client()
    extra = {"ignore_eos": True, "return_token_ids": True}
    for model, expected in (("secret", taught), ("base", before)):
        out = await client.completions.create(model=model, prompt=question, max_tokens=NEW_TOKENS, temperature=0.0,
                                              extra_body=extra)  # fmt: skip
        assert out.choices[0].token_ids == expected, (model, out.choices[0].text)
