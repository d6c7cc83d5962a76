"""The `sluice` command line's arguments: the engine's (serve and generate), the request limits (serve), and the
argument types that check a value where it is typed. frontend/cli.py builds the commands from them."""

from __future__ import annotations

import argparse
import re
from typing import get_args

import msgspec

from actors.engine.config import CUDA_MAX_NUM_SEQS, MAX_NUM_SEQS, EngineConfig, SpeculativeConfig
from actors.routing import POLICIES
from messages.sampling_params import LogprobsMode, RequestLimits

_DEFAULTS = EngineConfig(model="")


class Help(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):  # a None default is explained in the help text, if at all
        return action.help if action.default is None else super()._get_help_string(action)


def engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", help="model directory or .gguf file (default: the bundled SmolLM2-135M)")
    g = parser.add_argument_group("engine")
    g.add_argument("--runner", choices=["auto", "generate", "pooling"], default="auto",
                   help="serve the model for generation or pooling (embeddings); auto: pooling for an encoder")  # fmt: skip
    g.add_argument("--pooler-config",
                   help='JSON over the model\'s pooling, e.g. {"pooling_type": "MEAN", "normalize": true}')  # fmt: skip
    g.add_argument("--load-format", choices=["auto", "dummy"], default=_DEFAULTS.load_format,
                   help="dummy: random weights of the model's shape (vLLM's: for benchmarks; outputs are noise)")  # fmt: skip
    g.add_argument("--max-num-seqs", type=int, default=0,
                   help=f"max requests in a batch (default: {CUDA_MAX_NUM_SEQS} on CUDA, {MAX_NUM_SEQS} elsewhere)")  # fmt: skip
    g.add_argument("--max-model-len", type=int, default=_DEFAULTS.max_model_len, help="max prompt + output tokens")
    g.add_argument("--max-num-batched-tokens", type=int, default=_DEFAULTS.max_num_batched_tokens,
                   help="token budget per step")  # fmt: skip
    g.add_argument("--long-prefill-token-threshold", type=int, default=_DEFAULTS.long_prefill_token_threshold,
                   help="a prompt's tokens per step while others decode (bounds the stall a long prompt costs them; 0: off)")  # fmt: skip
    g.add_argument("--block-size", type=int, default=_DEFAULTS.block_size, help="tokens per KV cache block")
    kv = g.add_mutually_exclusive_group()
    kv.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV blocks per cache: the model's, and as many for a draft model's (default: from --kv-cache-memory-gb)",
    )
    kv.add_argument(
        "--kv-cache-memory-gb",
        type=positive_float,
        default=_DEFAULTS.kv_cache_memory_gb,
        help="memory of every KV cache together (the model's and a draft model's; a gang's: per rank), in GiB "
        "(default: 1 on CPU and in a gang; on CUDA, what --gpu-memory-utilization leaves)",
    )
    kv.add_argument(
        "--gpu-memory-utilization",
        type=_fraction,
        default=None,
        help="on CUDA, with one rank: the fraction of the device's memory the engine may use; the KV cache "
        "gets what a worst-case step, the weights and CUDA graphs leave (default 0.9; --num-kv-blocks or "
        "--kv-cache-memory-gb override)",
    )
    g.add_argument(
        "--dtype",
        default=_DEFAULTS.dtype,
        help="auto, float32, bfloat16 or float16. On CPU it names the weights' format (activations, the KV cache and "
        "every sum float32, on the native kernels): auto keeps a 16-bit checkpoint's 16 bits, else float32; on CUDA, "
        "the model's dtype (auto: bfloat16)",
    )
    g.add_argument("--device", default=_DEFAULTS.device, help="auto, cpu or cuda")
    g.add_argument(
        "--quantization",
        type=_quantization,
        default=None,
        metavar="{q8_0,q4_0,q4_k}",
        help="an HF checkpoint's linear layers quantized at load into GGUF's blocks and served as a GGUF's are (CPU, "
        "float32 activations): q8_0 (1.06 bytes a weight), q4_0 or q4_k (0.56; q4_k's layers of widths off 256 in "
        "Q5_0, as llama.cpp's)",
    )
    g.add_argument(
        "--cpu-kernels",
        choices=["native", "torch"],
        default=_DEFAULTS.cpu_kernels,
        help="CPU float32 linear layers: torch (oneDNN/MKL) or native (Sluice's AVX2/AVX-512 kernels, built by make "
        "setup: a row's result is the same bits in any step of up to 64 rows; --quantization needs them) (default: "
        "native where built, torch's with a warning otherwise)",
    )
    g.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a request's logits are the same bits in any step: alone or in any batch, as a prefill chunk, a "
        "speculative verification row or a recomputed row (CPU float32 on the native kernels at every row count, "
        "native attention for every row; slower on prefills: docs/PERFORMANCE.md)",
    )
    g.add_argument(
        "--attention-backend",
        choices=["torch", "triton", "native"],
        default=_DEFAULTS.attention_backend,
        help="paged attention: torch (the reference), triton (kernels reading the KV cache in place; on CPU they run "
        "in the Triton interpreter, slowly: for tests and debugging) or native (CPU float32: a C++ kernel reading the "
        "cache in place for decode and short rows, torch's for prefills) (default: triton on CUDA, native on CPU "
        "for float32 where its kernels are built, torch otherwise)",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs: every step runs eagerly (default: decode steps replay graphs captured at startup)",
    )
    g.add_argument(
        "--engine-threads", type=int, default=None, help="torch threads per rank (default: every core, shared by ranks)"
    )
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=positive_int,
        default=_DEFAULTS.tensor_parallel_size,
        help="shard the model over this many worker processes (ranks of a torch.distributed gang: gloo on CPU, NCCL "
        "on CUDA, one device each); the worker then runs in processes of its own",
    )
    g.add_argument("--nnodes", type=positive_int, default=_DEFAULTS.nnodes, help="nodes the gang spans")
    g.add_argument(
        "--data-parallel-size",
        "-dp",
        type=positive_int,
        default=_DEFAULTS.data_parallel_size,
        help="engine replicas behind the server, each a scheduler, its worker (or gang), its detokenizer and its own "
        "KV and prefix cache; they share the node's cores (and split its CUDA devices)",
    )
    g.add_argument(
        "--data-parallel-size-local",
        type=int,
        default=None,
        help="replicas this node runs, the first ones (default: all); each other one runs on a node of its own "
        "(`sluice serve --headless --data-parallel-rank K`) and joins this one at --data-parallel-address",
    )
    g.add_argument(
        "--data-parallel-rank",
        type=int,
        default=None,
        help="with --headless: the replica this node runs, joined to the front node at --data-parallel-address",
    )
    g.add_argument(
        "--data-parallel-address",
        default=_DEFAULTS.data_parallel_address,
        help="the front node's address, where it listens for the replicas' nodes (bind and connect; CurveZMQ with "
        "the cluster secret)",
    )
    g.add_argument(
        "--data-parallel-rpc-port", type=int, default=_DEFAULTS.data_parallel_rpc_port, help="... and its port"
    )
    g.add_argument(
        "--dp-routing",
        choices=POLICIES,
        default="cache_aware",
        help="which replica a request goes to: the one whose prefix cache holds most of its prompt unless it is "
        "much busier (cache_aware), the least loaded (4 x waiting + running), or each in turn",
    )
    g.add_argument("--node-rank", type=int, default=0, help="this node's rank (0: the node that serves)")
    g.add_argument(
        "--master-addr",
        default=_DEFAULTS.master_addr,
        help="node 0's address, where its gang leader listens for the other nodes (bind and connect)",
    )
    g.add_argument("--master-port", type=int, default=_DEFAULTS.master_port, help="... and its port")
    g.add_argument(
        "--headless",
        action="store_true",
        help="run only this node's ranks of a gang led by node --master-addr (no API server)",
    )
    g.add_argument(
        "--cluster-secret",
        default=None,
        help="the secret the nodes authenticate each other with (CurveZMQ keys derived from it; prefer the "
        "SLUICE_CLUSTER_SECRET environment variable: a command line is visible to every local user)",
    )
    g.add_argument(
        "--worker",
        choices=["inline", "process"],
        default=None,
        help="where the model runner and sampler run: in the engine process, or in a supervised process of their "
        "own (a crash in the forward then costs a pause; draft-model speculation needs inline; default: process on "
        "CUDA and with --tensor-parallel-size above 1, else, and with a draft model, inline)",
    )
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.async_scheduling,
        help="plan step N+1 while step N runs",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.enable_prefix_caching,
        help="reuse the KV cache blocks of shared prompt prefixes",
    )
    g.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        metavar="JSON",
        help='speculative decoding, vLLM\'s shape: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4} (default: off)',
    )
    g.add_argument(
        "--logprobs-mode",
        choices=get_args(LogprobsMode),
        default=_DEFAULTS.logprobs_mode,
        help="logprobs of the model's distribution (raw) or of the one sampled from, after penalties, temperature "
        "and truncation (processed); prompt logprobs are always raw",
    )
    parser.add_argument(
        "--skip-memory-check",
        action="store_true",
        help="start even if the model's weights and KV cache, as estimated before loading, exceed the host's "
        "available memory (MemAvailable; CPU only: docs/OPERATIONS.md, 'Memory')",
    )
    parser.add_argument("--fault-plan", metavar="FILE", help="fault injection plan, JSON (or $SLUICE_FAULT_PLAN)")
    parser.add_argument("--log-level", default=None, choices=["DEBUG", "INFO", "WARNING", "ERROR"])


