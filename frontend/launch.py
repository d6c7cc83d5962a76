"""Launch a server: the HTTP, engine and detokenizer processes under the launcher's supervisor (and the door of its
replicas on other nodes); or a headless node's engine replica (`serve_node`).

Everything that can fail fast does so before any process starts: the model is resolved (the
bundled default is converted on first use, a .gguf gets its card in the cache) and checked, it must fit in the
host's memory (frontend/memory_check.py), and a fixed port is test-bound. Port 0 is resolved to a free port here, so
a restarted HTTP process binds the same one. The processes start together: the HTTP front listens while the engine
replicas load (503 until each is ready: frontend/readiness.py), and `start()` returns once the server serves.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import socket
import time
from pathlib import Path

import msgspec
import torch
from tqdm import tqdm

from actors.engine.config import EngineConfig, LoraConfig
from actors.graph import engine_processes, replica_processes
from actors.replica_link import Door, NodeLink, Proxy
from actors.runtime import (
    ActorSpec,
    ActorSystem,
    AskTimeout,
    FaultPlan,
    ProcessSpec,
    RestartPolicy,
    StartupError,
    curve,
)
from actors.runtime.actor import Actor
from frontend.http_base import HttpConfig
from frontend.memory_check import MemoryNeed, check_memory, explain, memory_need
from gpu.loading.config import ModelConfig, ModelLoadError
from gpu.loading.convert import ConversionError, default_model_dir
from gpu.loading.lora import LoraError, read_adapter
from gpu.loading.weights import check_checkpoint, check_quantization
from gpu.models import REGISTRY
from gpu.runner.model_runner import resolve_device
from messages.names import HTTP, replica
from messages.wire import Ping

log = logging.getLogger("sluice.replicas")
EXIT_REFUSED = 2  # a headless replica's node refused by the front (as a gang's: actors/engine/gang_nodes.py)


def resolve_model(model: str | None) -> ModelConfig:
    """The model to serve: a directory, a .gguf (served in place, its card made once in the cache), or None for the
    bundled SmolLM2. Raises ModelLoadError saying what is wrong."""
    try:
        config = ModelConfig.from_path(model or default_model_dir())
    except ConversionError as e:
        raise ModelLoadError(str(e)) from e
    check_checkpoint(config)  # (its tensors' names and shapes, from the headers: before any process starts)
    return config


def pick_port(http: HttpConfig) -> HttpConfig:
    """`http` with a concrete port; raises StartupError when the address cannot be bound."""
    family, kind, proto, _, addr = socket.getaddrinfo(http.host, http.port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will
        try:
            s.bind(addr)
        except OSError as e:
            raise StartupError(f"cannot listen on {http.url}: {e.strerror}") from e
        return msgspec.structs.replace(http, port=s.getsockname()[1])


def http_process(model: ModelConfig, engine: EngineConfig, http: HttpConfig) -> ProcessSpec:
    kwargs = {
        "model": str(model.path),
        "http": msgspec.to_builtins(http),
        "max_model_len": min(engine.max_model_len, model.max_model_len),
        "vocab_size": model.vocab_size,
        "bos_token_id": model.bos_token_id,  # (the engine's: whether the model has a BOS to guide against)
        "replicas": engine.data_parallel_size,
        "local_replicas": engine.local_replicas,  # (the others: down until their node joins)
        "block_size": engine.block_size,
        "loras": [msgspec.to_builtins(m) for m in engine.lora.modules] if engine.lora else [],
    }
    return ProcessSpec(name=HTTP, actors=[ActorSpec(name=HTTP, factory="frontend.server:HttpActor", kwargs=kwargs)])


def checked_loras(model: ModelConfig, engine: EngineConfig, http: HttpConfig) -> LoraConfig | None:
    """The LoRA config with each adapter's digest, every adapter read and checked against the model (LoraError, a
    ModelLoadError, naming the one at fault) before any process starts."""
    lora = engine.lora
    if http.lora_runtime_updates and (lora is None or engine.tensor_parallel_size > 1):
        raise ModelLoadError("--enable-lora-runtime-updates needs --enable-lora and one rank (no tensor parallelism)")
    if lora is None:
        return None
    with torch.device("meta"):
        base = REGISTRY[model.architecture](model)
    modules, served = [], {*(http.served_model_name or [model.name, Path(model.path).name])}
    for m in tqdm(lora.modules, desc="Checking LoRA adapters", unit="adapter", disable=len(lora.modules) < 8):
        if m.name in served:
            raise ModelLoadError(f"--lora-modules: {m.name!r} is the served model's name")
        try:
            digest, _ = read_adapter(m.path, base, lora.max_lora_rank, torch.float32)
            modules.append(msgspec.structs.replace(m, digest=digest))
        except LoraError as e:
            raise ModelLoadError(f"--lora-modules {m.name}: {e}") from e
    return msgspec.structs.replace(lora, modules=modules)


def check_gang(model: ModelConfig, engine: EngineConfig) -> list[str] | None:
    """Before any process starts: the model shards over the gang's ranks, and a node has a
    device for each of its ranks (of every replica). Returns each replica's CUDA_VISIBLE_DEVICES where replicas
    split the node's CUDA devices (None: they share the node)."""
    if engine.tensor_parallel_size > 1:
        check_checkpoint(model, engine.tensor_parallel_size)
    per_replica = engine.tensor_parallel_size // engine.nnodes
    per_node, dp = per_replica * engine.local_replicas, engine.local_replicas
    if per_node == 1 or resolve_device(engine.device).type != "cuda":
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if per_node > len(devices):
        raise ModelLoadError(f"{per_node} ranks on this node, {len(devices)} CUDA devices")
    return None if dp == 1 else [",".join(devices[k * per_replica : (k + 1) * per_replica]) for k in range(dp)]


