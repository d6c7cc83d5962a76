"""Session-wide servers for the HTTP tests: started once, shared by every test that asks for them.

- `server`: the real graph (HTTP, engine, detokenizer processes) on a tiny random-weight Llama
  with the real SmolLM2 tokenizer.
- `fake`: the HTTP process alone, with tests.fake_engine.FakeEngine as the "scheduler" in the
  test process (protocol faults on demand), an API key, and short abort timeouts.
- `real_server`: the graph on the converted SmolLM2, for tests that need sensible text.

Without a CUDA GPU, Triton kernels run in the interpreter: TRITON_INTERPRET=1 is set here, before any test module
is imported, because `@triton.jit` reads it when it decorates (triton.language's own helpers too) and torch imports
triton early (torch._dynamo, through transformers).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.waits import eventually

if TYPE_CHECKING:  # the servers' modules are imported by the fixtures: other suites need none of them
    import aiohttp
    import openai

    from frontend.launch import Server
    from tests.fake_engine import FakeEngine

API_KEY = "sk-test-key"
pytest_plugins = ["tests.exit_guard"]  # (the run's end: what the tests left is ended, and a hang at exit cannot last)


def _interpret_triton_without_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_interpret_triton_without_cuda()


def pytest_configure(config):
    """The actor processes the tests start fork from a fork server that imported the actors' modules (torch with
    them) once, as `sluice serve`'s do: each start is then a fork, not an interpreter importing torch."""
    from actors.runtime.process import start_forkserver
    from frontend.cli import SERVE_MODULES

    start_forkserver(SERVE_MODULES)


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` are skipped on a machine without a CUDA GPU (CI), so the suite stays green there."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@dataclass
class ServerHandle:
    server: Server | None  # None: another server at `remote` (tests/test_conformance.py's control run)
    model_dir: Path
    api_key: str = "unused"
    engine: FakeEngine | None = None
    remote: str | None = None
    clients: list[openai.AsyncOpenAI] = field(default_factory=list)

    @functools.cached_property
    def tokenizer(self):
        from frontend.tokenizer import Tokenizer

        return Tokenizer.from_model_dir(self.model_dir)

    @property
    def url(self) -> str:
        return self.remote or self.server.url

    @property
    def local(self) -> bool:
        """Sluice itself (not a control server): its own names and stricter errors are checked too."""
        return self.remote is None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def client(self) -> openai.AsyncOpenAI:
        """A client kept here and closed by the server's fixture (`close_clients`): one left to the cyclic GC resurrects
        itself in its __del__ and later aborts the transports whose sockets the GC already closed, removing the loop's
        reader of whatever took those fd numbers since (an actor's inbox: it goes deaf; actors/runtime/mailbox.py)."""
        import openai

        client = openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key, max_retries=0, timeout=120)
        self.clients.append(client)
        return client

    async def close_clients(self) -> None:
        for client in self.clients:
            await client.close()
        self.clients.clear()

    def session(self) -> aiohttp.ClientSession:
        import aiohttp

        return aiohttp.ClientSession(self.url, headers=self.headers)

    async def metrics(self) -> dict[tuple, float]:
        """{(sample name, (label pairs sorted)): value} from GET /metrics (without model_name and engine, which every
        series carries)."""
        import aiohttp
        from prometheus_client.parser import text_string_to_metric_families

        from frontend.metrics import BASE_LABELS

        async with aiohttp.ClientSession() as s, s.get(f"{self.url}/metrics") as resp:
            text = await resp.text()
        return {
            (sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k not in BASE_LABELS))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    async def idle(self) -> dict[str, dict[str, int]]:
        """Every request-path actor's leftover per-request state (CheckIdle)."""
        from messages.wire import CheckIdle

        actors = [a.name for p in self.server.specs.values() for a in p.actors]
        return {a: (await self.server.supervisor.ask(a, CheckIdle(), timeout=10)).details for a in actors}

    async def per_engine(self, name: str) -> dict[str, float]:
        """A series' samples by their `engine` label (the engine replica)."""
        from prometheus_client.parser import text_string_to_metric_families

        async with self.session() as s, s.get("/metrics") as resp:
            families = text_string_to_metric_families(await resp.text())
        return {x.labels["engine"]: x.value for f in families for x in f.samples if x.name == name}

    async def wait_per_engine(self, name: str, holds, timeout: float = 30.0) -> None:
        """Poll /metrics until `holds(per_engine(name))` (the replicas report every stats interval)."""

        async def held() -> bool:
            return holds(await self.per_engine(name))

        await eventually(held, f"{name} per engine", timeout, every=0.05)

    async def metric(self, name: str, **labels) -> float:
        return (await self.metrics()).get((name, tuple(sorted(labels.items()))), 0.0)

    async def wait_metrics(self, expected: dict[tuple, float], timeout: float = 30.0) -> None:
        """Poll /metrics until every (name, labels) -> value in `expected` holds."""

        async def reached() -> bool:
            got = await self.metrics()
            return all(got.get(key, 0.0) == value for key, value in expected.items())

        await eventually(reached, f"metrics {expected}", timeout, every=0.05)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from tests.tiny_model import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def family_dir_of(tmp_path_factory):
    """family -> its tiny checkpoint (tests/family_models.py), built on first use, once per test run."""
    from tests.family_models import make_family_dir

    built = {}

    def get(family: str):
        if family not in built:
            built[family] = make_family_dir(tmp_path_factory.mktemp(family), family)
        return built[family]

    return get


@pytest.fixture(scope="session")
def responses_db(tmp_path_factory) -> str:
    """The Responses API's store of the session's servers (not the user's cache)."""
    return str(tmp_path_factory.mktemp("responses") / "responses.sqlite3")


@pytest.fixture(scope="session")
async def server(tiny_model_dir, responses_db):
    from actors.engine.config import EngineConfig
    from frontend.http_base import HttpConfig
    from frontend.launch import start_server

    engine = EngineConfig(
        model=str(tiny_model_dir), max_model_len=512, max_num_seqs=16, num_kv_blocks=256, engine_threads=1
    )
    http = HttpConfig(port=0, tool_call_parser="hermes", responses_db=responses_db)
    srv = await start_server(engine, http, log_level="WARNING")
    yield (handle := ServerHandle(srv, tiny_model_dir))
    await handle.close_clients()
    await srv.stop()


@contextlib.asynccontextmanager
async def fake_server_of(model_dir: Path, **http):
    """The HTTP process alone over a FakeEngine in the test process (`fake_server`'s), with HttpConfig's `http`."""
    from actors.engine.config import EngineConfig
    from frontend.http_base import HttpConfig
    from frontend.launch import Server, pick_port
    from frontend.preflight import http_processes, resolve_model
    from messages.names import http_servers
    from tests.fake_engine import FakeEngine

    model = resolve_model(str(model_dir))
    config = HttpConfig(**{"port": 0, "api_key": API_KEY, "abort_timeout_s": 0.3, "max_abort_tries": 3,
                           "body_timeout_s": 2.0, **http})  # fmt: skip
    config = pick_port(config)
    engine = FakeEngine(clients=http_servers(config.api_server_count))
    srv = Server(http_processes(model, EngineConfig(model=str(model.path)), config), config, local=[engine])
    await srv.start()
    try:
        yield (handle := ServerHandle(srv, model_dir, API_KEY, engine))
        await handle.close_clients()
    finally:
        await srv.stop()


@pytest.fixture(scope="session")
async def fake_server(tiny_model_dir, responses_db):
    async with fake_server_of(tiny_model_dir, responses_db=responses_db) as handle:
        yield handle


@pytest.fixture
def fake(fake_server):
    """The fake-engine server, with the fake reset to its defaults after the test."""
    fake_server.engine.added.clear()
    yield fake_server
    engine = fake_server.engine
    engine.hold, engine.ack_aborts = False, True
    engine.live.clear()
    engine.aborts.clear()


@pytest.fixture(scope="session")
async def real_server(responses_db):
    from actors.engine.config import EngineConfig
    from frontend.http_base import HttpConfig
    from frontend.launch import start_server
    from frontend.preflight import resolve_model

    model = resolve_model(None)
    # (1 GiB of KV cache on every device: on CUDA, sized to the card, it would leave later tests no room)
    engine = EngineConfig(model=str(model.path), max_model_len=1024, max_num_seqs=8, kv_cache_memory_gb=1.0)
    srv = await start_server(engine, HttpConfig(port=0, responses_db=responses_db), log_level="WARNING")
    yield (handle := ServerHandle(srv, model.path))
    await handle.close_clients()
    await srv.stop()
