"""LoRA adapters built by PEFT over a saved checkpoint, with random weights drawn wide enough that a delta left out
(or applied to the wrong rows) changes the logits by far more than the tests' tolerance; PEFT's own forward over
the same checkpoint as the reference; and a hand-driven request whose rows run an adapter."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from gpu.batch import ScheduledRow
from tests.tiny_model import Request

ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_dir: Path, out: Path, seed: int, r: int = 8, targets=ALL_SEVEN, **config) -> Path:
    """A PEFT LoRA adapter over the checkpoint at `base_dir`, saved into `out` (safetensors)."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), init_lora_weights=False, **config)
    model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    model.save_pretrained(out)
    return out


def peft_reference(base_dir: Path, adapter: Path | None):
    """PEFT's forward of the base with `adapter` (None: the base model alone), float32, eval mode."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    return base if adapter is None else PeftModel.from_pretrained(base, adapter).eval()


class LoraRequest(Request):
    """tests/tiny_model.py's Request, its rows running the adapter `lora` (a digest; None: the base model)."""

    def __init__(self, *args, lora: str | None = None) -> None:
        super().__init__(*args)
        self.lora = lora

    def row(self, n: int | None = None) -> ScheduledRow:
        row = super().row(n)
        row.lora = self.lora
        return row
