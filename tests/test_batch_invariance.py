"""Batch-invariant mode (`--batch-invariant`, gpu/layers/quant.py check_invariant, gpu/attention/native_backend.py): a
request's logits are the same bits alone and in any batch, beside prefills, as chunks of a prefill, as a speculative
verification row and as a recomputed prompt. The reference is the request run alone, step by step, on the same
runner; the power check is the torch path's plan (decode rows padded to the longest), under which the same
comparison finds differing logits. Through the engine: greedy and seeded requests side by side, and with n-gram
speculation, give the tokens each gives alone."""

import pytest
import torch

from actors.engine.config import EngineConfig, SpeculativeConfig
from frontend.offline import AsyncLLM
from gpu.batch import BatchSpec, ScheduledRow
from gpu.kernels import native
from gpu.loading.config import ModelConfig
from gpu.runner.model_runner import ModelRunner
from messages.sampling_params import SamplingParams as SP
from tests.tiny_model import Request, block_pool

BUILT = [isa for isa in native.cpu_isas() if native.ops(isa) is not None]
pytestmark = pytest.mark.skipif(not BUILT, reason="no native CPU kernels built for this CPU (make setup builds them)")
PROMPTS = [list(range(10 + 3 * i, 25 + 7 * i)) for i in range(16)]  # 15 .. 120 tokens
STEPS = 4
ALONE_STEPS = 20  # (the chunked test's rows decode while another prompt goes in, 7 tokens a step)


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    config = ModelConfig.from_path(tiny_model_dir)
    return ModelRunner(config, device="cpu", dtype="float32", num_blocks=512, block_size=16, batch_invariant=True)


class Driver:
    """Requests driven by hand on one runner, each decoding greedily; `logits[i]`: request i's rows, step by step."""

    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner, self.pool, self.step = runner, block_pool(seed, 512), 0
        self.reqs: dict[int, Request] = {}
        self.logits: dict[int, list[torch.Tensor]] = {}

    def add(self, i: int, tokens: list[int] | None = None) -> Request:
        self.reqs[i], self.logits[i] = Request(self.pool, i, PROMPTS[i] if tokens is None else tokens, 16), []
        return self.reqs[i]

    def run(self, rows: dict[int, ScheduledRow]) -> None:
        """One step of `rows` (request -> its row); each sampling row's logits recorded, its greedy token appended."""
        out = self.runner.execute(BatchSpec(self.step, list(rows.values())))
        self.step, at = self.step + 1, 0
        for i, row in rows.items():
            for _ in range(row.num_samples):
                self.logits[i].append(out[at].clone())
                at += 1
            if row.sample:
                self.reqs[i].tokens.append(int(self.logits[i][-1].argmax()))

    def decode(self, ids: list[int], steps: int = STEPS) -> None:
        for _ in range(steps):
            self.run({i: self.reqs[i].row() for i in ids})


@pytest.fixture(scope="module")
def alone(runner) -> dict[int, list[torch.Tensor]]:
    """Each request by itself: its prompt in one step, then ALONE_STEPS greedy decode steps."""
    logits = {}
    for i in range(len(PROMPTS)):
        d = Driver(runner)
        d.add(i)
        d.decode([i], ALONE_STEPS)
        logits[i] = d.logits[i]
    return logits


def same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) <= len(want) and all(torch.equal(g, w) for g, w in zip(got, want, strict=False))


@pytest.mark.parametrize("size", [2, 3, 7, 16])
def test_logits_are_the_same_bits_in_any_batch(runner, alone, size):
    d = Driver(runner, seed=size)
    ids = list(range(len(PROMPTS)))[-size:]  # (other prompts at each size: other lengths side by side)
    for i in ids:
        d.add(i)
    d.decode(ids)
    assert all(same(d.logits[i], alone[i]) for i in ids)


def test_beside_prefills_and_as_chunks(runner, alone):
    """Decode rows stepping beside other requests' prefills, and prompts prefilled in chunks of 7 tokens."""
    d = Driver(runner, seed=1)
    for i in (0, 1):
        d.add(i)
    d.run({i: d.reqs[i].row() for i in (0, 1)})
    for i in (5, 9):
        d.add(i)
    while d.reqs[9].num_computed < len(PROMPTS[9]):  # (5 finishes its prompt first, then decodes beside 9's)
        rows = {i: d.reqs[i].row() for i in (0, 1)}
        for i in (5, 9):
            left = len(PROMPTS[i]) - d.reqs[i].num_computed
            rows[i] = d.reqs[i].row(min(7, left) if left > 0 else None)
        d.run(rows)
    d.decode([0, 1, 5, 9], 2)
    assert all(same(d.logits[i], alone[i]) for i in (0, 1, 5, 9))


def test_verification_rows_and_recomputed_prompts(runner, alone):
    """A row feeding its greedy continuation as K drafts gets, at each position, the logits of the decode steps;
    a prompt of prompt + generated tokens recomputed from scratch gets the last decode step's."""
    for k in (1, 2, 4):
        d = Driver(runner, seed=k)
        ids = [2, 6, 11]
        for i in ids:
            d.add(i)
        d.run({i: d.reqs[i].row() for i in ids})  # the prompts: one sampled token each
        rows = {}
        for i in ids:
            r = d.reqs[i]
            drafts = [int(x.argmax()) for x in alone[i][1 : k + 1]]
            r.tokens += drafts
            rows[i] = r.row()
            rows[i].draft_token_ids = drafts
        d.run(rows)
        assert all(same(d.logits[i], alone[i][: k + 2]) for i in ids)
    d = Driver(runner, seed=7)
    generated = [int(x.argmax()) for x in alone[3][:STEPS]]
    d.add(3, PROMPTS[3] + generated)
    d.run({3: d.reqs[3].row()})
    assert torch.equal(d.logits[3][0], alone[3][STEPS])


