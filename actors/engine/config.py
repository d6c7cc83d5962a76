"""EngineConfig: everything the engine process needs, JSON-serializable (it travels in the spawn config)."""

from __future__ import annotations

import os
from typing import Literal

import msgspec

from messages import names
from messages.sampling_params import LogprobsMode

# max_num_seqs 0 (the CLI's default) resolved by EngineConfig.placed: 256 on CUDA (vLLM's under 70 GiB; 1,024 above), as
# a card's throughput needs the rows (issue 53's targets at c256; decode graphs are captured up to it: 35 sizes), else 64
CUDA_MAX_NUM_SEQS, MAX_NUM_SEQS = 256, 64


def device_type(device: str) -> str:
    """The type of gpu/runner/model_runner.py's resolve_device(device), without initializing CUDA here."""
    if device == "auto":
        import torch  # (here: the processes that only read a config do not load it)

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device.partition(":")[0]


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `--speculative-config` shape: "ngram" (prompt lookup) or "draft_model" (a smaller model with the
    same vocabulary)."""

    method: Literal["ngram", "draft_model"]
    num_speculative_tokens: int  # K: draft tokens verified per step (a request gains 1..K+1 tokens)
    prompt_lookup_min: int = 2  # ngram: the shortest suffix n-gram looked up ...
    prompt_lookup_max: int = 4  # ... and the longest, tried first
    model: str | None = None  # draft_model: its directory or .gguf

    def verify(self) -> None:
        """Raise ValueError naming what is wrong."""
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError('"model" (a directory or .gguf) is required with method "draft_model", and only then')
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min}, "
                f"{self.prompt_lookup_max}"
            )


class LoraModule(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """An adapter served from the start (vLLM's `--lora-modules`: name=path, or its JSON form)."""

    name: str  # what a request's `model` names it by
    path: str  # a PEFT directory (gpu/loading/lora.py)
    base_model_name: str | None = None  # the parent /v1/models lists (None: the served model's first name)
    digest: str = ""  # its files' (gpu/loading/lora.py adapter_digest): filled in by the launcher, which checks it


class LoraConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Multi-LoRA serving (`--enable-lora`): every adapter is held from the start, each step runs at most max_loras."""

    modules: list[LoraModule] = []
    max_loras: int = 4  # distinct adapters among the running requests (so in any step); the base takes none
    max_lora_rank: int = 16  # an adapter of a higher rank is refused at load
    # adapters the worker holds at once (its slot tables), the others read from disk when a request wants one; None:
    # all of them (at least max_loras)
    max_cpu_loras: int | None = None
    # the slot tables' format (vLLM's --lora-dtype): "auto" the base's float weights' (a 16-bit checkpoint's 16 bits,
    # a float32 checkpoint's or a quantized GGUF's float32); the sums are the activations' either way
    lora_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"

    @property
    def capacity(self) -> int:
        return self.max_cpu_loras or max(self.max_loras, len(self.modules))

    def at_start(self) -> dict[str, str]:
        """The adapters a worker holds as it starts (digest -> directory): the first `capacity` (the others are read
        when a request wants one: actors/engine/lora_table.py)."""
        return {m.digest: m.path for m in self.modules[: self.capacity]}

    def verify(self) -> None:
        names = [m.name for m in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names an adapter twice: {sorted(n for n in names if names.count(n) > 1)}")
        if not 1 <= self.max_loras <= 1024 or not 1 <= self.max_lora_rank <= 1024:
            raise ValueError("--max-loras and --max-lora-rank must be in [1, 1024]")
        if self.max_cpu_loras is not None and not self.max_loras <= self.max_cpu_loras <= 4096:
            raise ValueError(f"--max-cpu-loras must be in [--max-loras ({self.max_loras}), 4096]")


class EngineConfig(msgspec.Struct, kw_only=True):
    model: str  # an HF-style directory (a .gguf's card: gpu/loading/gguf_card.py)
    # what the model is served for: "generate" (a decoder's text), "pooling" (an encoder's embeddings: actors/pooler);
    # "auto": pooling for an encoder architecture (gpu/loading/encoder_config.py is_pooling_model), else generate
    runner: Literal["auto", "generate", "pooling"] = "auto"
    pooler_config: str | None = None  # --pooler-config: JSON over the model's own pooling (pooling_type, normalize)
    device: str = "auto"
    dtype: str = "auto"
    quantization: Literal["q8_0", "q4_0", "q4_k"] | None = None  # weight-only, CPU float32 (gpu/layers/quant.py)
    # "dummy" (vLLM's): random weights of the model's shape, its config and tokenizer the model's
    # (gpu/loading/random_weights.py: the launch serves a copy of them in the cache)
    load_format: Literal["auto", "dummy"] = "auto"
    # CPU linear layers: torch's F.linear or the native kernels (gpu/kernels/native: batch-invariant; --quantization
    # needs them); None: native where built (torch's with a warning otherwise)
    cpu_kernels: Literal["native", "torch"] | None = None
    # a row's logits the same bits in any step: alone, in any batch, chunked, verified, recomputed (CPU: the native
    # kernels at every row count, native attention for every row; docs/OPERATIONS.md)
    batch_invariant: bool = False
    # paged attention (gpu/attention/backend.py); None: triton on CUDA, native on CPU for float32 (where built)
    attention_backend: Literal["torch", "triton", "native"] | None = None
    enforce_eager: bool = False  # no CUDA graphs: every step runs the dynamic path (gpu/runner/graphs.py)
    static_decode: bool = (
        False  # tests, debugging: steps on the graphs' static buffers (every kind), run without graphs
    )
    max_num_seqs: int = MAX_NUM_SEQS  # 0: the device's (resolved by `placed`: CUDA_MAX_NUM_SEQS on CUDA)
    max_model_len: int = 2048
    max_num_batched_tokens: int = 2048  # a step's token budget: a wave of 128-token prompts prefills in one step
    long_prefill_token_threshold: int | None = 256  # ... but one prompt gets at most this in a step that decodes
    block_size: int = 16
    # KV blocks per cache: the target's and, with a draft model, the draft's (its blocks pair one-for-one with the
    # target's). None: as many as fit in kv_cache_memory_gb, which holds every KV cache, where given; else, on CUDA with
    # one rank, in gpu_memory_utilization of the device (profiled by the worker: actors/engine/kv_sizing.py),
    # elsewhere in 1 GiB
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9  # vLLM's: the fraction of the device's memory the engine may use
    engine_threads: int | None = None  # None: the cores left after the other actors
    async_scheduling: bool = True  # speculative decoding steps synchronously (the proposer reads the last tokens)
    speculative: SpeculativeConfig | None = None  # off by default
    enable_prefix_caching: bool = True  # reuse the KV blocks of shared prompt prefixes (actors/engine/block_manager.py)
    logprobs_mode: LogprobsMode = "raw_logprobs"  # what response logprobs report (gpu/sampling/sampler.py)
    stats_interval_s: float = 0.5
    stats_to: list[str] = []  # actors that receive EngineStats (the HTTP actor)
    debug_checks: bool = False  # fill the device relay buffer with -1 and assert every read slot was written
    abort_timeout_s: float = 5.0  # the detokenizer (and the offline client) re-send an unanswered Abort after this (I7)
    max_abort_tries: int = 3  # ... and drops the tombstone after this many tries
    step_gate: bool = False  # tests: Probe(seq=k) to the scheduler lets k more steps finish (k < 0: all)
    record_outputs: str | None = None  # tests: a file each step's sent tokens are appended to (JSON lines)
    # Where the worker (model runner + sampler, actors/engine/worker.py) runs: "inline", in the engine process on
    # its device thread (no hop, no extra process: as fast on CPU, docs/PERFORMANCE.md), or "process", its own
    # supervised process (a crash in the forward costs a pause, not the engine; on CUDA its device thread shares no
    # GIL with the scheduler: 2.2x inline's throughput at c64 on an H200). "auto" (resolved by `placed`): process
    # on CUDA and for a gang, inline on CPU and with a draft model (which runs beside the scheduler)
    worker: Literal["auto", "inline", "process"] = "auto"
    # a step of the process worker neither answered nor progressed for this long is given up: hung (its heartbeats,
    # every step_timeout_s / 5, came but showed no progress: blamed, the process restarted) or lost (nothing came:
    # the worker is reset). A slow step that progresses is waited for
    step_timeout_s: float = 60.0
    # tensor parallelism: the worker is a gang of this many ranks, each with its shard of the model and KV cache
    # (actors/engine/gang.py); more than one needs worker "process"
    tensor_parallel_size: int = 1
    # ... across this many nodes, each with tensor_parallel_size / nnodes ranks (actors/engine/gang_nodes.py); the
    # first node's leader listens for the others at master_addr:master_port (CurveZMQ, the cluster secret)
    nnodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    # a request in this many steps that killed the worker or failed there is failed alone; from the one before, it
    # runs in steps of its own (so the others are not blamed with it). Three deaths fit the supervisor's default
    # restart intensity (3 in 60 s)
    max_step_failures: int = 3
    # data parallelism: this many engine replicas (each a scheduler, its worker or gang, its detokenizer, its KV and
    # prefix cache) behind one client (actors/routing.py); this config is replica data_parallel_rank's
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # ... of which the front node runs the first data_parallel_size_local (None: all); each other one runs on a node
    # of its own, whose launcher joins the front's door at data_parallel_address:data_parallel_rpc_port (CurveZMQ,
    # the cluster secret: actors/replica_link.py)
    data_parallel_size_local: int | None = None
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = 29550
    lora: LoraConfig | None = None  # LoRA adapters over the model (None: off)
    crash_token: int | None = None  # tests: the worker's process exits when a row feeds this token (a poison request)
    slow_token: int | None = None  # tests: a step feeding it sleeps step_timeout_s per hooked layer (worker.py)
    hang_token: int | None = None  # tests: a step feeding it blocks for good, with no progress (a hung step)

    def __post_init__(self) -> None:
        if self.lora is not None:
            self.lora.verify()
            if self.tensor_parallel_size > 1 and self.lora.capacity < len(self.lora.modules):
                raise ValueError("a tensor-parallel gang holds every adapter: --max-cpu-loras below --lora-modules")
        tp, nnodes = self.tensor_parallel_size, self.nnodes
        if tp < 1 or nnodes < 1 or tp % nnodes:
            raise ValueError(f"tensor_parallel_size ({tp}) must be a positive multiple of nnodes ({nnodes})")
        if tp > 1 and self.worker == "inline":
            raise ValueError('a tensor-parallel gang runs in worker processes: worker must be "process"')
        if (tp > 1 or self.worker == "process") and self.speculative and self.speculative.method == "draft_model":
            raise ValueError("draft-model speculation runs beside the scheduler: --worker inline, one rank")
        dp = self.data_parallel_size
        if dp < 1 or not 0 <= self.data_parallel_rank < dp or not 0 <= self.local_replicas <= dp:
            raise ValueError(
                f"data_parallel_size ({dp}) must be positive, above data_parallel_rank and at least "
                "data_parallel_size_local"
            )
        if dp > 1 and nnodes > 1:
            raise ValueError("a data-parallel replica's gang runs on one node (nnodes 1)")
        if self.batch_invariant and (
            self.device.startswith("cuda")
            or self.attention_backend not in (None, "native")
            or self.cpu_kernels == "torch"
            or self.dtype not in ("auto", "float32", "float")
            or tp > 1
        ):
            raise ValueError(
                "batch-invariant mode runs float32 activations on a CPU with the native kernels and attention backend, "
                "on one device"
            )

    def placed(self) -> EngineConfig:
        """This config with what depends on the device resolved, as the engine's processes get it (actors/graph.py;
        resolved there, as whether CUDA is available is torch's to say: the launcher holds none): the worker's place
        ("auto": see `worker`) and max_num_seqs 0 (CUDA_MAX_NUM_SEQS on CUDA, MAX_NUM_SEQS elsewhere)."""
        placed = {}
        if self.worker == "auto":
            draft = self.speculative is not None and self.speculative.method == "draft_model"
            process = self.tensor_parallel_size > 1 or (device_type(self.device) == "cuda" and not draft)
            placed["worker"] = "process" if process else "inline"
        if not self.max_num_seqs:
            placed["max_num_seqs"] = CUDA_MAX_NUM_SEQS if device_type(self.device) == "cuda" else MAX_NUM_SEQS
        return msgspec.structs.replace(self, **placed) if placed else self

    @property
    def local_replicas(self) -> int:
        """The replicas the front node runs: 0 .. local_replicas - 1."""
        return self.data_parallel_size if self.data_parallel_size_local is None else self.data_parallel_size_local

    @property
    def replica(self) -> names.Replica:
        """This replica's actors (messages/names.py)."""
        return names.replica(self.data_parallel_rank)

    def threads(self) -> int:
        """Torch threads for the engine (per rank of a gang): every core this process may run on (a gang's ranks
        and the data-parallel replicas divide them). Measured on 2 cores with the HTTP and detokenizer processes
        busy (docs/performance-history.md, "Engine speed against vLLM's CPU build (issue 13, first pass)"): 2 threads
        against 1 gave 69.6 vs 40.9 output tok/s at concurrency 16 and 12.6 vs 11.4 at 1; more threads than cores
        once cut decode 5x, so never more."""
        if self.engine_threads:
            return self.engine_threads
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        ranks = (
            self.tensor_parallel_size // self.nnodes * max(1, self.local_replicas)
        )  # (a node's ranks share its cores)
        return max(1, cores // ranks)

    def decode_graphs(self) -> Literal["eager", "off"] | None:
        """The runner's decode-step mode (gpu/runner/graphs.py): None lets it capture where it can."""
        return "off" if self.enforce_eager else "eager" if self.static_decode else None
