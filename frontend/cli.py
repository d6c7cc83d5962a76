"""The `sluice` command: serve, generate, bench serve.

Heavy modules are imported inside the commands: every actor process re-imports the main module
(multiprocessing's preparation of a child), so this file's top level must stay light. `serve` starts the fork server
its processes start from first (actors/runtime/process.py), so that it imports their modules while the command
imports its own and checks the model.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from actors.engine.config import EngineConfig
from frontend import cli_generate
from frontend.cli_args import (
    Help,
    byte_size,
    engine_arguments,
    limit_arguments,
    metrics_prefix,
    positive_float,
    positive_int,
)
from frontend.cli_engine import (
    EXIT_FAILED,
    EXIT_OK,
    check_memory_of,
    engine_config,
    fault_plan_of,
    restart_policy,
    setup,
    setup_logging,
)
from frontend.cli_lora import lora_arguments, runtime_update_arguments, runtime_updates
from frontend.reasoning import REASONING_PARSERS
from frontend.tools import TOOL_CALL_PARSERS
from messages.sampling_params import RequestLimits

# ---------------------------------------------------------------- serve

# the modules of the actors `serve` runs (frontend/launch.py, actors/graph.py), imported once in the fork server
SERVE_MODULES = (
    "frontend.server",
    "actors.engine.scheduler_actor",
    "actors.engine.worker_actor",
    "actors.detokenizer.actor",
    "frontend.preflight",  # (the launcher's checks, forked: frontend/launch.py `preflight`)
)


def serve(args: argparse.Namespace) -> int:
    import uvloop

    from frontend.http_base import HttpConfig

    if args.headless or args.node_rank:
        model = setup(args, "INFO")
        return _headless(args, engine_config(args, str(model.path)))
    setup_logging(args, "INFO")  # (the model is resolved and checked in frontend/preflight.py, forked)
    http = HttpConfig(
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name or [],
        api_key=args.api_key,
        limits=RequestLimits(**{name: getattr(args, name) for name in RequestLimits.__struct_fields__}),
        chat_template=_chat_template(args.chat_template),
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        reasoning_parser=args.reasoning_parser,
        grammar_timeout_s=args.grammar_compile_timeout,
        metrics_prefix=args.metrics_prefix,
        dp_routing=args.dp_routing,
        log_stats_interval_s=0.0 if args.disable_log_stats else 10.0,
        stream_interval=args.stream_interval,
        responses_db=args.responses_db,
        responses_max_stored=args.responses_max_stored,
        responses_max_age_s=args.responses_max_age_hours * 3600,
        responses_max_bytes_per_response=args.responses_max_bytes_per_response,
        responses_max_store_bytes=args.responses_max_store_bytes,
        max_background_responses=args.max_background_responses,
        lora_runtime_updates=runtime_updates(args),
        api_server_count=args.api_server_count or 0,  # (0: by the device, frontend/preflight.py)
    )
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser")
    # ("": the bundled model, resolved, and converted on first use, by the forked checks: frontend/preflight.py)
    return uvloop.run(_serve(engine_config(args, args.model or ""), http, fault_plan_of(args), args))


def _headless(args: argparse.Namespace, engine: EngineConfig) -> int:
    """This node's ranks of a gang led by node 0 (actors/engine/gang_nodes.py), or its engine replica
    (actors/replica_link.py)."""
    import uvloop

    from frontend.preflight import check_gang, resolve_model

    if not args.headless:
        raise SystemExit(f"--node-rank {args.node_rank}: only node 0 serves; the others run with --headless")
    try:
        model = resolve_model(engine.model)
        check_gang(model, engine)
        need = check_memory_of(args, model, engine)
        if args.data_parallel_rank is not None:
            from frontend.launch import serve_node

            return uvloop.run(serve_node(engine, args.log_level, restart_policy(args), need.explanation()))
        from actors.engine.gang_nodes import HeadlessNode

        node = HeadlessNode(engine, args.node_rank)
    except ValueError as e:
        raise SystemExit(str(e)) from e
    return uvloop.run(node.run())


def _chat_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text()
    except OSError as e:
        raise SystemExit(f"--chat-template: {e}") from e


async def _serve(engine: EngineConfig, http, fault_plan, args: argparse.Namespace) -> int:
    import asyncio
    import signal

    from frontend.launch import start_server

    policy, check = restart_policy(args), not args.skip_memory_check
    server = await start_server(engine, http, fault_plan, policy, args.log_level, memory_check=check, forked=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    print(f"Sluice is serving {', '.join(server.http.served_model_name)} at {server.url}", flush=True)
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(server.done.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    await server.stop()
    if server.exit_code:
        print("sluice serve: the supervisor gave up (too many restarts); see the log above", file=sys.stderr)
    return server.exit_code


# ---------------------------------------------------------------- the parser


def build_parser() -> argparse.ArgumentParser:
    from frontend import bench_serve

    parser = argparse.ArgumentParser(prog="sluice", description="An OpenAI-compatible LLM server (actors over ZMQ).")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    defaults = Help
    p = commands.add_parser(
        "serve", help="serve a model over HTTP (OpenAI API)", description="Serve a model.", formatter_class=defaults
    )
    engine_arguments(p)
    lora_arguments(p)  # (`serve`'s: a request names its adapter)
    g = p.add_argument_group("http")
    g.add_argument("--host", default="127.0.0.1", help="address to bind")
    g.add_argument("--port", type=int, default=8000, help="port; 0 = any free port")
    g.add_argument(
        "--served-model-name", nargs="+", help="model name(s) in the API (default: the model directory's name)"
    )
    g.add_argument(
        "--api-key",
        default=os.environ.get("SLUICE_API_KEY"),
        help="require `Authorization: Bearer KEY` on /v1/* (default: $SLUICE_API_KEY)",
    )
    g.add_argument("--metrics-prefix", type=metrics_prefix, default="sluice:", help="of /metrics series (vllm:…)")
    g.add_argument(
        "--stream-interval",
        type=positive_int,
        default=1,
        help="a stream's event goes out at each choice's first token, then each N tokens of a choice (and at its "
        "end): fewer, larger events, less HTTP work per token at high concurrency (as vLLM's and SGLang's)",
    )
    g.add_argument(
        "--api-server-count",
        "-asc",
        type=positive_int,
        default=None,
        help="HTTP server processes sharing the port (SO_REUSEPORT): the host's HTTP work per token spreads over "
        "that many cores (as vLLM's; /metrics sums them: docs/OPERATIONS.md; default: 1, on CUDA one per 4 host "
        "cores, at most 4)",
    )
    runtime_update_arguments(g)
    g.add_argument("--disable-log-stats", action="store_true", help="no throughput line in the log every 10 s")
    g.add_argument(
        "--exit-on-engine-failure",
        action="store_true",
        help="past a process's restart intensity (3 deaths in 60 s), stop the server with exit code 1, for an "
        "orchestrator to restart (default: restart it after an exponential back-off, 1 s doubling to 60 s, the HTTP "
        "front answering 503 meanwhile: docs/OPERATIONS.md, 'Reliability')",
    )
    g = p.add_argument_group("responses API (/v1/responses)")
    g.add_argument("--responses-db", metavar="FILE", help="the stored responses' SQLite database (default: "
                   "responses.sqlite3 in the cache directory, $SLUICE_CACHE_DIR or ~/.cache/sluice)")  # fmt: skip
    g.add_argument(
        "--responses-max-stored", type=positive_int, default=10_000, help="stored responses kept (oldest go)"
    )
    g.add_argument("--responses-max-age-hours", type=positive_float, default=720.0, help="... and for how long")
    g.add_argument(
        "--responses-max-bytes-per-response",
        type=byte_size,
        default="8M",  # (http_base.py MAX_ROW_BYTES)
        metavar="BYTES",
        help="a stored response's size at most (8M, 1G, ...): a request whose input alone is more is a 400",
    )
    g.add_argument(
        "--responses-max-store-bytes",
        type=byte_size,
        default="1G",  # (MAX_STORE_BYTES)
        metavar="BYTES",
        help="the stored responses' size at most (the oldest go)",
    )
    g.add_argument("--max-background-responses", type=positive_int, default=128,
                   help="background responses running at once (a 429 past it)")  # fmt: skip
    g = p.add_argument_group("structured outputs and tools")
    g.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template replacing the model's own")
    g.add_argument(
        "--enable-auto-tool-choice", action="store_true", help='honour tool_choice "auto" (needs --tool-call-parser)'
    )
    g.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, help="the tool-call convention the model writes")
    g.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        help="split a chat output's <think>...</think> block out of its content as message.reasoning (grammars "
        "apply after it)",
    )
    g.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=10.0,
        help="seconds a structured output's spec may take to compile (slower ones get a 400)",
    )
    limit_arguments(p)
    p.set_defaults(func=serve)

    cli_generate.add_parser(commands)

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    p = bench.add_parser(
        "serve", help="load-test an OpenAI-compatible server", description=bench_serve.__doc__.splitlines()[0]
    )
    bench_serve.add_arguments(p)
    p.set_defaults(func=_bench_serve)
    return parser


def _bench_serve(args: argparse.Namespace) -> int:
    import uvloop

    from frontend import bench_serve

    uvloop.run(bench_serve.run(args))
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.func is serve:
        from actors.runtime.process import start_forkserver

        start_forkserver(SERVE_MODULES)
    from actors.runtime import StartupError
    from gpu.loading.errors import ModelLoadError

    try:
        return args.func(args)
    except (ModelLoadError, StartupError) as e:
        print(f"sluice {args.command}: error: {e}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
