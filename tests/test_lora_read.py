"""gpu/loading/lora.py's read of a PEFT adapter on a tiny Llama, on meta (no base weight): the slot images hold PEFT's
own tensors (A rows by part, Bᵀ·alpha/r by the part's columns, zero-padded to the tables' rank), and every refusal
names the adapter and the tensor (a non-finite weight, a wrong shape, an integer tensor, a stray tensor, files
changed since the digest was taken)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu.loading.config import ModelConfig
from gpu.loading.lora import LoraError, adapter_digest, check_adapter, lora_tables, read_adapter
from gpu.models import REGISTRY
from tests.lora_adapters import make_adapter

RANK, WEIGHTS = 16, "adapter_model.safetensors"
Q = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.fixture
def setup(family_dir_of, tmp_path):
    base = family_dir_of("llama")
    config = ModelConfig.from_path(base)
    with torch.device("meta"):
        model = REGISTRY[config.architecture](config)
    return model, make_adapter(base, tmp_path / "a", seed=3, r=8)


def test_the_images_are_pefts_tensors_laid_out(setup):
    model, adapter = setup
    digest, images = read_adapter(adapter, model, RANK, torch.float32)
    assert digest == adapter_digest(adapter) == check_adapter(adapter, model, RANK)
    tensors = load_file(adapter / WEIGHTS)
    firsts, a, b = images["model.layers.0.self_attn.qkv_proj"]
    for part, name in enumerate(("q_proj", "k_proj", "v_proj")):
        stem = f"base_model.model.model.layers.0.self_attn.{name}"
        assert torch.equal(a[part * RANK : part * RANK + 8], tensors[f"{stem}.lora_A.weight"])
        assert torch.equal(a[part * RANK + 8 : (part + 1) * RANK], torch.zeros(8, a.shape[1]))
        expected = tensors[f"{stem}.lora_B.weight"].T * 2.0  # (make_adapter: lora_alpha = 2 r)
        assert torch.equal(b[:8, firsts[part] : firsts[part + 1]], expected)
    assert torch.equal(b[8:], torch.zeros(8, b.shape[1]))


@pytest.mark.parametrize(
    "case, message",
    [("nan", r"self_attn.q_proj, .*: weights not finite"), ("shape", r"q_proj.lora_A is torch.float32 \(8, 5\)"),
     ("int", "q_proj.lora_B is torch.int32"), ("stray", "unexpected tensor extra"), ("changed", "changed since"),
     ("truncated", f"unreadable {WEIGHTS}: .*do not fit"), ("header", f"unreadable {WEIGHTS}: .*not a JSON object")],
)  # fmt: skip
@pytest.mark.parametrize("reader", ["check", "read"])
def test_a_bad_adapter_is_refused_naming_the_tensor(setup, case, message, reader):
    """(by the launcher's and a registration's check, which lays out no images, and by the worker's read)"""
    model, adapter = setup
    digest = adapter_digest(adapter)
    tensors = load_file(adapter / WEIGHTS)
    if case == "nan":
        tensors[f"{Q}.lora_B.weight"][3, 1] = float("nan")
    elif case == "shape":
        tensors[f"{Q}.lora_A.weight"] = torch.zeros(8, 5)
    elif case == "int":
        tensors[f"{Q}.lora_B.weight"] = tensors[f"{Q}.lora_B.weight"].int()
    elif case == "stray":
        tensors["extra"] = torch.zeros(2)
    elif case == "changed":
        tensors[f"{Q}.lora_A.weight"] += 1.0
    save_file(tensors, adapter / WEIGHTS)
    if case == "truncated":  # (the header says more bytes than the file has)
        data = (adapter / WEIGHTS).read_bytes()
        (adapter / WEIGHTS).write_bytes(data[:-100])
    elif case == "header":  # (valid JSON, not a table of tensors)
        (adapter / WEIGHTS).write_bytes(len(b'"x"').to_bytes(8, "little") + b'"x"')
    if reader == "check" and case == "changed":  # (a check is of files not named yet: its digest is theirs)
        assert check_adapter(adapter, model, RANK) == adapter_digest(adapter) != digest
        return
    with pytest.raises(LoraError, match=message) as e:
        if reader == "read":
            read_adapter(adapter, model, RANK, torch.float32, digest if case == "changed" else None)
        else:
            check_adapter(adapter, model, RANK)
    assert str(adapter) in str(e.value)


@pytest.mark.parametrize(
    "big, dtype, refused",
    [(torch.tensor(1e5), torch.float16, True), (torch.tensor(1e5), torch.float32, False),
     (torch.tensor(1e39, dtype=torch.float64), torch.float32, True), (torch.tensor(4e38, dtype=torch.float64), torch.bfloat16, True)],
)  # fmt: skip
def test_the_check_holds_an_adapter_to_its_tables_range(setup, big, dtype, refused):
    """A weight finite in its file but not in the tables' format (float16's 65504; a float64's 1e39 as float32) is
    refused by the launch's check as by the worker's read into those tables (their verdicts the same)."""
    model, adapter = setup
    tensors = load_file(adapter / WEIGHTS)
    a = tensors[f"{Q}.lora_A.weight"].to(big.dtype)
    a[2, 3] = big
    tensors[f"{Q}.lora_A.weight"] = a
    save_file(tensors, adapter / WEIGHTS)
    for read in (lambda: check_adapter(adapter, model, RANK, dtype), lambda: read_adapter(adapter, model, RANK, dtype)):
        if refused:
            with pytest.raises(LoraError, match=f"self_attn.q_proj, .*: weights not finite \\(as {dtype}"):
                read()
        else:
            read()


def test_the_tables_format_is_the_flags_or_the_weights():
    assert lora_tables("float32", torch.float16) == torch.float32  # (named)
    assert lora_tables("auto", torch.bfloat16) == torch.bfloat16  # (a 16-bit checkpoint's weights on CPU)


def test_a_launch_names_the_tables_format_for_every_process(family_dir_of, setup):
    """checked_loras resolves --lora-dtype auto as the runner would (the base's weights' format on CPU: a bfloat16
    checkpoint's 16 bits), so the engine's processes check and hold adapters in one format."""
    from dataclasses import replace

    from actors.engine.config import EngineConfig, LoraConfig, LoraModule
    from frontend.http_base import HttpConfig
    from frontend.preflight import checked_loras

    _, adapter = setup
    base = ModelConfig.from_path(family_dir_of("llama"))
    cases = [(base, "auto", "float32"), (replace(base, dtype=torch.bfloat16), "auto", "bfloat16"),
             (base, "float16", "float16")]  # fmt: skip
    for model, named, held in cases:
        lora = LoraConfig(modules=[LoraModule(name="a", path=str(adapter))], lora_dtype=named)
        engine = EngineConfig(model=str(model.path), lora=lora, device="cpu")
        assert checked_loras(model, engine, HttpConfig(port=0)).lora_dtype == held, (named, model.dtype)
