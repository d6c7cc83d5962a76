"""A worker gang: the tensor-parallel ranks behind the one WorkerActor (`EngineConfig.tensor_parallel_size` > 1).

The WorkerActor's process is rank 0, the leader: the scheduler's one link (ExecuteStep in, StepResult out), the
sampler, the grammar masks. It makes the group's rendezvous (a file store in the runtime directory; across nodes a
TCPStore on --master-addr, its values sealed with a key from the cluster secret: gpu/distributed/store.py), spawns ranks
1..N-1 (`python -m actors.engine.gang`, each killed by the kernel when the leader dies), joins the group with them
once each has said so in the store (gpu/distributed/group.py), and says it is Ready once each has loaded. A rank holds its shard of the model and of the KV cache (its heads; every rank the
same block count). Each step, on every rank's device thread, in this order (actors/engine/executor.py):

1. the leader broadcasts the step's BatchSpec (msgpack: one broadcast to the group, not one send per rank);
2. every rank runs the forward on its shard (an all-reduce per row-parallel block); the logits are gathered on the
   leader only;
3. the leader samples and broadcasts the ids the next step reads (`BatchSpec.relay_slots`); every rank keeps them
   in its own device relay buffer, so async scheduling never sends a sampled token from the host.

While idle the leader broadcasts a keepalive every step_timeout_s / 2 (a follower waits for the next step under the
group's deadline); an empty broadcast ends the followers (the leader's shutdown). The gang lives and dies as one (a collective cannot go
on short of a member), and a death is a worker death as before: the supervisor restarts the worker process, which
starts a new gang; the scheduler resets it (a new epoch: the old gang's messages are dropped) and recomputes its
requests (actors/engine/recovery.py).

| event                                   | what happens                                                             |
|-----------------------------------------|--------------------------------------------------------------------------|
| a follower exits, however               | the leader sees it (a pidfd), logs the rank and its code, exits (code 4) |
| a follower hangs                        | the leader's step stops progressing: the scheduler's hang verdict        |
|                                         | (worker_link.py) has the leader exit (within step_timeout_s)             |
| a step raises on the leader             | the followers wait in a collective it will not call: the leader exits    |
| the leader dies                         | the kernel kills its followers (PDEATHSIG)                               |
| a collective's peer is gone / stuck     | gloo fails it at once / after the group's timeout (2 × step_timeout_s)   |
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import uuid

import msgspec
import torch

from actors.engine.config import EngineConfig
from actors.engine.executor import KEEPALIVE, follow, make_runner
from actors.engine.gang_nodes import Door
from actors.engine.gang_ranks import FollowerConfig, first_exit, spawn_rank
from actors.runtime import curve
from gpu.distributed.group import TensorParallel, join, rendezvous
from gpu.loading.config import ModelConfig
from messages.step import SpawnRanks

log = logging.getLogger("sluice.gang")
GANG_EXIT = 4  # the leader's exit code when its gang broke


def timeout_s(config: EngineConfig) -> float:
    """A collective's deadline: a step may take step_timeout_s without progress before the scheduler gives up."""
    return 2 * config.step_timeout_s


def bind_device(config: EngineConfig, index: int) -> torch.device:
    """A rank's device: on CUDA, the index-th of its node (set as the thread's current one), else the CPU."""
    if config.device in ("auto", "cuda") and torch.cuda.is_available():
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if config.device not in ("auto", "cpu"):
        raise ValueError(
            f'tensor parallelism places ranks itself: device must be "auto", "cuda" or "cpu", not {config.device!r}'
        )
    return torch.device("cpu")


def store_key() -> bytes:
    """The cluster's key for a gang's store across nodes (gpu/distributed/group.py's rendezvous): from the cluster
    secret in this process's environment, never from a command line or a spawn config."""
    return curve.derive(curve.cluster_secret(), "gang-store")