QUANTIZATIONS = ("q8_0", "q4_0", "q4_k")  # (EngineConfig.quantization's: gpu/layers/quant.py's)
RETIRED = {"int8": "q8_0", "int4": "q4_k or q4_0", "bf16": "--dtype bfloat16"}  # (former names: what replaced them)


def _quantization(text: str) -> str:
    if text in RETIRED:
        raise argparse.ArgumentTypeError(f"{text!r} is retired: use {RETIRED[text]} (the same memory or less)")
    if text not in QUANTIZATIONS:
        raise argparse.ArgumentTypeError(f"{text!r}: {', '.join(QUANTIZATIONS)}")
    return text


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        config = msgspec.json.decode(text, type=SpeculativeConfig)
        config.verify()
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return config


_LIMIT_HELP = {
    "max_n": "choices per prompt",
    "max_logprobs": "top-N logprobs and prompt_logprobs",
    "max_stop": "stop strings per request",
    "max_stop_chars": "characters per stop string",
    "max_bad_words": "bad words per request",
    "max_bad_word_chars": "characters per bad word",
    "max_logit_bias": "logit_bias entries per request",
    "max_allowed_token_ids": "allowed_token_ids entries per request (default: the vocabulary size)",
    "max_stop_token_ids": "stop_token_ids entries per request",
    "max_choices": "prompts x n of one call",
    "max_total_tokens": "sum over a call's choices of prompt + max_tokens",
    "max_grammar_chars": "characters of a structured output's schema, regex, grammar or choices",
}


def limit_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("request limits (a request over one is refused with a 400 naming the field)")
    for name, default in msgspec.structs.asdict(RequestLimits()).items():
        g.add_argument(f"--{name.replace('_', '-')}", type=int, default=default, help=_LIMIT_HELP[name])


def metrics_prefix(prefix: str) -> str:
    if not re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", prefix):
        raise argparse.ArgumentTypeError(f"{prefix!r} cannot start a Prometheus metric name")
    return prefix


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def byte_size(text: str) -> int:
    """A positive size in bytes, with an optional binary K, M or G suffix: 65536, 8M, 1G."""
    m = re.fullmatch(r"(\d+)([KMG]?)(?:i?B)?", text.strip(), re.IGNORECASE)
    if m is None or int(m[1]) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in bytes (65536, 8M, 1G)")
    return int(m[1]) << (10 * " KMG".index(m[2].upper() or " "))


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value
