"""/metrics: the engine's per-request observations reach the HTTP actor's histograms; vLLM's parallel-sampling
series (n, the longest choice) once per prompt; every series labelled with vLLM's model_name and engine."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from frontend.cli import build_parser
from frontend.metrics import Metrics
from messages.wire import DetokStats, EngineStats, Finished
from tests.http_table_harness import make_table, parsed
from tests.waits import eventually


def series(metrics: dict, name: str, **labels) -> float:
    """The sum of `name`'s samples whose labels include `labels` (whatever their model_name and engine)."""
    return sum(v for (n, pairs), v in metrics.items() if n == name and set(labels.items()) <= set(pairs))


async def test_queue_time_is_observed_for_each_engine_request(server):
    count, total = "sluice:request_queue_time_seconds_count", "sluice:request_queue_time_seconds_sum"
    before = await server.metrics()
    out = await server.client().completions.create(model=None, prompt="Hello", max_tokens=2, n=2)
    assert len(out.choices) == 2
    # n = 2: two engine requests, each observed once (earlier tests' requests may still be reported: at least)

    async def observed() -> dict | None:
        got = await server.metrics()
        return got if series(got, count) >= series(before, count) + 2 else None

    got = await eventually(observed, "the queue-time histogram's observations", every=0.05)
    assert series(got, total) >= series(before, total)


async def test_vllm_request_series_and_cache_config(server):
    """vLLM's per-request series (sizes and params per choice, the engine's prefill/decode/inference times of each;
    n and the most tokens a choice generated once per prompt), tokens per engine step, and cache_config_info."""
    before = await server.metrics()
    extra = {"ignore_eos": True}
    out = await server.client().completions.create(model=None, prompt=[5, 6, 7], max_tokens=3, n=2, extra_body=extra)
    assert out.usage.completion_tokens == 6
    got = await server.metrics()

    def delta(name: str, **labels) -> float:
        return series(got, "sluice:" + name, **labels) - series(before, "sluice:" + name, **labels)

    assert delta("request_success_total", finished_reason="length") == 2
    assert (delta("request_prompt_tokens_count"), delta("request_prompt_tokens_sum")) == (2, 6)
    assert delta("request_generation_tokens_sum") == 6 and delta("request_params_max_tokens_sum") == 6
    assert (delta("request_max_num_generation_tokens_count"), delta("request_max_num_generation_tokens_sum")) == (1, 3)
    assert (delta("request_params_n_count"), delta("request_params_n_sum")) == (1, 2)
    for name in ("prefill", "decode", "inference"):
        assert delta(f"request_{name}_time_seconds_count") == 2, name
    assert delta("request_inference_time_seconds_sum") >= delta("request_decode_time_seconds_sum") >= 0
    assert delta("request_time_per_output_token_seconds_count") == 2  # (TPOT: decode time / 2 tokens after the first)
    steps = "sluice:iteration_tokens_total_count"  # the engine's step sizes arrive with its next EngineStats

    async def stepped() -> bool:
        return series(await server.metrics(), steps) > series(before, steps)

    await eventually(stepped, "an engine step on /metrics", every=0.05)
    config = {"block_size": "16", "enable_prefix_caching": "True", "num_gpu_blocks": "256"}
    assert series(got, "sluice:cache_config_info", **config) == 1


async def test_a_stop_finish_is_counted_by_its_reason(server):
    """A stop token ends the choice with finish_reason stop, counted in request_success_total by the time the
    response is written."""
    before = await server.metrics()
    stop = {"allowed_token_ids": [42], "stop_token_ids": [42]}  # the first token is the stop token
    out = await server.client().completions.create(model=None, prompt="Hi", max_tokens=5, extra_body=stop)
    assert (out.choices[0].finish_reason, out.choices[0].model_extra["stop_reason"]) == ("stop", 42)
    stops = [
        series(m, "sluice:request_success_total", finished_reason="stop") for m in (before, await server.metrics())
    ]
    assert stops[1] - stops[0] == 1


def test_n_and_the_longest_choice_are_observed_once_per_prompt_when_its_choices_have_finished():
    """vLLM's parallel sampling: request_params_n and request_max_num_generation_tokens are observed once per
    prompt, after its n choices have all finished: n, and the most tokens one of them generated."""
    table, metrics, _ = make_table()
    req = table.add(parsed(n=2, prompts=((1, 2), (3,))), "http")
    labels = {"model_name": metrics.model, "engine": "0"}

    def observed(name: str) -> tuple[float, float]:
        get = metrics.registry.get_sample_value
        return get(f"sluice:{name}_count", labels), get(f"sluice:{name}_sum", labels)

    seen = []
    for c, length in zip(req.choices, (4, 7, 2, 1), strict=True):
        ids = list(range(length))
        table.on_finished(
            Finished(request_id=c.engine_id, finish_reason="length", token_ids=ids, num_output_tokens=length)
        )
        seen.append((observed("request_params_n"), observed("request_max_num_generation_tokens")))
    assert seen == [
        ((0, 0), (0, 0)),
        ((1, 2), (1, 7)),  # the first prompt's choices: 4 and 7 tokens
        ((1, 2), (1, 7)),
        ((2, 4), (2, 9)),  # the second's: 2 and 1
    ]


