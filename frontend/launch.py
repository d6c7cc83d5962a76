"""Launch a server: the HTTP, engine and detokenizer processes under the launcher's supervisor (and the door of its
replicas on other nodes); or a headless node's engine replica (`serve_node`).

Everything that can fail fast does so before any process starts: the model is resolved and checked and must fit in
the host's memory (frontend/preflight.py, which `sluice serve` runs in a child of the fork server: this module does not
import torch), and a fixed port is test-bound. Port 0 is resolved to a free port here, so a restarted HTTP process
binds the same one. The processes start together, the engine's first: the HTTP front listens while the engine
replicas load (503 until each is ready: frontend/readiness.py), and `start()` returns once the server serves.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import socket
import time

import msgspec

from actors.engine.config import EngineConfig
from actors.graph import replica_processes
from actors.replica_link import Door, NodeLink, Proxy
from actors.runtime import (
    ActorSystem,
    AskTimeout,
    FaultPlan,
    ProcessSpec,
    RestartPolicy,
    StartupError,
    call_forked,
    curve,
)
from actors.runtime.actor import Actor
from frontend.http_base import HttpConfig
from gpu.loading.errors import ModelLoadError
from messages.names import HTTP, replica, replica_of
from messages.wire import Ping

log = logging.getLogger("sluice.replicas")
EXIT_REFUSED = 2  # a headless replica's node refused by the front (as a gang's: actors/engine/gang_nodes.py)


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


MAX_SERVERS = 255  # --api-server-count at most (a response id names its server in a byte: frontend/http_servers.py)


def check_servers(engine: EngineConfig, http: HttpConfig) -> None:
    """--api-server-count's bounds: at most MAX_SERVERS; one only with engine replicas on other nodes."""
    if http.api_server_count > MAX_SERVERS:
        raise ModelLoadError(f"--api-server-count {http.api_server_count}: at most {MAX_SERVERS}")
    if http.api_server_count > 1 and engine.local_replicas < engine.data_parallel_size:
        raise ModelLoadError("--api-server-count > 1: engine replicas on other nodes are not served by several HTTP "
                             "servers yet (their door has one client)")  # fmt: skip


def remote_replicas(engine: EngineConfig) -> list[Actor]:
    """The launcher's door to the replicas on other nodes, and their proxies (actors/replica_link.py)."""
    remote = list(range(engine.local_replicas, engine.data_parallel_size))
    if not remote:
        return []
    door = Door(remote, HTTP, f"tcp://{engine.data_parallel_address}:{engine.data_parallel_rpc_port}")
    return [door, *(Proxy(actor, k, door) for k in remote for actor in replica(k).actors)]


class Preflight(msgspec.Struct, kw_only=True):
    """The forked checks' answer (frontend/preflight.py `prepare_json`): the launch, or why there is none."""

    http: HttpConfig | None = None  # as asked, the served names filled in (the model's where none were given)
    processes: list[ProcessSpec] = []  # the engine's first
    memory: str | None = None  # the engine's memory figures and what to try (MemoryNeed.explanation)
    error: str | None = None  # why the model cannot be served (a ModelLoadError's or StartupError's message)


def preflight(engine: EngineConfig, http: HttpConfig, memory_check: bool, log_level: str) -> Preflight:
    """frontend/preflight.py's `prepare` run in a child of the fork server; ModelLoadError if it refuses,
    StartupError if it dies."""
    request = {"engine": engine, "http": http, "memory_check": memory_check, "log_level": log_level}
    try:
        answer = call_forked("frontend.preflight:prepare_json", msgspec.json.encode(request), "sluice:preflight")
    except ChildProcessError as e:  # (killed, or a bug: its traceback is in the log)
        raise StartupError(f"checking the model: {e}") from None
    checked = msgspec.json.decode(answer, type=Preflight)
    if checked.error is not None:
        raise ModelLoadError(checked.error)
    return checked


def explain(error: StartupError, memory: str | None) -> StartupError:
    """An engine-side process SIGKILLed while it started: most likely out of memory, with the figures (`memory`)."""
    if memory is None or error.exitcode != -signal.SIGKILL or error.proc is None or replica_of(error.proc) is None:
        return error
    return StartupError(
        f"{error}: most likely out of memory (the kernel's OOM killer: `dmesg` says): {memory}",
        error.proc,
        error.exitcode,
    )


class Server(ActorSystem):
    """A supervised actor graph with an HTTP actor; `start()` returns once every actor has started
    (the model is loaded, the web server listens and serves). `memory`: the engine's memory figures
    (MemoryNeed.explanation), to explain an engine killed while it starts or restarts."""

    def __init__(self, processes: list[ProcessSpec], http: HttpConfig, memory: str | None = None, **kwargs):
        super().__init__(processes, explain=functools.partial(explain, memory=memory), **kwargs)
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
    forked: bool = False,
) -> Server:
    """Start the whole graph; `await server.stop()` (or `async with`) shuts it down. `forked`: the checks run in a
    child of the fork server (`sluice serve`: torch is not imported here; the server's name is the model's where
    `http` names none), else in this process."""
    check_servers(engine, http)
    http = pick_port(http)
    if forked:
        checked = await asyncio.to_thread(preflight, engine, http, memory_check, log_level)
        http, processes, memory = checked.http, checked.processes, checked.memory
    else:
        from frontend.preflight import build_processes, server_count

        http = server_count(engine, http)
        processes, need = build_processes(engine, http, memory_check)
        memory = need.explanation()
    server = Server(processes, http, memory, local=remote_replicas(engine), fault_plan=fault_plan, policy=policy,
                    log_level=log_level)  # fmt: skip
    await server.start()
    return server


async def serve_node(
    config: EngineConfig, log_level: str = "INFO", policy: RestartPolicy | None = None, memory: str | None = None
) -> int:
    """A headless node's launcher of replica config.data_parallel_rank, until SIGTERM/SIGINT (0), its supervisor
    gives up (1: only with `policy.exit_past_intensity`) or the front refuses its handshakes (EXIT_REFUSED: found
    while the replica loads). `memory`: as Server's."""
    address = f"tcp://{config.data_parallel_address}:{config.data_parallel_rpc_port}"
    link = NodeLink(HTTP, config.data_parallel_rank, address)
    engine = msgspec.structs.replace(config, stats_to=[HTTP])
    system = ActorSystem(replica_processes(engine, {}), local=[link], policy=policy, log_level=log_level,
                         explain=functools.partial(explain, memory=memory))  # fmt: skip
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
