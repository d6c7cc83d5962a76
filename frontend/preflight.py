"""A launch's checks, before any of its processes starts: the model is resolved (the bundled default is converted on
first use, a .gguf gets its card in the cache) and checked (its tensors' names and shapes, its LoRA adapters, a gang's
devices), and it must fit in the host's memory (frontend/memory_check.py); then the processes to start, and what to say
of an engine killed as it starts (frontend/launch.py's `Preflight`).

This is the one part of a launch that imports torch (the models' shapes on meta). `sluice serve` runs it in a child of
the fork server (frontend/launch.py `preflight`; the fork server's preload imported it), so the launcher itself never
imports torch: its start is not a second torch import beside the fork server's (1.4 s of CPU on a 2-core host), and
it holds ~200 MB less.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import msgspec
import torch
from tqdm import tqdm

from actors.engine.config import MAX_NUM_SEQS, EngineConfig, LoraConfig, device_type
from actors.graph import engine_processes
from actors.runtime import ActorSpec, ProcessSpec, StartupError
from frontend.http_base import HttpConfig
from frontend.memory_check import MemoryNeed, check_memory, memory_need, served_dtypes
from gpu.loading.config import ModelConfig, ModelLoadError, weight_files
from gpu.loading.convert import ConversionError, default_model_dir
from gpu.loading.encoder_config import is_pooling_model, pooling_config
from gpu.loading.lora import LoraError, check_adapter, lora_tables
from gpu.loading.random_weights import served_dir
from gpu.loading.weights import check_checkpoint, check_quantization
from gpu.models import REGISTRY
from gpu.runner.model_runner import resolve_device
from messages import names
from messages.names import http_servers


class Request(msgspec.Struct, kw_only=True):
    """What frontend/launch.py's `preflight` asks of `prepare_json`."""

    engine: EngineConfig
    http: HttpConfig
    memory_check: bool
    log_level: str


def resolve_model(model: str | None, load_format: str = "auto") -> ModelConfig:
    """The model to serve: a directory, a .gguf (served in place, its card made once in the cache), or None for the
    bundled SmolLM2; with `load_format` "dummy", a copy of its config and tokenizer with random weights (its weights
    need not exist). Raises ModelLoadError saying what is wrong."""
    try:
        config = ModelConfig.from_path(served_dir(Path(model or default_model_dir()), load_format))
    except ConversionError as e:
        raise ModelLoadError(str(e)) from e
    check_checkpoint(config)  # (its tensors' names and shapes, from the headers: before any process starts)
    return config


AUTO_SERVER_CORES, AUTO_MAX_SERVERS = 4, 4  # --api-server-count's default on CUDA: a server per 4 host cores, 4 at most


