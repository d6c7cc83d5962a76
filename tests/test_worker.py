"""The ExecuteStep -> StepResult link, unit level (issue 17): the worker runs steps in seq order within an epoch
(a duplicate or stale step is ignored, a gap breaks the epoch, a new epoch starts afresh), its persistent batch
follows the scheduler's full data and deltas, messages survive the codec; the scheduler drops the steps of a
lost worker, recomputes every running request, and runs a suspect of a failed step in steps of its own. A step
that never answers is hung only when the worker's heartbeats show it making no progress (issue 28); silence is a
lost message; the device thread's progress counter moves inside a forward."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from actors.engine.config import EngineConfig
from actors.engine.request import EngineRequest
from actors.engine.worker import Worker
from actors.engine.worker_link import ProcessWorker, WorkerLost, execute_step
from actors.runtime import Actor
from gpu.batch import BatchSpec, ScheduledRow
from gpu.loading.config import ModelConfig
from gpu.runner.slot_tables import TablesDisagree
from messages.codec import Codec
from messages.sampling_params import SamplingParams
from messages.step import ExecuteStep, GrammarMasks, StepHung, StepProgress, StepResult, WorkerRequest
from messages.wire import TokenLogprobs
from tests.scheduler_harness import FakeModel, Harness, expected, prompts
from tests.tiny_model import make_tiny_model_dir

SEEDED = SamplingParams(temperature=1.0, seed=11, max_tokens=8)


def make_worker(model_dir: str, **overrides) -> Worker:
    config = EngineConfig(model=model_dir, num_kv_blocks=16, block_size=4, max_model_len=64, max_num_seqs=4,
                          max_num_batched_tokens=32, engine_threads=1, dtype="float32", **overrides)  # fmt: skip
    return Worker(config, ModelConfig.from_path(model_dir), 16)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny-worker") / "model", seed=0))


@pytest.fixture(scope="module")
def worker(tiny_dir):
    return make_worker(tiny_dir)


def prefill(epoch: int, seq: int, rid: str = "a", output: list[int] = ()) -> ExecuteStep:
    """A's prompt, fed whole: it samples its output token number len(output)."""
    prompt = [5, 6, 7, *output]
    row = ScheduledRow(rid, 0, prompt, 0, [0, 1], True, output_position=len(output))
    return ExecuteStep(
        epoch=epoch, seq=seq, batch=BatchSpec(seq, [row]), new=[WorkerRequest(rid, [5, 6, 7], list(output), SEEDED)]
    )


def test_steps_run_in_seq_order_within_an_epoch(worker):
    first = worker.launch(prefill(0, 0)).result()
    assert first.failure is None and len(first.sampled) == 1
    assert worker.launch(prefill(0, 0)) is None  # a duplicate is not answered
    gap = worker.launch(prefill(0, 2)).result()
    assert (gap.failure, gap.error) == ("gap", "ExecuteStep 2 of epoch 0 came before 1")
    assert (
        worker.launch(prefill(0, 1)).result().failure == "gap"
    )  # the epoch is broken: even the missing step is refused
    again = worker.launch(prefill(1, 0)).result()  # a new epoch: the persistent batch starts afresh
    assert again.failure is None and again.sampled == first.sampled  # (seeded: keyed by the output position)
    assert worker.launch(prefill(0, 3)) is None  # a step of an older epoch is stale


def test_the_persistent_batch_follows_full_data_and_deltas(worker):
    """A seeded request's sample at a position depends on its history only through the penalties: with one, the
    worker's deltas must give it the same history as a request sent whole."""
    params = SamplingParams(temperature=1.0, seed=3, repetition_penalty=1.5, max_tokens=8)
    decode = ScheduledRow("b", 1, [9], 5, [2, 3], True, output_position=2)
    whole = ExecuteStep(epoch=2, seq=0, batch=BatchSpec(0, [ScheduledRow("b", 1, [5, 6, 7, 8, 9], 0, [2, 3], True, output_position=2)]),
                        new=[WorkerRequest("b", [5, 6, 7], [8, 9], params)])  # fmt: skip
    reference = worker.launch(whole).result()
    first = ExecuteStep(epoch=3, seq=0, batch=BatchSpec(0, [ScheduledRow("b", 1, [5, 6, 7, 8], 0, [2, 3], True, output_position=1)]),
                        new=[WorkerRequest("b", [5, 6, 7], [8], params)])  # fmt: skip
    assert worker.launch(first).result().error is None
    delta = ExecuteStep(epoch=3, seq=1, batch=BatchSpec(1, [decode]), appended={"b": [9]})
    assert worker.launch(delta).result().sampled == reference.sampled
    unknown = ExecuteStep(epoch=3, seq=2, batch=BatchSpec(2, [decode]), freed=["b"], appended={"b": [1]})
    failed = worker.launch(unknown).result()  # a delta for a request it does not hold: a bug
    assert failed.failure == "raised" and "KeyError" in failed.error


