"""The engine's configuration from `sluice serve` / `sluice generate` flags (frontend/cli_args.py): the flags that
depend on each other are checked here, with a message naming them (SystemExit); and what both commands set up from
their flags: logging and the model, the fault plan, the supervisor's restart policy, the memory check."""

from __future__ import annotations

import argparse
import logging
import os

from actors.engine.config import EngineConfig
from frontend.cli_lora import lora_config

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def setup(args: argparse.Namespace, default_level: str):
    """Logging, then the model (converted on first use) or a clear error."""
    from frontend.preflight import resolve_model

    setup_logging(args, default_level)
    return resolve_model(args.model, args.load_format)


def setup_logging(args: argparse.Namespace, default_level: str) -> None:
    args.log_level = args.log_level or default_level
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s [launcher] %(name)s: %(message)s")


def fault_plan_of(args: argparse.Namespace):
    from actors.runtime import FaultPlan

    return FaultPlan.parse(args.fault_plan) if args.fault_plan else FaultPlan.from_env()


def restart_policy(args: argparse.Namespace, give_up: bool = False):
    """The supervisor's: past a process's restart intensity it backs off, or with --exit-on-engine-failure (`give_up`:
    `generate`'s, whose caller waits at a terminal) the command stops with exit code 1."""
    from actors.runtime import RestartPolicy

    return RestartPolicy(exit_past_intensity=give_up or args.exit_on_engine_failure)


def check_memory_of(args: argparse.Namespace, model, engine: EngineConfig):
    """What the engine needs of this host's memory; refused (ModelLoadError) if it cannot fit, unless
    --skip-memory-check (frontend/memory_check.py)."""
    from frontend.memory_check import check_memory, memory_need

    return (memory_need if args.skip_memory_check else check_memory)(model, engine)


def engine_config(args: argparse.Namespace, model: str) -> EngineConfig:
    fields = ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "long_prefill_token_threshold")
    fields += ("block_size", "num_kv_blocks")
    fields += ("kv_cache_memory_gb", "dtype", "device", "quantization", "engine_threads", "async_scheduling")
    fields += ("speculative_config", "logprobs_mode", "enable_prefix_caching", "worker", "attention_backend")
    fields += ("cpu_kernels", "batch_invariant")
    fields += ("enforce_eager", "gpu_memory_utilization", "tensor_parallel_size", "nnodes", "master_addr")
    fields += ("master_port", "data_parallel_size", "data_parallel_size_local", "data_parallel_address")
    fields += ("data_parallel_rpc_port", "runner", "pooler_config", "load_format")
    values = {f: getattr(args, f) for f in fields}
    tp = args.tensor_parallel_size
    if tp % args.nnodes:
        raise SystemExit(f"--tensor-parallel-size {tp} is not a multiple of --nnodes {args.nnodes}")
    if args.data_parallel_size > 1 and args.nnodes > 1:
        raise SystemExit("--data-parallel-size: a replica's gang spans one node (--nnodes 1)")
    if getattr(args, "exit_on_engine_failure", False) and args.headless and args.data_parallel_rank is None:
        raise SystemExit(
            "--exit-on-engine-failure: a gang's headless node (--node-rank) restarts nothing itself: give it to node 0"
        )
    if args.data_parallel_rank is not None:
        if not args.headless:
            raise SystemExit("--data-parallel-rank: a replica of its own runs with --headless")
        values["data_parallel_rank"], values["data_parallel_size_local"] = args.data_parallel_rank, 1
    if tp > 1 and args.worker == "inline":
        raise SystemExit(
            "--tensor-parallel-size: a gang's ranks are processes (its leader the worker's): not --worker inline"
        )
    values["worker"] = args.worker or "auto"
    if values["gpu_memory_utilization"] is None:
        values.pop("gpu_memory_utilization")
    elif tp > 1:
        raise SystemExit(
            "--gpu-memory-utilization sizes one worker's KV cache; a gang's ranks take --kv-cache-memory-gb (per rank) "
            "or --num-kv-blocks"
        )
    local = args.data_parallel_size_local
    if (
        args.nnodes > 1
        or args.data_parallel_rank is not None
        or (local is not None and local < args.data_parallel_size)
    ):
        from actors.runtime.curve import SECRET_ENV, cluster_secret

        if args.cluster_secret:  # (the environment carries it to every process that needs it)
            os.environ[SECRET_ENV] = args.cluster_secret
        try:
            cluster_secret()
        except ValueError as e:
            raise SystemExit(str(e)) from e
    values["speculative"] = values.pop("speculative_config")
    values["lora"] = lora_config(args)
    try:
        return EngineConfig(model=model, **values)
    except ValueError as e:
        raise SystemExit(str(e)) from e