def test_every_series_is_labelled_with_the_model_name_and_engine():
    """vLLM's labelnames: every sample, of the HTTP actor's metrics and of the engine's and detokenizer's snapshots
    (cache_config_info and the per-position spec decode counts included), carries model_name and engine "0"."""
    metrics = Metrics("sluice:", "SmolLM2")
    cache = {"block_size": "16", "num_gpu_blocks": "8", "enable_prefix_caching": "True"}
    metrics.on_engine_stats(
        EngineStats(
            num_running=1, num_waiting=0, kv_usage=0.5, prompt_tokens_total=3, generation_tokens_total=2,
            late_aborts_total=0, spec_accepted_per_pos=[4, 1], cache_config=cache,
        )
    )  # fmt: skip
    metrics.on_detok_stats(
        DetokStats(stale_outputs_dropped_total=0, protocol_violations_total=0, num_tombstones=0, iteration_tokens=[5])
    )
    metrics.aborts.labels(0, "client").inc()
    metrics.http_requests.labels(0, "/v1/completions", "200").inc()
    samples = [s for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples]
    names = {s.name for s in samples}
    assert {"sluice:cache_config_info", "sluice:spec_decode_num_accepted_tokens_per_pos_total"} <= names
    assert {"sluice:request_aborts_total", "sluice:http_requests_total", "sluice:num_tombstones"} <= names
    assert {(s.labels.get("model_name"), s.labels.get("engine")) for s in samples} == {("SmolLM2", "0")}
    assert {s.labels["reason"] for s in samples if s.name == "sluice:request_aborts_total"} == {"client"}


async def test_the_server_labels_its_series_with_its_served_model_name(server):
    async with server.session() as s, s.get("/metrics") as resp:
        text = await resp.text()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    assert {(s.labels.get("model_name"), s.labels.get("engine")) for s in samples} == {(server.model_dir.name, "0")}


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


async def test_token_counters_count_each_token_once_as_vllm(server):
    """vLLM's own accounting test: 10 requests one after another, 9 prompt tokens and 10 generated tokens each: the
    prompt and generation counters rise by exactly 90 and 100, and the tokens-per-step histogram by 100 steps holding
    190 tokens (a step counts the tokens it generated, and a request's whole prompt in the step of its first token;
    steps that generated nothing, or whose tokens were discarded, are not observed). A request a stop string ends
    counts the tokens it was given, not those the engine computed before the Abort reached it."""

    async def idle():
        async def quiet() -> bool:
            return not any(v for d in (await server.idle()).values() for v in d.values())

        await eventually(quiet, "the server idle", every=0.05)

    await idle()
    names = ["prompt_tokens_total", "generation_tokens_total", "iteration_tokens_total_sum",
             "iteration_tokens_total_count"]  # fmt: skip
    settled = None
    while settled != (settled := [series(await server.metrics(), "sluice:" + n) for n in names]):
        await asyncio.sleep(1.1)  # (an EngineStats a second: the earlier tests' last steps reported)
    before = settled
    for i in range(10):
        out = await server.client().completions.create(
            model=None, prompt=[100 + i] * 9, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
        )
        assert out.usage.completion_tokens == 10
    # and one ended by a stop string within its tokens: only the tokens it was given count (the engine computed more)
    probe = await server.client().completions.create(
        model=None, prompt=[7] * 9, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    stop = probe.choices[0].text[len(probe.choices[0].text) // 2 :][:2]
    out = await server.client().completions.create(
        model=None, prompt=[7] * 9, max_tokens=10, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    k = out.usage.completion_tokens
    assert out.choices[0].finish_reason == "stop" and 0 < k < 10
    await idle()
    expected = [a + d for a, d in zip(before, [90 + 18, 100 + 10 + k, 190 + 19 + 9 + k, 100 + 10 + k], strict=True)]

    rises: dict[str, float] = {}

    async def counted() -> bool:
        got = [series(await server.metrics(), "sluice:" + n) for n in names]
        rises.update(zip(names, [g - b for g, b in zip(got, before, strict=True)], strict=True))
        return got == expected

    try:
        await eventually(counted, "the counters' expected rises", every=0.1)
    except AssertionError:
        pytest.fail(f"the counters rose by {rises}")