def test_a_step_sends_the_worker_the_output_its_sampling_reads_and_no_more():
    """ExecuteStep.appended: a plain request's output never (once it is new there), a penalized one's every token, a
    min_tokens one's until the worker holds min_tokens (a verified run of drafts that passes it is sent whole)."""
    kinds = {
        "plain": SamplingParams(),
        "penal": SamplingParams(presence_penalty=0.5),
        "early": SamplingParams(min_tokens=3),
    }
    reqs = {rid: EngineRequest(rid, [5, 6], p) for rid, p in kinds.items()}
    batch = BatchSpec(0, [ScheduledRow(rid, i, [7], 2, [0], True) for i, rid in enumerate(reqs)])
    assert [w.request_id for w in execute_step(batch, reqs, 1, 0, [])[0].new] == list(kinds)
    for tokens, appended in (([1, 2], ["penal", "early"]), ([3, 4, 5], ["penal", "early"]), ([6], ["penal"])):
        for req in reqs.values():
            req.output_token_ids += tokens
        assert execute_step(batch, reqs, 1, 1, [])[0].appended == dict.fromkeys(appended, tokens)


def test_a_row_keeping_blocks_its_slot_lacks_fails_its_step_blaming_nobody(worker):
    row = ScheduledRow("c", 2, [9], 8, [], True, blocks_from=2)  # (the two sides' bookkeeping, not the request's)
    msg = ExecuteStep(epoch=4, seq=0, batch=BatchSpec(0, [row]), new=[WorkerRequest("c", [5, 6, 7], [], SEEDED)])
    failed = worker.launch(msg).result()
    assert failed.failure == "gap" and "c's row keeps 2 blocks of slot 2" in failed.error
    again = worker.launch(msgspec.structs.replace(msg, epoch=5)).result()  # twice in a row: blamed, no endless reset
    assert again.failure == "raised" and "c's row keeps 2 blocks" in again.error


def test_a_gangs_leader_refuses_such_a_step_before_its_followers_see_it(worker, monkeypatch):
    """(A follower would raise in the step's first collective: the gang dies instead of one reset, and the ranks'
    kept tables part.)"""
    gang = type("Gang", (), {"size": 2, "sent": [], "broadcast_bytes": lambda self, data: self.sent.append(data)})()
    monkeypatch.setattr(worker.executor, "tp", gang)
    row = ScheduledRow("d", 3, [9], 8, [], True, blocks_from=2)
    with pytest.raises(TablesDisagree, match="d's row keeps 2 blocks of slot 3"):
        worker.executor.run(BatchSpec(0, [row]), [])
    assert gang.sent == [] and not worker.executor.followed


def test_step_messages_survive_the_codec():
    codec = Codec()
    msg = prefill(4, 9, output=[1, 2])
    msg.masks = GrammarMasks(positions=[0], bitmask=b"\xff" * 8, deferred=[1])
    result = StepResult(epoch=4, seq=9, step=3, sampled=[7], num_emitted=None, logprobs=TokenLogprobs([-0.5], [1]))
    for m in (msg, result):
        assert codec.decode(codec.encode(m)) == m


def lose_worker(h: Harness) -> None:
    """What the scheduler actor does when the worker is lost: its steps in flight dropped, its KV gone."""
    for batch, _ in h.queue:
        h.sched.drop(batch)
    h.queue.clear()
    h.sched.forget_device_state()
    h.model = FakeModel(h.model.bs)  # a read of KV not written since would fail


