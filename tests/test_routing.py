"""Which engine replica a request goes to (actors/routing.py), without processes: each policy's choice and the reason
it is counted under; the prefix anchors the engine reports (actors/engine/block_manager.py) against an independent
chain of hashes; and the client ledger over two replicas (actors/client_ledger.py): a replica's death moves only its
requests, a request's choices move together, outputs of the dead replica are stale, each replica's TextOutputs are
numbered apart."""

from __future__ import annotations

import hashlib

import numpy as np

from actors.engine.block_manager import BlockManager
from actors.engine.request import EngineRequest
from actors.prefix_hash import anchors
from actors.routing import Replicas
from messages.sampling_params import SamplingParams
from messages.wire import AddRequest, EngineStats, TextDelta, TextOutputs
from tests.http_table_harness import make_table, parsed, resumed

BS = 4  # block size


def add(tokens, salt=None) -> AddRequest:
    return AddRequest(request_id="r", prompt_token_ids=list(tokens), params=SamplingParams(cache_salt=salt))


def stats(replica: int, running=0, waiting=0, prefix=None, salt=None) -> EngineStats:
    return EngineStats(
        num_running=running, num_waiting=waiting, kv_usage=0.0, prompt_tokens_total=0, generation_tokens_total=0,
        late_aborts_total=0, replica=replica, prefix_anchors=anchors(prefix, BS, salt) if prefix else [],
    )  # fmt: skip


