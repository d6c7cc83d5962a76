"""/metrics end to end: the engine's per-request observations reach the HTTP actor's histograms."""

from __future__ import annotations

import asyncio

import pytest

from frontend.cli import build_parser
from frontend.metrics import Metrics

QUEUE_COUNT = ("sluice:request_queue_time_seconds_count", ())
QUEUE_SUM = ("sluice:request_queue_time_seconds_sum", ())


async def test_queue_time_is_observed_for_each_engine_request(server):
    before = await server.metrics()
    out = await server.client().completions.create(model=None, prompt="Hello", max_tokens=2, n=2)
    assert len(out.choices) == 2
    # n = 2: two engine requests, each observed once (earlier tests' requests may still be reported: at least)
    deadline = asyncio.get_running_loop().time() + 30
    while (got := await server.metrics())[QUEUE_COUNT] < before[QUEUE_COUNT] + 2:
        assert asyncio.get_running_loop().time() < deadline, "the queue-time histogram got no observations"
        await asyncio.sleep(0.05)
    assert got[QUEUE_SUM] >= before[QUEUE_SUM]


def series(metrics: dict, name: str, **labels) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_vllm_request_series_and_cache_config(server):
    """vLLM's per-request series (sizes, params, and the engine's prefill/decode/inference times of each choice),
    tokens per engine step, and cache_config_info."""
    before = await server.metrics()
    extra = {"ignore_eos": True}
    out = await server.client().completions.create(model=None, prompt=[5, 6, 7], max_tokens=3, n=2, extra_body=extra)
    assert out.usage.completion_tokens == 6
    got = await server.metrics()

    def delta(name: str) -> float:
        return series(got, "sluice:" + name) - series(before, "sluice:" + name)

    assert delta("request_success_total") == 0  # (labelled by reason)
    assert (
        series(got, "sluice:request_success_total", finished_reason="length")
        - series(before, "sluice:request_success_total", finished_reason="length")
        == 2
    )
    assert (delta("request_prompt_tokens_count"), delta("request_prompt_tokens_sum")) == (2, 6)
    assert delta("request_generation_tokens_sum") == 6 and delta("request_params_max_tokens_sum") == 6
    assert delta("request_max_num_generation_tokens_sum") == 12 and delta("request_params_n_sum") == 2
    for name in ("prefill", "decode", "inference"):
        assert delta(f"request_{name}_time_seconds_count") == 2, name
    assert delta("request_inference_time_seconds_sum") >= delta("request_decode_time_seconds_sum") >= 0
    deadline = asyncio.get_running_loop().time() + 30  # the engine's step sizes arrive with its next EngineStats
    while series(await server.metrics(), "sluice:iteration_tokens_total_count") <= series(
        before, "sluice:iteration_tokens_total_count"
    ):
        assert asyncio.get_running_loop().time() < deadline, "no engine step observed"
        await asyncio.sleep(0.05)
    config = {"block_size": "16", "enable_prefix_caching": "True", "num_gpu_blocks": "256"}
    assert series(got, "sluice:cache_config_info", **config) == 1


def test_metrics_prefix_names_every_series(capsys):
    """--metrics-prefix vllm: exposes the same series under vLLM's own names; a prefix that cannot start a
    Prometheus name fails at the command line."""
    text = Metrics("vllm:").render().decode()
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    assert names and all(n.startswith("vllm:") for n in names) and "vllm:num_requests_running" in names
    assert build_parser().parse_args(["serve", "m", "--metrics-prefix", "vllm:"]).metrics_prefix == "vllm:"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--metrics-prefix", "9x"])
    assert "cannot start a Prometheus metric name" in capsys.readouterr().err
