"""The scheduler's LoRA cap (actors/engine/admission.py): never more than max_loras adapters in a step, a request of
another adapter passed over without holding up those behind it, and admitted within max_num_seqs overtakes however
many requests of the running adapters keep coming (tests.scheduler_harness checks every step's contexts and output)."""

import random

from actors.engine.lora_table import LoraTable
from tests.scheduler_harness import Harness, prompts


def adapters_of(batch) -> set[str]:
    return {r.lora for r in batch.rows} - {None}


def test_a_hundred_adapters_two_at_a_time():
    h = Harness(max_num_seqs=4, max_loras=2, num_blocks=128)
    order = list(range(120))
    random.Random(0).shuffle(order)  # (100 adapters' requests and 20 of the base model's, mixed)
    for i, prompt in zip(order, prompts(120, seed=1), strict=True):
        h.add(f"r{i}", prompt, max_tokens=3 + i % 5, lora=f"adapter-{i}" if i < 100 else None)
    seen = set()
    while h.sched.has_unfinished():
        batch = h.step()
        assert len(adapters_of(batch)) <= 2, f"step {batch.step} runs {sorted(adapters_of(batch))}"
        assert len({r.params.lora for r in h.sched.running} - {None}) <= 2
        seen |= adapters_of(batch)
    h.run()
    assert len(seen) == 100 and len(h.finish) == 120


def test_a_hundred_adapters_through_three_slots():
    """--max-cpu-loras 3, --max-loras 2: the worker holds at most three adapters, the least recently run one that no
    running request uses makes room, and every request of a hundred adapters ends."""
    loras = LoraTable({f"adapter-{i}": f"/dir/{i}" for i in range(100)}, capacity=3, held=["adapter-0"])
    h = Harness(max_num_seqs=4, max_loras=2, num_blocks=128, loras=loras)
    for i, prompt in enumerate(prompts(100, seed=2)):
        h.add(f"r{i}", prompt, max_tokens=2 + i % 4, lora=f"adapter-{i}")
    while h.sched.has_unfinished():
        batch = h.step()
        assert len(adapters_of(batch)) <= 2
    h.run()
    assert len(h.finish) == 100 and loras.loads == 99 and loras.evictions == 97
    assert h.stalls == 0  # (every adapter was read while other requests ran: no step waited for one)


def test_a_request_over_the_cap_does_not_block_those_behind_it():
    h = Harness(max_num_seqs=4, max_loras=1)
    h.add("a-long", [1, 2, 3], max_tokens=20, lora="a")
    h.step()
    h.add("b", [4, 5], max_tokens=2, lora="b")  # over the cap while a-long runs
    h.add("a-short", [6, 7], max_tokens=2, lora="a")
    h.add("base", [8, 9], max_tokens=2)
    batch = h.step()
    assert {r.request_id for r in batch.rows} == {"a-long", "a-short", "base"}
    assert [r.request_id for r in h.sched.waiting] == ["b"]
    h.run()


def test_a_passed_over_request_is_admitted_within_max_num_seqs_overtakes():
    """Requests of adapter a keep coming; b's request is overtaken by at most max_num_seqs of them, then a's drain
    and b runs. Without the bound (overtaken never stops admission) it would wait for as long as a's kept coming."""
    h = Harness(max_num_seqs=3, max_loras=1, num_blocks=128)
    h.add("a0", [1, 2], max_tokens=4, lora="a")
    h.step()
    h.add("b", [3, 4], max_tokens=2, lora="b")
    admitted, k = [], 1
    while "b" not in admitted:
        h.add(f"a{k}", [5, k % 90], max_tokens=4, lora="a")
        k += 1
        batch = h.step()
        admitted += [r.request_id for r in batch.rows if r.num_computed == 0]
        assert k < 40, "b was never admitted"
    assert admitted.index("b") <= 3, admitted
    h.run()