def server_count(engine: EngineConfig, http: HttpConfig) -> HttpConfig:
    """`http` with --api-server-count's default (0) chosen: one, but a generating model on CUDA gets a server per
    AUTO_SERVER_CORES host cores, AUTO_MAX_SERVERS at most (one with engine replicas on other nodes: check_servers).
    A card's rates at c64-c256 (issue 53: 30-60k tokens a second) pass every token through an HTTP process at ~33 us
    of CPU (docs/PERFORMANCE.md): one process would be the host's bound at ~30k."""
    if http.api_server_count:
        return http
    local = engine.local_replicas == engine.data_parallel_size
    n = 1  # (the cores: this process's affinity; a container's CPU quota is not counted)
    if local and not serves_pooling(engine) and device_type(engine.device) == "cuda":
        n = min(AUTO_MAX_SERVERS, max(1, len(os.sched_getaffinity(0)) // AUTO_SERVER_CORES))
    return msgspec.structs.replace(http, api_server_count=n)


def servers(http: HttpConfig, kwargs: dict) -> list[ProcessSpec]:
    """The HTTP servers (--api-server-count), a process each (frontend/http_servers.py), built with `kwargs`."""
    if http.api_server_count < 1:
        raise ValueError("the HTTP servers' count reached the launch unchosen (server_count)")
    spec = functools.partial(ActorSpec, factory="frontend.server:HttpActor")
    named = enumerate(http_servers(http.api_server_count))
    return [ProcessSpec(name=name, actors=[spec(name=name, kwargs={**kwargs, "server": k})]) for k, name in named]


def http_processes(model: ModelConfig, engine: EngineConfig, http: HttpConfig) -> list[ProcessSpec]:
    """A generating model's HTTP servers."""
    return servers(http, {
        "model": str(model.path),
        "http": msgspec.to_builtins(http),
        "max_model_len": min(engine.max_model_len, model.max_model_len),
        "vocab_size": model.vocab_size,
        "bos_token_id": model.bos_token_id,  # (the engine's: whether the model has a BOS to guide against)
        "replicas": engine.data_parallel_size,
        "local_replicas": engine.local_replicas,  # (the others: down until their node joins)
        "block_size": engine.block_size,
        "loras": [msgspec.to_builtins(m) for m in engine.lora.modules] if engine.lora else [],
    })  # fmt: skip


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
    tables = lora_tables(lora.lora_dtype, served_dtypes(model, engine, engine.dtype)[1])  # (fixed for every process)
    for m in tqdm(lora.modules, desc="Checking LoRA adapters", unit="adapter", disable=len(lora.modules) < 8):
        if m.name in served:
            raise ModelLoadError(f"--lora-modules: {m.name!r} is the served model's name")
        try:
            digest = check_adapter(m.path, base, lora.max_lora_rank, tables)
            modules.append(msgspec.structs.replace(m, digest=digest))
        except LoraError as e:
            raise ModelLoadError(f"--lora-modules {m.name}: {e}") from e
    return msgspec.structs.replace(lora, modules=modules, lora_dtype=str(tables).removeprefix("torch."))


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
    engine: EngineConfig, http: HttpConfig, memory_check: bool = True, model: ModelConfig | None = None
) -> tuple[list[ProcessSpec], MemoryNeed]:
    """The processes, and what they need of this host's memory (checked unless not `memory_check`); the engine's
    first (started in this order: its load is the longest part of a start). `model`: engine.model's, resolved."""
    if model is None and serves_pooling(engine):
        return pooling_processes(engine, http)
    if engine.pooler_config is not None:
        raise ModelLoadError("--pooler-config: the model is served for generation (--runner generate)")
    model = model or resolve_model(engine.model, engine.load_format)
    if model.headless:
        raise ModelLoadError(
            f"{model.name} is a bare decoder (no LM head): it is served for pooling (--runner pooling)"
        )
    check_quantization(model, engine.quantization)
    devices = check_gang(model, engine)
    engine = msgspec.structs.replace(engine, model=str(model.path), lora=checked_loras(model, engine, http))
    spec = engine.speculative
    if spec is not None and spec.model is not None:  # a draft .gguf's card is made here too, before anything starts
        draft = resolve_model(spec.model, engine.load_format)
        if draft.vocab_size != model.vocab_size:
            raise ModelLoadError(
                f"the draft model's vocabulary ({draft.vocab_size}) is not the model's ({model.vocab_size})"
            )
        engine = msgspec.structs.replace(engine, speculative=msgspec.structs.replace(spec, model=str(draft.path)))
    need = (check_memory if memory_check else memory_need)(model, engine)
    clients = http_servers(http.api_server_count)
    return [*engine_processes(engine, clients, devices), *http_processes(model, engine, http)], need


class PoolingNeed(msgspec.Struct):
    weights: int  # bytes, float32

    def explanation(self) -> str:
        return f"its weight files take {self.weights / 2**20:.0f} MiB (held in float32: twice a 16-bit file's)"


def serves_pooling(engine: EngineConfig) -> bool:
    """Whether the launch serves engine.model for pooling: --runner, else whether it is a pooling model or
    --pooler-config says how to pool it."""
    auto = engine.runner == "auto" and bool(engine.model)
    return engine.runner == "pooling" or (auto and (engine.pooler_config is not None or is_pooling_model(engine.model)))


def refuse_for_pooling(engine: EngineConfig) -> None:
    """ModelLoadError naming the flags a pooling model is not served with."""
    refused = {"--data-parallel-size": engine.data_parallel_size > 1, "--tensor-parallel-size": engine.tensor_parallel_size > 1,
               "--enable-lora": engine.lora is not None, "--speculative-config": engine.speculative is not None,
               "--quantization": engine.quantization is not None, "--load-format dummy": engine.load_format == "dummy"}  # fmt: skip
    if flags := [flag for flag, given in refused.items() if given]:
        raise ModelLoadError(f"{', '.join(flags)}: not served with a pooling model ({engine.model})")


def pooling_processes(engine: EngineConfig, http: HttpConfig) -> tuple[list[ProcessSpec], PoolingNeed]:
    """A pooling model's launch (actors/pooler: its engine takes the scheduler's name; no worker, no detokenizer)."""
    refuse_for_pooling(engine)
    model = pooling_config(engine.model, engine.pooler_config)
    if engine.device not in ("auto", "cpu"):  # (auto: the CPU, on a CUDA machine too)
        raise ModelLoadError(f"a pooling model is served on CPU only, not --device {engine.device}")
    engine = msgspec.structs.replace(
        engine,
        model=str(model.path),
        max_model_len=min(engine.max_model_len, model.max_model_len),
        max_num_seqs=engine.max_num_seqs or MAX_NUM_SEQS,  # (0, the CLI's default: the CPU's; not placed)
        stats_to=http_servers(http.api_server_count),
    )
    pooler = ActorSpec(
        name=names.SCHEDULER, factory="actors.pooler.actor:PoolerActor", kwargs={"config": msgspec.to_builtins(engine)}
    )
    facts = {"dimensions": list(model.dimensions), "labels": list(model.labels), "score_sigmoid": model.score_sigmoid}
    kwargs = {"model": str(model.path), "http": msgspec.to_builtins(http), "max_model_len": engine.max_model_len,
              "vocab_size": model.vocab_size, "pooling": facts}  # fmt: skip
    weights = sum(f.stat().st_size for f in weight_files(model.path))  # (a float32 checkpoint's; a 16-bit one's x2)
    return [ProcessSpec(name=names.ENGINE, actors=[pooler]), *servers(http, kwargs)], PoolingNeed(weights)


def prepare(engine: EngineConfig, http: HttpConfig, memory_check: bool = True) -> dict:
    """`sluice serve`'s launch of `engine` behind `http` (its port chosen), checked, the model's name served where
    `http` names none: frontend/launch.py's Preflight's fields. Raises ModelLoadError or StartupError."""
    pooling = serves_pooling(engine)
    if pooling:
        refuse_for_pooling(engine)  # (before the model's pooling is read)
    model = pooling_config(engine.model) if pooling else resolve_model(engine.model, engine.load_format)
    http = server_count(engine, msgspec.structs.replace(http, served_model_name=http.served_model_name or [model.name]))
    processes, need = pooling_processes(engine, http) if pooling else build_processes(engine, http, memory_check, model)
    return {"http": http, "processes": processes, "memory": need.explanation()}


def prepare_json(request: bytes) -> bytes:
    """`prepare` in a child of the fork server (actors/runtime/process.py `call_forked`): a Request in, the launch
    or its error out, as JSON."""
    r = msgspec.json.decode(request, type=Request)
    logging.basicConfig(level=r.log_level, format="%(asctime)s %(levelname)s [launcher] %(name)s: %(message)s")
    try:
        return msgspec.json.encode(prepare(r.engine, r.http, r.memory_check))
    except (ModelLoadError, StartupError) as e:
        return msgspec.json.encode({"error": str(e)})
