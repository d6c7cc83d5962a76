"""The LoRA flags (vLLM's): `--enable-lora`, `--lora-modules name=path ...` (or vLLM's JSON form per adapter:
'{"name": ..., "path": ..., "base_model_name": ...}'), `--max-loras`, `--max-lora-rank`, `--max-cpu-loras`,
`--lora-dtype`.
And `sluice serve`'s `--enable-lora-runtime-updates` (vLLM's environment variable): its load and unload endpoints
(frontend/lora_api.py), which need --api-key."""

from __future__ import annotations

import argparse
import json

from actors.engine.config import LoraConfig, LoraModule

_DEFAULTS = LoraConfig()


def lora_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters over the model (--lora-modules)")
    g.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=[],
        metavar="NAME=PATH",
        help="PEFT adapter directories, each served under its NAME (a request's `model`); or JSON: "
        '\'{"name": "sql", "path": "/adapters/sql", "base_model_name": "base"}\'',
    )
    g.add_argument(
        "--max-loras",
        type=int,
        default=_DEFAULTS.max_loras,
        help="distinct adapters among the running requests (so in any step); the others' requests wait their turn",
    )
    g.add_argument("--max-lora-rank", type=int, default=_DEFAULTS.max_lora_rank, help="the highest adapter rank served")
    g.add_argument(
        "--lora-dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default=_DEFAULTS.lora_dtype,
        help="the adapters' format in memory (the sums stay the activations'); auto: the base weights' float format "
        "(a 16-bit checkpoint's 16 bits: half the bytes a step reads per adapter)",
    )
    g.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters held in memory at once (the others read from disk when a request wants one, the least "
        "recently used that no request runs making room); default: all of them",
    )


def lora_config(args: argparse.Namespace) -> LoraConfig | None:
    """The engine's LoRA config of the flags (None without --enable-lora); SystemExit naming a flag at fault."""
    if not getattr(args, "enable_lora", False):  # (`sluice generate` has no LoRA flags: it runs the base model)
        if getattr(args, "lora_modules", None):
            raise SystemExit("--lora-modules needs --enable-lora")
        return None
    return LoraConfig(modules=args.lora_modules, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                      max_cpu_loras=args.max_cpu_loras, lora_dtype=args.lora_dtype)  # fmt: skip


def _lora_module(text: str) -> LoraModule:
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
            return LoraModule(name=spec["name"], path=spec["path"], base_model_name=spec.get("base_model_name"))
        except (ValueError, KeyError, TypeError) as e:
            raise argparse.ArgumentTypeError(f'a JSON adapter needs "name" and "path": {e}') from e
    name, eq, path = text.partition("=")
    if not (eq and name and path):
        raise argparse.ArgumentTypeError(f"expected NAME=PATH or JSON, got {text!r}")
    return LoraModule(name=name, path=path)


def runtime_update_arguments(group) -> None:
    group.add_argument(
        "--enable-lora-runtime-updates",
        action="store_true",
        help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), with --enable-lora and --api-key",
    )


def runtime_updates(args: argparse.Namespace) -> bool:
    """--enable-lora-runtime-updates, checked against the flags it needs (SystemExit)."""
    if not args.enable_lora_runtime_updates:
        return False
    if not args.enable_lora:
        raise SystemExit("--enable-lora-runtime-updates needs --enable-lora")
    if not args.api_key:
        raise SystemExit("--enable-lora-runtime-updates needs --api-key: its endpoints read any directory named")
    return True