class Gang:
    """The leader's side: its node's followers, the other nodes' through the door (actors/engine/gang_nodes.py), and
    the group (built on the loop thread; `join` on the device thread, which runs every collective)."""

    def __init__(self, config: EngineConfig, num_blocks: int, log_level: str, rundir: str) -> None:
        self.config, self.size = config, config.tensor_parallel_size
        per_node, gang = self.size // config.nnodes, uuid.uuid4().hex
        if config.nnodes == 1:  # a new incarnation, a new store
            self.store, url = rendezvous(f"file://{rundir}/gang-{gang[:12]}", self.size, first=True)
        else:
            self.store, url = rendezvous(f"tcp://{config.master_addr}:0/{gang}", self.size, True, store_key())
        self.stopping = False
        self.tp: TensorParallel | None = None  # rank 0 of the group, once joined
        self.followers = {  # (spawned on the loop thread, which outlives them)
            rank: spawn_rank(FollowerConfig(engine=config, rank=rank, device_index=rank, store=url,
                                            num_blocks=num_blocks, parent_pid=os.getpid(), log_level=log_level))
            for rank in range(1, per_node)
        }  # fmt: skip
        log.info("gang of %d ranks: this node's followers %s", self.size, {r: p.pid for r, p in self.followers.items()})
        self.door = None
        if config.nnodes > 1:
            self.door = Door(config, SpawnRanks(
                gang=gang, store=url, engine=msgspec.to_builtins(config), num_blocks=num_blocks,
                log_level=log_level,
            ))  # fmt: skip

    def join(self) -> TensorParallel:
        """Rank 0 of the group, once every other rank is there to join it (device thread; a follower takes seconds
        to start: longer than a collective's deadline)."""
        self.store.wait([f"joining/{rank}" for rank in range(1, self.size)])
        self.tp = join(0, self.size, self.store, bind_device(self.config, 0), timeout_s(self.config))
        return self.tp

    def loaded(self) -> None:
        """Until every other rank loaded its shard (device thread): no collective waits on a load."""
        self.store.wait([f"loaded/{rank}" for rank in range(1, self.size)])

    async def watch(self) -> None:
        """Until a rank exits (here, or on another node: the door hears it); then the gang is over: this process
        exits (unless it is stopping)."""
        watches = [asyncio.ensure_future(self._local_exit()) if self.followers else asyncio.Future()]
        if self.door is not None:
            watches.append(asyncio.ensure_future(self.door.serve()))
        try:
            done, _ = await asyncio.wait(watches, return_when=asyncio.FIRST_COMPLETED)
            why = done.pop().result()
        except Exception as e:  # (a watch that fails cannot watch: the gang is given up all the same)
            why = f"its watch failed: {type(e).__name__}: {e}"
        finally:
            for w in watches:
                w.cancel()
        if not self.stopping:
            log.error("the gang is over (%s): the worker restarts", why)
            os._exit(GANG_EXIT)

    async def _local_exit(self) -> str:
        rank, code = await first_exit(self.followers)
        return f"rank {rank} exited with code {code}"

    def keepalive(self) -> None:
        """(device thread, idle) The followers' wait for the next step goes on."""
        if self.stopping:  # (after stop() the followers are gone)
            return
        try:
            self.tp.broadcast_bytes(KEEPALIVE)
        except RuntimeError as e:  # a follower is gone or stuck: the gang is over
            log.error("the gang is over (a keepalive failed: %s): the worker restarts", str(e).splitlines()[0])
            os._exit(GANG_EXIT)

    def stop(self) -> None:
        """End the followers: the empty broadcast (device thread, when the group was joined), then a kill for any
        of this node's that is still there (another node's launcher reaps its own)."""
        self.stopping = True
        if self.tp is not None:
            self.tp.broadcast_bytes(b"")
        for p in self.followers.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()


def follower_main(config: FollowerConfig) -> None:
    """A follower rank: join the group, load its shard, then run the leader's steps until the empty one."""
    from actors.runtime.process import die_with_parent, set_title

    die_with_parent(config.parent_pid)
    name = f"worker.rank{config.rank}"
    set_title(f"sluice:{name}")
    logging.basicConfig(level=config.log_level, format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s")
    engine = config.engine
    torch.set_num_threads(engine.threads())
    device = bind_device(engine, config.device_index)
    key = store_key() if engine.nnodes > 1 else b""
    store, _ = rendezvous(config.store, engine.tensor_parallel_size, False, key)
    store.set(f"joining/{config.rank}", "")
    tp = join(config.rank, engine.tensor_parallel_size, store, device, timeout_s(engine))
    runner = make_runner(engine, ModelConfig.from_path(engine.model), config.num_blocks)
    store.set(f"loaded/{config.rank}", "")
    log.info("rank %d of %d ready (%d KV blocks)", tp.rank, tp.size, runner.num_blocks)
    try:
        follow(tp, runner)
    except RuntimeError as e:  # (a collective failed: a rank is gone, or hung past the group's timeout)
        log.error("rank %d: the gang broke: %s", tp.rank, str(e).splitlines()[0])
        sys.exit(1)


if __name__ == "__main__":
    follower_main(msgspec.json.decode(sys.argv[1], type=FollowerConfig))
