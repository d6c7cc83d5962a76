"""ServingContext: what parsing a request reads of the server it is served by (frontend/protocol.py, and the
modules it builds on: frontend/budget.py, frontend/guidance.py): the tokenizer, the model's names, context length,
vocabulary and BOS token, the request limits, and the serving flags that shape a request. Of the frontend, imports
only frontend/tokenizer.py."""

from __future__ import annotations

from dataclasses import dataclass

from actors.engine.config import LoraModule
from frontend.tokenizer import Tokenizer
from messages.sampling_params import DEFAULT_LIMITS, RequestLimits


@dataclass(frozen=True)
class ServingContext:
    tokenizer: Tokenizer
    model_names: list[str]  # the first one answers requests that name no model
    max_model_len: int
    vocab_size: int  # ids >= this are rejected: the model's vocabulary (embedding rows)
    limits: RequestLimits = DEFAULT_LIMITS
    model_dir: str | None = None  # where structured outputs find the tokenizer their grammars are compiled for
    grammar_timeout_s: float = 10.0  # a structured output's spec must compile within this (frontend/structured.py)
    tool_call_parser: str | None = None  # --tool-call-parser with --enable-auto-tool-choice: tool_choice "auto"
    bos_token_id: int | None = None  # the model's (as the engine's ModelConfig): CFG guides against it
    reasoning_parser: str | None = None  # --reasoning-parser: chat outputs' reasoning split out (frontend/reasoning.py)
    loras: dict[str, LoraModule] | None = None  # the LoRA adapters a request's `model` may name, by name
    runner: str = "generate"  # what the model is served for: "generate", or "pooling" (frontend/routes.py)

    def knows(self, model: str) -> bool:
        """Whether `model` names the served model or one of its adapters."""
        return model in self.model_names or model in (self.loras or {})