@pytest.mark.parametrize("one_ahead", [False, True])
def test_a_lost_worker_costs_a_recompute_and_nothing_else(one_ahead):
    """Every running request recomputes its prompt and the tokens it emitted (the prefix cache forgotten: its
    blocks' KV is gone too) and ends exactly as an undisturbed run."""
    h = Harness(one_ahead=one_ahead, num_blocks=40, budget=16, max_num_seqs=4, caching=True)
    cases = {}
    for i, prompt in enumerate(prompts(6, seed=5, lo=8, hi=20)):
        h.add(f"r{i}", prompt, max_tokens=12, ignore_eos=True)
        cases[f"r{i}"] = expected(prompt, SamplingParams(max_tokens=12, ignore_eos=True), 64)
    for losses in range(3):
        for _ in range(4 + losses):
            h.step()
        lose_worker(h)
    h.run()
    assert {rid: (h.tokens[rid], h.finish[rid]) for rid in cases} == cases
    assert h.sched.num_preemptions > 0


def test_a_suspect_runs_in_steps_of_its_own_until_it_samples():
    h = Harness(num_blocks=40, budget=16, max_num_seqs=4)
    for i, prompt in enumerate(prompts(3, seed=6, lo=20, hi=20)):
        h.add(f"r{i}", prompt, max_tokens=3, ignore_eos=True)
    h.step()
    lose_worker(h)
    h.sched.requests["r0"].failed_steps = 1  # (the actor counts the requests of the dropped steps)
    alone = [h.step() for _ in range(2)]  # 20 prompt tokens at a budget of 16: the rest of it would leave room
    assert [{r.request_id for r in b.rows} for b in alone] == [{"r0"}, {"r0"}]
    assert h.sched.requests["r0"].failed_steps == 0  # it sampled
    assert {r.request_id for r in h.step().rows} == {"r0", "r1"}  # the others join again
    h.run()


def test_the_progress_counter_moves_inside_a_forward(tiny_dir):
    """A process worker's heartbeats can tell a long forward from a stuck one: in the Python layer loop, between its
    first layer and its last the counter moves; idle, the worker says it waits (for nothing of its own)."""
    worker = make_worker(tiny_dir, worker="process")
    model = worker.executor.runner.model.model
    model.native_loop, layers, beats = None, model.layers, []  # (the Python loop: its layers' hooks)
    hooks = [layers[0].register_forward_pre_hook(lambda *_: beats.append(worker.beat())),
             layers[-1].register_forward_hook(lambda *_: beats.append(worker.beat()))]  # fmt: skip
    assert worker.launch(prefill(7, 0)).result().failure is None
    for hook in hooks:
        hook.remove()
    first, last = beats
    assert (first.epoch, first.seq, first.waiting) == (last.epoch, last.seq, last.waiting) == (7, 0, False)
    assert last.progress > first.progress
    idle = worker.beat()
    assert idle.waiting and idle.progress > last.progress


def test_the_native_layer_loop_counts_its_layers_into_the_progress(tiny_dir):
    """The native loop (one call for every layer) counts each layer as it runs it (gpu/runner/native_loop.py), read
    by the heartbeats; a loop rebuilt as adapters come goes on from the count of the one it replaces."""
    from gpu.runner.native_loop import native_loop

    worker = make_worker(tiny_dir, worker="process")
    runner = worker.executor.runner
    loop, before = runner.model.model.native_loop, worker.beat().progress
    if loop is None:
        pytest.skip("no native CPU kernels built for this CPU")
    assert loop.layers_done() == 0
    assert worker.launch(prefill(7, 0)).result().failure is None
    assert loop.layers_done() == len(runner.model.model.layers)  # (the step ran in it)
    assert worker.beat().progress == before + 2 + loop.layers_done()  # (the step begun and done, and its layers)
    assert native_loop(runner.model, runner.attention, runner.lora, loop).layers_done() == loop.layers_done()


class Scheduler(Actor):
    """The link's actor, as far as the link uses it: what it tells the worker."""

    def __init__(self):
        super().__init__()
        self.sent, self.told = [], asyncio.Event()

    def tell(self, dst, msg) -> None:
        self.sent.append(msg)
        self.told.set()