def chain(tokens: list[int], salt: bytes = b"") -> list[bytes]:
    """An independent reference: blake2b over the parent's digest and the block's int64 tokens, block by block."""
    out, parent = [], salt
    for i in range(len(tokens) // BS):
        block = np.array(tokens[i * BS : (i + 1) * BS], dtype="<i8").tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        out.append(parent)
    return out


def test_the_engine_reports_the_anchors_of_its_cached_blocks():
    """Cached blocks at chain depths 0, 1, 3, 7 are reported (8 bytes each), and an evicted one no longer is."""
    bm = BlockManager(num_blocks=12, block_size=BS, enable_caching=True)
    prompt = list(range(100, 141))  # 10 full blocks and one token
    req = EngineRequest("a", prompt, SamplingParams(max_tokens=4))
    bm.allocate(req, len(prompt))
    req.num_computed_tokens = len(prompt)
    bm.cache_full_blocks(req)
    expected = {h[:8] for depth, h in enumerate(chain(prompt)) if depth in (0, 1, 3, 7)}
    assert bm.anchors == expected == set(anchors(prompt, BS, None))
    bm.free(req)  # the tail first: evicted before the head
    other = EngineRequest("b", list(range(9)), SamplingParams(max_tokens=4))
    bm.allocate(other, 9)  # 3 blocks: the unused one, the tail's partial one and depth 9's: no anchor lost
    assert bm.anchors == expected
    bm.free(other)
    bm.allocate(EngineRequest("c", list(range(32)), SamplingParams(max_tokens=4)), 32)  # depths 8 to 1 evicted
    assert bm.anchors == {chain(prompt)[0][:8]}


def test_a_salt_changes_every_anchor():
    prompt = list(range(20))
    assert set(anchors(prompt, BS, "tenant-a")).isdisjoint(anchors(prompt, BS, None))
    assert anchors(prompt, BS, None) == [h[:8] for d, h in enumerate(chain(prompt)) if d in (0, 1, 3)]


def test_a_lora_adapter_changes_every_anchor_as_the_engine_hashes_it():
    """An adapter's requests are routed where its prefixes are cached: the router's anchors and the engine's block
    hashes both start from the salt and the adapter's digest."""
    prompt, lora = list(range(20)), "0" * 32
    ours = anchors(prompt, BS, None, lora)
    assert set(ours).isdisjoint(anchors(prompt, BS, None)) and set(ours).isdisjoint(anchors(prompt, BS, "x", lora))
    bm = BlockManager(num_blocks=16, block_size=BS, enable_caching=True)
    req = EngineRequest("r", prompt, SamplingParams(max_tokens=4, lora=lora))
    bm.allocate(req, len(prompt))
    req.num_computed_tokens = len(prompt)
    bm.cache_full_blocks(req)
    assert bm.anchors == set(ours)


def test_round_robin_takes_each_serving_replica_in_turn():
    replicas = Replicas(3, "round_robin", BS)
    assert [replicas.route(add([1])).index for _ in range(4)] == [0, 1, 2, 0]
    replicas[1].down.add("detokenizer.1")
    assert [replicas.route(add([1])).index for _ in range(4)] == [2, 0, 2, 0]
    assert replicas.routed == {("round_robin", "round_robin"): 8}


def test_least_loaded_weighs_waiting_four_times_running_and_counts_what_it_routed_since():
    replicas = Replicas(2, "least_loaded", BS)
    replicas.on_stats(stats(0, running=3))
    replicas.on_stats(stats(1, waiting=1))  # 4 > 3
    assert [replicas.route(add([1])).index for _ in range(3)] == [0, 0, 1]  # loads 3/4, 4/4 (equal: the first), 5/4
    replicas.on_stats(stats(0, running=9))  # a report resets its count
    assert replicas.route(add([1])).index == 1


def test_cache_aware_follows_the_deepest_anchor_unless_the_gap_is_too_large():
    shared, other = list(range(40)), list(range(500, 540))
    replicas = Replicas(2, "cache_aware", BS, load_gap=4)
    replicas.on_stats(stats(0, prefix=other[:20]))  # replica 0 holds a shallow prefix of `other` ...
    replicas.on_stats(stats(1, running=2, prefix=shared))  # ... replica 1 `shared`, busier
    assert replicas.route(add([*shared, 7])).index == 1
    assert replicas.route(add([*other, 7])).index == 0
    assert replicas.route(add([9] * 40)).index == 0  # no hit: the least loaded (0 + 1 routed < 2 + 1)
    replicas.on_stats(stats(1, running=8, prefix=shared))  # 8 > 2 + 4
    assert replicas.route(add(shared)).index == 0
    assert replicas.routed == {("cache_aware", r): n for r, n in (("cache_hit", 2), ("no_hit", 1), ("imbalance", 1))}


def test_cache_aware_keeps_a_burst_of_one_prefix_together_until_reports_show_it():
    """A prompt routed is counted as cached there over the replica's next two reports (then only what it reports)."""
    replicas = Replicas(2, "cache_aware", BS)
    system = list(range(64))
    first = replicas.route(add([*system, 1])).index
    assert [replicas.route(add([*system, i])).index for i in range(2, 6)] == [first] * 4
    replicas.on_stats(stats(first))  # reported before the prompt was cached
    assert replicas.route(add([*system, 9])).index == first
    for _ in range(2):  # two reports since it was last routed there, without it: forgotten
        replicas.on_stats(stats(first, running=1))
    assert replicas.route(add([*system, 9])).index == 1 - first  # (no hit: the least loaded)
    assert replicas.routed == {("cache_aware", "no_hit"): 2, ("cache_aware", "cache_hit"): 5}


def test_a_replica_death_moves_only_its_requests_and_a_requests_choices_together():
    table, metrics, sent = make_table(replicas=2, policy="round_robin")
    on0, on1 = table.add(parsed(n=2, rid="cmpl-a"), "http"), table.add(parsed(n=2, rid="cmpl-b"), "http")
    assert {c.record.replica.index for c in on0.choices} == {0} and {c.record.replica.index for c in on1.choices} == {1}
    gone = table.add(parsed(rid="cmpl-gone"), "http")  # on replica 0 again (round robin), then cancelled
    table.cancel(gone)
    b0, b1 = (c.engine_id for c in on1.choices)
    table.on_outputs(TextOutputs(step=0, deltas=[TextDelta(request_id=b0, seq=0, text="x", token_ids=[5])], number=0,
                                 replica=1))  # fmt: skip
    n = len(sent)
    assert table.on_down("detokenizer.1") and len(table.tombstones) == 1  # (replica 0's stays)
    assert resumed(sent[n:]) == [(b0, 1, [5], 1), (b1, 1, [], 0)]
    assert {c.record.replica.index for c in on1.choices} == {0}
    late = TextDelta(request_id=b0, seq=1, text="y", token_ids=[6], attempt=1)  # the old replica's, in flight
    table.on_outputs(TextOutputs(step=1, deltas=[late], number=1, replica=1))
    assert metrics.protocol.stale == 1 and on1.choices[0].num_tokens == 1
    ok = TextDelta(request_id=b0, seq=1, text="y", token_ids=[6], attempt=1)
    table.on_outputs(TextOutputs(step=1, deltas=[ok], number=0, replica=0))  # replica 0's numbering is its own
    assert on1.choices[0].num_tokens == 2 and not metrics.protocol.violations
    assert table.on_up("detokenizer.1") and resumed(sent) == resumed(sent[n:])  # nothing more moves
    assert metrics.protocol.resumes["death"] == 2


def test_requests_wait_while_no_replica_serves_and_go_to_the_first_back():
    table, _, sent = make_table(replicas=2, policy="round_robin")
    req = table.add(parsed(n=1), "http")
    table.on_down("scheduler.1")
    table.on_down("scheduler")
    assert not table.replicas.taking() and not resumed(sent)
    n = len(sent)
    later = table.add(parsed(rid="cmpl-later"), "http")  # while none serves: not sent, an orphan from the start
    assert len(sent) == n
    table.on_up("scheduler.1")
    ids = [c.engine_id for r in (req, later) for c in r.choices]
    assert resumed(sent) == [(rid, 1, [], 0) for rid in ids]
    assert {c.record.replica.index for r in (req, later) for c in r.choices} == {1}


def test_a_replica_whose_worker_is_down_keeps_its_requests_and_takes_new_ones_only_alone():
    table, _, sent = make_table(replicas=2, policy="round_robin")
    first = table.add(parsed(rid="cmpl-1"), "http")
    assert not table.on_down("worker") and not resumed(sent)  # its requests wait in its engine
    assert [table.replicas.route(add([1])).index for _ in range(2)] == [1, 1]
    table.on_down("scheduler.1")
    assert table.replicas.route(add([1])).index == 0 and first.choices[0].record.replica.index == 0