def test_lora_requests_info_names_the_running_and_waiting_adapters():
    """vLLM's lora_requests_info: the engine reports digests, /metrics names them by their served names."""
    from prometheus_client.parser import text_string_to_metric_families

    from actors.engine.metrics import lora_info
    from frontend.metrics import Metrics
    from messages.wire import EngineStats

    h = Harness(max_num_seqs=4, max_loras=1)
    h.add("a", [1, 2, 3], max_tokens=5, lora="d-a")
    h.add("b", [4, 5], max_tokens=2, lora="d-b")
    h.step()
    info = lora_info(h.sched)
    assert info == {"max_lora": "1", "running_lora_adapters": "d-a", "waiting_lora_adapters": "d-b"}
    info |= {"loads": "3", "evictions": "1"}
    metrics = Metrics(model_name="m")
    metrics.lora_names = {"d-a": "sql", "d-b": "chat"}
    metrics.on_engine_stats(EngineStats(num_running=1, num_waiting=1, kv_usage=0.0, prompt_tokens_total=0,
                                        generation_tokens_total=0, late_aborts_total=0, lora_info=info))  # fmt: skip
    samples = [s for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples]
    (sample,) = [s for s in samples if s.name == "sluice:lora_requests_info"]
    assert sample.labels["running_lora_adapters"] == "sql" and sample.labels["waiting_lora_adapters"] == "chat"
    assert sample.labels["max_lora"] == "1" and sample.value > 1e9  # (the time of the report, as vLLM's)
    counts = {s.name: s.value for s in samples if s.name.startswith("sluice:lora_") and s.name.endswith("_total")}
    assert counts == {"sluice:lora_loads_total": 3, "sluice:lora_evictions_total": 1}
    h.run()
    assert lora_info(h.sched) == {"max_lora": "1", "running_lora_adapters": "", "waiting_lora_adapters": ""}


def test_an_unregistered_adapter_keeps_its_slot_until_its_requests_end():
    """An unload while a request of it runs: its slot stays wanted (the worker keeps it) until the request ends, then
    the next admission frees it; a new request naming it is refused at the intake meanwhile (tests/test_lora_e2e.py)."""
    loras = LoraTable({"d-a": "/a", "d-b": "/b"}, capacity=2, held=["d-a", "d-b"])
    h = Harness(max_num_seqs=4, max_loras=2, loras=loras)
    h.add("a", [1, 2, 3], max_tokens=6, lora="d-a")
    h.step()
    loras.unregister("d-a")
    assert "d-a" not in loras.paths and "d-a" in loras.wanted
    h.step()
    assert "d-a" in h.worker_loras  # (its request still runs)
    h.run()
    h.add("b", [4, 5], max_tokens=2, lora="d-b")  # (the next admission sweeps)
    h.run()
    assert "d-a" not in loras.wanted and h.worker_loras == {"d-b"}


def test_a_running_request_whose_adapter_breaks_fails_alone():
    """The worker cannot load a running request's adapter (its files broke after the check; a new worker state must
    read it again): that request ends with an error saying why, the others run on, and the next request naming it is
    refused at admission (until it is registered again)."""
    loras = LoraTable({"d-a": "/a", "d-b": "/b"}, capacity=2, held=["d-a", "d-b"])
    h = Harness(max_num_seqs=4, max_loras=2, loras=loras)
    h.add("a", [1, 2, 3], max_tokens=6, lora="d-a")
    h.add("b", [4, 5], max_tokens=6, lora="d-b")
    h.add("base", [6, 7], max_tokens=6)
    h.step()
    h.broken_loras, h.worker_loras = {"d-a"}, {"d-b"}  # (as after a worker restart)
    h.run()
    assert h.finish["a"][0] == "error" and "broken files" in h.requests["a"].error
    assert h.finish["b"] == h.finish["base"] == ("length", None) and len(h.tokens["b"]) == 6
    h.add("a2", [8, 9], max_tokens=2, lora="d-a")
    h.run()
    assert h.finish["a2"][0] == "error" and "broken files" in h.requests["a2"].error