def beat(progress: int, waiting: bool = False) -> StepProgress:
    return StepProgress(epoch=1, seq=0, progress=progress, waiting=waiting)


async def unanswered(link: ProcessWorker, *beats: StepProgress) -> WorkerLost:
    """A step that never answers, with these heartbeats before its result is awaited."""
    handle = link.submit(prefill(1, 0))
    for b in beats:
        link.on_progress(b)
    with pytest.raises(WorkerLost) as lost:
        await link.result(handle)
    return lost.value


@pytest.mark.parametrize(
    ("beats", "verdict"),
    [
        ((), "lost"),  # silence: a lost message (a process whose loop hangs misses the supervisor's pings)
        ((beat(5),), "lost"),  # its last beat progressed: silence since
        ((beat(5), beat(5)), "hung"),  # beats that came without progress
        ((beat(5), beat(5), beat(5, waiting=True)), "lost"),  # the step waits for the scheduler's masks
        ((beat(5), beat(5), beat(4)), "hung"),  # (an overtaken older beat says nothing)
        ((beat(5), beat(5), beat(6)), "lost"),
    ],
)
async def test_a_step_is_hung_only_when_its_beats_show_no_progress(beats, verdict):
    link = ProcessWorker(Scheduler(), "worker", timeout_s=0.05)
    lost = await unanswered(link, *beats)
    assert (lost.failure, lost.blames) == (verdict, verdict == "hung")
    assert link.pending == {}


async def test_a_hung_worker_is_asked_to_exit_until_it_dies_and_costs_one_reset():
    scheduler = Scheduler()
    link = ProcessWorker(scheduler, "worker", timeout_s=0.05)
    assert "step 0 of epoch 1 hung" in str(await unanswered(link, beat(5), beat(5)))
    ready = asyncio.create_task(link.ready())
    while sum(isinstance(m, StepHung) for m in scheduler.sent) < 2:  # asked again: the first ask may be lost
        scheduler.told.clear()
        await scheduler.told.wait()
    assert {m.epoch for m in scheduler.sent if isinstance(m, StepHung)} == {1}
    link.down()  # (ActorDown: handled by the actor, which wakes its `until`)
    scheduler.moved()
    await asyncio.sleep(0)
    assert not ready.done() and not link.reset_due  # its state was dropped when it was found hung
    link.up.set()  # (ActorUp)
    await ready
    assert (await unanswered(link, beat(0), beat(0))).failure == "hung"  # the new process counts from 0: heard


async def test_only_a_wait_runs_the_deadline_and_progress_moves_it():
    """A step nobody waits for is never judged (a held one, an idle marker's); a beat whose counter moved, due before
    the deadline, moves it past a result due after the first one. (A stalled loop fires due timers in order.)"""
    link = ProcessWorker(Scheduler(), "worker", timeout_s=0.05)
    idle = link.submit(prefill(1, 0))
    await asyncio.sleep(0.1)  # (twice the timeout)
    assert not idle.done()
    link.on_result(StepResult(epoch=1, seq=0, step=0, sampled=[7]))
    assert (await link.result(idle)).sampled == [7]
    handle, loop = link.submit(prefill(1, 1)), asyncio.get_running_loop()
    loop.call_at(loop.time() + 0.04, link.on_progress, StepProgress(epoch=1, seq=1, progress=1))
    loop.call_at(loop.time() + 0.07, link.on_result, StepResult(epoch=1, seq=1, step=1, sampled=[8]))
    assert (await link.result(handle)).sampled == [8]


async def test_a_result_that_comes_as_the_deadline_expires_is_taken():
    """The timeout fires and the StepResult is handled in the same turn of the loop: the result settles the step
    (re-arming the expiring deadline used to raise in the handler, and the step was then judged lost)."""
    link = ProcessWorker(Scheduler(), "worker", timeout_s=0.05)
    handle = link.submit(prefill(1, 0))
    waiting = asyncio.ensure_future(link.result(handle))
    await asyncio.sleep(0)  # (result() is waiting under its deadline)
    result = StepResult(epoch=1, seq=0, step=0, sampled=[7])
    asyncio.get_running_loop().call_at(link._watchdog.when(), link.on_result, result)
    assert await waiting is result
