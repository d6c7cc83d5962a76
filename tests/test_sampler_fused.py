"""The fused sampler (gpu/sampling/fused_triton.py, in Triton's interpreter on CPU) against the torch path.

- The processors' table applied by the prepare kernel equals the torch processors' logits bit for bit, on rows that
  combine every processor on the same ids (a bias on a banned id, penalties on allowed and banned ids).
- For the same uniforms (seeded rows) it draws the torch sort-free search's tokens, which the chi-square suites hold
  to their analytic targets (tests/test_sampler_threshold.py; on CUDA tests/test_sampler_distribution.py draws through
  the fused kernels too), on float32 and bfloat16 logits, greedy and random rows mixed, with processors.
- Rows without a finite maximum take torch.argmax's token; raw logprobs, ranks and top-N equal log_softmax's.
- The logits are left as they were; the metadata cache builds the edits table, reused while no row reads its output.
- A step makes no host sync (tests/host_syncs.py).
On a GPU the same tests run the compiled kernels: the processors still bit for bit (the prepare kernel rounds as
torch), the tokens in all but at most two rows (Triton's exp rounds unlike torch's: a draw on a boundary may move).
The launch budget of the fused sampler is counted in tests/test_launch_budget.py.
"""

import msgspec
import pytest
import torch

from gpu.sampling import MetadataCache, Sampler, SamplingMetadata, SamplingRow
from gpu.sampling.fused_triton import fused_sample, prepare
from gpu.sampling.sampler import _process
from messages.sampling_params import SamplingParams as SP
from tests.host_syncs import HostSyncs
from tests.test_sampler_threshold import kernel_rows