def build_processes(
    engine: EngineConfig, http: HttpConfig, memory_check: bool = True
) -> tuple[list[ProcessSpec], MemoryNeed]:
    """The processes, and what they need of this host's memory (checked unless not `memory_check`)."""
    model = resolve_model(engine.model)
    check_quantization(model, engine.quantization)
    devices = check_gang(model, engine)
    engine = msgspec.structs.replace(engine, model=str(model.path), lora=checked_loras(model, engine, http))
    spec = engine.speculative
    if spec is not None and spec.model is not None:  # a draft .gguf's card is made here too, before anything starts
        draft = resolve_model(spec.model)
        if draft.vocab_size != model.vocab_size:
            raise ModelLoadError(
                f"the draft model's vocabulary ({draft.vocab_size}) is not the model's ({model.vocab_size})"
            )
        engine = msgspec.structs.replace(engine, speculative=msgspec.structs.replace(spec, model=str(draft.path)))
    need = (check_memory if memory_check else memory_need)(model, engine)
    return [http_process(model, engine, http), *engine_processes(engine, HTTP, devices)], need


def remote_replicas(engine: EngineConfig) -> list[Actor]:
    """The launcher's door to the replicas on other nodes, and their proxies (actors/replica_link.py)."""
    remote = list(range(engine.local_replicas, engine.data_parallel_size))
    if not remote:
        return []
    door = Door(remote, HTTP, f"tcp://{engine.data_parallel_address}:{engine.data_parallel_rpc_port}")
    return [door, *(Proxy(actor, k, door) for k in remote for actor in replica(k).actors)]


class Server(ActorSystem):
    """A supervised actor graph with an HTTP actor; `start()` returns once every actor has started
    (the model is loaded, the web server listens and serves). `memory`: what the engine needs, to explain an engine
    killed while it starts or restarts."""

    def __init__(self, processes: list[ProcessSpec], http: HttpConfig, memory: MemoryNeed | None = None, **kwargs):
        super().__init__(processes, explain=functools.partial(explain, need=memory), **kwargs)
        self.http = http

    @property
    def url(self) -> str:
        return self.http.url

    async def start(self) -> None:
        await super().start()
        deadline = time.monotonic() + self.policy.ready_timeout_s
        await asyncio.gather(*(self._started(a.name, deadline) for p in self.specs.values() for a in p.actors))

    async def _started(self, actor: str, deadline: float) -> None:
        """An actor answers asks only after its on_start; retried, as an incarnation that died starting never answers."""
        while True:
            try:
                await self.supervisor.ask(actor, Ping(), timeout=1.0)
                return
            except AskTimeout:
                if self.done.is_set() or time.monotonic() > deadline:
                    await self.stop()
                    raise StartupError(f"{actor} did not start (see its log)") from None


async def start_server(
    engine: EngineConfig,
    http: HttpConfig,
    fault_plan: FaultPlan | None = None,
    policy: RestartPolicy | None = None,
    log_level: str = "INFO",
    memory_check: bool = True,
) -> Server:
    """Start the whole graph; `await server.stop()` (or `async with`) shuts it down."""
    http = pick_port(http)
    processes, need = build_processes(engine, http, memory_check)
    server = Server(processes, http, need, local=remote_replicas(engine), fault_plan=fault_plan, policy=policy,
                    log_level=log_level)  # fmt: skip
    await server.start()
    return server


async def serve_node(
    config: EngineConfig, log_level: str = "INFO", policy: RestartPolicy | None = None, memory: MemoryNeed | None = None
) -> int:
    """A headless node's launcher of replica config.data_parallel_rank, until SIGTERM/SIGINT (0), its supervisor
    gives up (1: only with `policy.exit_past_intensity`) or the front refuses its handshakes (EXIT_REFUSED: found
    while the replica loads). `memory`: as Server's."""
    address = f"tcp://{config.data_parallel_address}:{config.data_parallel_rpc_port}"
    link = NodeLink(HTTP, config.data_parallel_rank, address)
    engine = msgspec.structs.replace(config, stats_to=[HTTP])
    system = ActorSystem(replica_processes(engine, HTTP, {}), local=[link], policy=policy, log_level=log_level,
                         explain=functools.partial(explain, need=memory))  # fmt: skip
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    start = asyncio.ensure_future(system.start())  # (the link's socket connects meanwhile)
    tasks = [start, *map(asyncio.ensure_future, (curve.handshakes(link.monitor, address), stop.wait()))]
    try:
        while not stop.is_set():
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if error := next((t.exception() for t in done if t.exception() is not None), None):
                log.error("%s", error)
                return EXIT_REFUSED if isinstance(error, curve.Refused) else 1
            if start in done:  # (serving: from now on until stopped, refused or given up)
                link.serving.set()
                log.info("engine replica %d serves: joining the front at %s", config.data_parallel_rank, address)
                tasks[0] = asyncio.ensure_future(system.done.wait())
            elif system.done.is_set():
                return system.exit_code
        return 0
    finally:
        for t in tasks:
            t.cancel()
        await system.stop()