def chunks_match_alone(runner: ModelRunner, ids: list[int]) -> bool:
    """Decode rows side by side and prompts in 12-token chunks against each request alone."""
    alone = {}
    for i in ids:
        d = Driver(runner)
        d.add(i)
        d.decode([i], 6)
        alone[i] = d.logits[i]
    d = Driver(runner, seed=5)
    for i in ids:
        d.add(i)
    while any(d.reqs[i].num_computed < len(PROMPTS[i]) for i in ids):
        d.run({i: d.reqs[i].row(min(12, len(PROMPTS[i]) - d.reqs[i].num_computed) or None) for i in ids})
    d.decode(ids, 3)
    return all(same(d.logits[i], alone[i]) for i in ids)


@pytest.mark.parametrize("family", ["gemma2", "mistral"])  # (sliding windows, soft-caps, other head sizes)
def test_other_families_in_any_batch_and_chunk(family_dir_of, family):
    config = ModelConfig.from_path(family_dir_of(family))
    runner = ModelRunner(config, device="cpu", dtype="float32", num_blocks=512, block_size=16, batch_invariant=True)
    assert chunks_match_alone(runner, [4, 8, 12])  # (crossing the window)


@pytest.mark.parametrize("mode", ["q8_0", "q4_k"])
def test_quantized_models_in_any_batch_and_chunk(tiny_model_dir, mode):
    """GGUF blocks (--quantization): each row's activations quantized alone, its chains its own, at any row count."""
    config = ModelConfig.from_path(tiny_model_dir)
    args = dict(device="cpu", dtype="float32", num_blocks=512, block_size=16, quantization=mode)
    runner = ModelRunner(config, **args, batch_invariant=True)
    assert runner.model.lm_head.blocks is not None  # (the layers hold blocks: what is compared)
    assert chunks_match_alone(runner, [4, 8, 12, 15])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_weights_in_any_batch_and_chunk(tiny_model_dir, dtype):
    """The native kernels' 16-bit panels (float32 activations): a row's chain is its own at any row count."""
    config = ModelConfig.from_path(tiny_model_dir)
    runner = ModelRunner(config, device="cpu", dtype=dtype, num_blocks=512, block_size=16, batch_invariant=True)
    assert runner.dtype == torch.float32 and runner.model.lm_head.native.dtype == getattr(torch, dtype)
    assert chunks_match_alone(runner, [4, 8, 12, 15])


def test_the_flag_reaches_the_engine_config():
    from frontend.cli import build_parser
    from frontend.cli_engine import engine_config

    assert engine_config(build_parser().parse_args(["serve", "m", "--batch-invariant"]), "m").batch_invariant
    assert not engine_config(build_parser().parse_args(["serve", "m"]), "m").batch_invariant


def test_the_padded_plan_is_not_invariant(runner, alone, monkeypatch):
    """The power check: the torch path's padded segments (every row sent there) on the same runner move logits
    across batch sizes."""
    monkeypatch.setattr(runner.attention, "short_row", 0)
    d = Driver(runner, seed=3)
    for i in range(len(PROMPTS)):
        d.add(i)
    d.decode(list(range(len(PROMPTS))))
    assert not all(same(d.logits[i], alone[i]) for i in range(len(PROMPTS)))


def test_a_model_the_mode_cannot_hold_is_refused(tiny_model_dir):
    config = ModelConfig.from_path(tiny_model_dir)
    with pytest.raises(ValueError, match="batch-invariant"):
        ModelRunner(config, device="cpu", dtype="float32", num_blocks=64, cpu_kernels="torch", batch_invariant=True)
    refusals = (dict(dtype="bfloat16"), dict(device="cuda:0"), dict(attention_backend="triton"))
    for refused in (*refusals, dict(attention_backend="torch"), dict(cpu_kernels="torch")):
        with pytest.raises(ValueError, match="batch-invariant"):
            EngineConfig(model=str(tiny_model_dir), batch_invariant=True, **refused)


def answer(out) -> tuple:
    return out.token_ids, out.logprobs


async def test_the_engine_answers_each_request_as_it_would_alone(tiny_model_dir):
    """Tokens and their logprobs (the logits' bits: without the mode they differ in the last bits here)."""
    prompts = PROMPTS[:8]
    params = [SP(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)] * 4  # (logprobs: the logits' bits)
    params += [SP(temperature=0.9, top_p=0.9, seed=i, max_tokens=12, ignore_eos=True, logprobs=2) for i in range(4)]
    config = EngineConfig(model=str(tiny_model_dir), batch_invariant=True, num_kv_blocks=512)
    async with AsyncLLM(config) as llm:
        alone = [answer((await llm.generate([p], sp))[0]) for p, sp in zip(prompts, params, strict=True)]
        together = [answer(o) for o in await llm.generate(prompts, params)]
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1)
    async with AsyncLLM(EngineConfig(model=str(tiny_model_dir), batch_invariant=True, speculative=ngram)) as llm:
        speculated = [answer(o) for o in await llm.generate(prompts, params)]
    assert together == alone
    assert speculated == alone