PROCESSORS = [
    SP(allowed_token_ids=[3, 7, 11, 250], logit_bias={7: 2.5, 11: -100.0}, repetition_penalty=1.3),
    SP(bad_words_token_ids=[[5], [9, 4], [3, 6]], logit_bias={5: 40.0}, frequency_penalty=0.4),
    SP(min_tokens=10, stop_token_ids=[2, 12], presence_penalty=0.6, frequency_penalty=-0.2),
    SP(repetition_penalty=0.7, presence_penalty=0.1),
    SP(logit_bias={0: 3.0, 299: -4.0}),
    SP(),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT, OUTPUT = [1, 2, 3, 3, 7, 250], [4, 9, 4, 12, 8, 3, 3]


def mixed_rows(logprobs: int | None = None) -> tuple[torch.Tensor, list[SamplingRow]]:
    """kernel_rows' truncations, seeded, then the processor rows, one greedy and one random of each; every row
    asking for `logprobs`."""
    x, truncations = kernel_rows()
    params = [msgspec.structs.replace(p, seed=i) for i, p in enumerate(truncations)]
    for i, p in enumerate(PROCESSORS):
        for temperature, seed in ((0.0, None), (0.8, 100 + i)):
            params.append(msgspec.structs.replace(p, temperature=temperature, seed=seed, top_p=0.9))
    rows = [
        SamplingRow(msgspec.structs.replace(p, logprobs=logprobs), PROMPT, OUTPUT, eos_token_ids=[0]) for p in params
    ]
    extra = 2.0 * torch.randn(len(rows) - len(x), x.shape[1], generator=torch.Generator().manual_seed(5))
    return torch.cat([x, extra]).to(DEVICE), rows


def reference(x: torch.Tensor, rows: list[SamplingRow]):
    return Sampler(sort_free="torch", fused=False)(x.float().clone(), SamplingMetadata.build(rows, x.shape[1], DEVICE))


def fused(x: torch.Tensor, rows: list[SamplingRow], block: int = 128):
    meta = SamplingMetadata.build(rows, x.shape[1], DEVICE, edits=True)
    return fused_sample(x, meta, torch.full((len(x), x.shape[1] + 5), float("nan"), device=DEVICE), block=block)


def same_tokens(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal on CPU (the interpreter), in all but two rows on a GPU (module docstring)."""
    return bool((a != b).sum() <= (2 if a.is_cuda else 0))


def test_the_edits_table_processes_as_the_torch_processors():
    x, rows = mixed_rows()
    expected = x.clone()
    meta = SamplingMetadata.build(rows, x.shape[1], DEVICE)
    _process(expected, meta)
    edits = SamplingMetadata.build(rows, x.shape[1], DEVICE, edits=True).edits
    got = prepare(
        x, edits, torch.full((len(x), x.shape[1] + 5), float("nan"), device=DEVICE), block=4
    )  # (segments in chunks)
    assert torch.equal(got, expected)
    assert got.isinf().any(1).sum() == 7  # (allowed ids, bad words and min_tokens: 6 rows; one row had -inf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_draws_the_torch_searchs_tokens(dtype):
    x, rows = mixed_rows()
    x = x.to(dtype)
    original = x.clone()
    sampled, logprobs = fused(x, rows)
    expected = reference(x, rows).sampled
    assert logprobs is None and len(set(expected.tolist())) > 12
    assert same_tokens(sampled, expected)
    assert torch.equal(x, original)  # the logits are not modified
    through = Sampler(fused=True)(x, SamplingMetadata.build(rows, x.shape[1], DEVICE, edits=True)).sampled
    assert same_tokens(through, expected)  # the sampler's own launch (its block size)


def test_rows_without_a_finite_maximum_take_their_argmax():
    x = torch.randn(4, 100, device=DEVICE)
    x[0, 5], x[0, 9], x[1, 7], x[2], x[3, 40] = float("nan"), float("inf"), float("inf"), float("-inf"), float("nan")
    rows = [SamplingRow(SP(top_p=0.9, top_k=5, seed=1), [], [])] * 3 + [SamplingRow(SP(temperature=0.0), [], [])]
    assert fused(x, rows, block=32)[0].tolist() == [5, 7, 0, 40] == torch.argmax(x, -1).tolist()


def test_raw_logprobs_ranks_and_top_n():
    x, rows = mixed_rows(logprobs=4)
    x = x.bfloat16()
    sampled, lp = fused(x, rows)
    raw = torch.log_softmax(x.float(), -1)
    assert torch.allclose(lp.sampled, raw.gather(1, sampled[:, None]).squeeze(1), atol=1e-5)
    assert lp.ranks.tolist() == (raw >= raw.gather(1, sampled[:, None])).sum(-1).tolist()
    top = raw.topk(4, -1)
    assert torch.allclose(lp.top_logprobs, top.values, atol=1e-5)
    assert torch.equal(lp.top_logprobs.isfinite(), top.values.isfinite())
    ref = reference(x, rows).logprobs
    assert torch.allclose(lp.top_logprobs, ref.top_logprobs, atol=1e-5)


@pytest.mark.parametrize("logprobs", [None, 4])
def test_a_step_never_syncs_with_the_host(logprobs):
    """Every launch of a mixed step (processors, greedy and random rows, logprobs or none) on the device's data alone:
    no host sync (tests/host_syncs.py), so async scheduling's next step is never held up by the sampler."""
    x, rows = mixed_rows(logprobs)
    meta = SamplingMetadata.build(rows, x.shape[1], DEVICE, edits=True)
    with HostSyncs() as syncs:
        Sampler(fused=True)(x.bfloat16(), meta)
    assert syncs.seen == []


def test_the_metadata_cache_builds_the_edits_table_and_rebuilds_it_as_outputs_grow():
    cache = MetadataCache(300, DEVICE, edits=True)
    static = [SamplingRow(SP(logit_bias={5: 1.0}), PROMPT, list(OUTPUT)), SamplingRow(SP(), PROMPT, list(OUTPUT))]
    first = cache.build(static)
    assert first.edits is not None and first.logit_bias is None and first.penalties is None
    assert cache.build(static) is first  # nothing in it reads the output: reused
    output = list(OUTPUT)
    penalised = [SamplingRow(SP(frequency_penalty=0.5), PROMPT, output)]
    counts = cache.build(penalised).edits.values.tolist()
    output.append(4)  # the row's next token: its count of 4 grows by one
    again = cache.build(penalised).edits.values.tolist()
    assert sum(again) == sum(counts) + 1 and len(again) == len(counts)
