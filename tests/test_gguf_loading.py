"""A .gguf served in place (gpu/loading/gguf_card.py, gguf_file.py): tiny Llama and Qwen2 checkpoints written to GGUF
as llama.cpp's converter writes them (tests/gguf_writer.py: q/k rows permuted for Llama) in F32, F16, BF16 and Q8_0,
and the block formats (random blocks where gguf-py has no quantizer), served from the file, against HF transformers'
own forward of the same weights (each matrix the GGUF's value: rounded to F16/BF16, or gguf-py's dequantization of
the blocks; for the blocks each linear input quantized as llama.cpp's kernels quantize it, in this file): every
position's top-5 log-probabilities within TOL, greedy equal where HF's top two are apart. The card holds no weight and its
tokenizer tokenizes as the checkpoint's; a split file loads the same bits as the whole; a file that is not GGUF is
refused by name and leaves no card behind."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gpu.layers.linear import BLOCK_FORMATS
from gpu.loading.config import ModelConfig, ModelLoadError
from gpu.loading.convert import cache_dir
from gpu.loading.gguf_file import GGUFFile
from gpu.loading.random_weights import served_dir
from gpu.loading.weights import check_quantization
from gpu.runner.model_runner import ModelRunner
from tests.family_models import make_family_dir, run_greedy
from tests.gguf_writer import write_gguf
from tests.tiny_model import Request, block_pool

T = gguf.GGMLQuantizationType
TOL = 1e-3
# block formats: both sides quantize each linear input to 8 bits, from inputs equal only to float32 rounding, so an
# activation's rounding can flip between them (one step of its block's scale: amax / 127, times the weights it meets):
# 0.021 on an AMD EPYC, 0.061 on an Intel Xeon (where MKL rounds HF's float32 differently: other flips), 0 elsewhere;
# a wrong row, part or permutation moves log-probabilities by whole units
TOL_BLOCKS = 0.15
PROMPT = [1, 510, 2210, 77, 4915, 33, 99, 12, 40000, 7, 8, 9]


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    """Cards in a cache of this run's (the bundled model's directory shared: its tokenizer builds the checkpoints)."""
    cache = tmp_path_factory.getbasetemp() / "gguf-cache"
    if not cache.is_dir():
        cache.mkdir()
        (cache / "models").symlink_to(cache_dir() / "models")
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(cache))


def q8_0(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's quantize_row_q8_0 and back: per 32, d = amax / 127 (kept as f16), q = roundf(x / d)."""
    b = x.reshape(-1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    v = b * torch.where(d > 0, 1 / d, 0)
    q = v.sign() * (v.abs() + 0.5).floor()  # (roundf: half away from zero)
    return (q * d.half().float()).view(x.shape)


def q8_k(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's quantize_row_q8_K_ref and back: per 256, iscale = -127 / (the value of largest |x|), q =
    nearest(iscale x) (half to even), d = 1 / iscale."""
    b = x.reshape(-1, 256)
    big = b.gather(-1, b.abs().argmax(-1, keepdim=True))
    iscale = torch.where(big != 0, -127 / big, 0)
    q = (iscale * b).round().clamp(max=127)
    return (q * torch.where(iscale != 0, 1 / iscale, 0)).view(x.shape)


def as_served(model_dir, kind: T, values: dict) -> torch.nn.Module:
    """HF's model with every matrix the value the GGUF holds (`values`: tests/gguf_writer.py); for a block format,
    every linear layer's input quantized to 8 bits as llama.cpp's kernels quantize it (Q8_0 for the 32-element formats, Q8_K for the
    K-quants)."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(values.get(name, p))
        if hf.config.tie_word_embeddings:
            hf.lm_head.weight.copy_(values["model.embed_tokens.weight"])
    if kind in BLOCK_FORMATS:
        scheme = q8_0 if gguf.GGML_QUANT_SIZES[kind][0] == 32 else q8_k
        for m in hf.modules():
            if isinstance(m, torch.nn.Linear):
                m.register_forward_pre_hook(lambda _, args: (scheme(args[0]),))
    return hf


def logits(path, prompt: list[int] = PROMPT) -> torch.Tensor:
    runner = ModelRunner(ModelConfig.from_path(path), device="cpu", dtype="auto", num_blocks=32, block_size=4)
    req = Request(block_pool(1, 32), 0, list(prompt), 4)
    return torch.stack(run_greedy(runner, [req], 4, 64)[0]), req.tokens


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """Tiny Llama (and one with tied embeddings: the LM head's blocks are the table), Qwen2 (biases) and Qwen3 (q/k
    norms, heads narrower than hidden / heads; no sliding window: GGUF's qwen2/3 have no key for one), Phi-3 (fused
    q/k/v and gate/up, half the dims rotated), Gemma 2 (soft-caps, sandwich norms stored 1 + w, windows) and Gemma 3
    (q/k norms, a linear-scaled global rotary), their widths multiples of 256 (the K-quants' blocks)."""
    made, wide = tmp_path_factory.mktemp("sources"), dict(hidden_size=256, intermediate_size=512, head_dim=64)
    return {"llama": make_family_dir(made / "llama", "llama", **wide),
            "tied": make_family_dir(made / "tied", "llama", tie_word_embeddings=True, **wide),
            "qwen2": make_family_dir(made / "qwen2", "qwen2", use_sliding_window=False, **wide),
            "qwen3": make_family_dir(made / "qwen3", "qwen3", use_sliding_window=False, **{**wide, "head_dim": 32}),
            "phi3": make_family_dir(made / "phi3", "phi3", **wide),
            # (the queries' scale and Gemma 3's pattern of five local layers to a global one: llama.cpp's, no key)
            "gemma2": make_family_dir(made / "gemma2", "gemma2", query_pre_attn_scalar=64, **wide),
            "gemma3": make_family_dir(made / "gemma3", "gemma3", query_pre_attn_scalar=64, num_hidden_layers=6,
                                      layer_types=[*["sliding_attention"] * 5, "full_attention"], **wide)}  # fmt: skip


# (F32: the rotary test's; Q4_0 and Q5_0's own paths: tests/test_block_kernels.py, as every format's)
CASES = [("llama", T.F16), ("llama", T.BF16), ("llama", T.Q8_0), ("llama", T.Q4_K), ("tied", T.Q6_K),
         ("qwen2", T.Q5_K), ("tied", T.Q4_1), ("llama", T.Q5_1), ("qwen3", T.Q8_0), ("phi3", T.BF16),
         ("gemma2", T.Q4_K), ("gemma3", T.F16)]  # fmt: skip


@pytest.mark.parametrize("family, kind", CASES)
def test_a_gguf_is_served_as_hf_computes_its_weights(checkpoints, tmp_path, family, kind):
    source, values = checkpoints[family], {}
    arch = "llama" if family == "tied" else family
    mixed = {"v_proj": T.Q6_K, "down_proj": T.Q6_K} if kind in (T.Q4_K, T.Q5_K) else None  # (as Q4_K_M, Q5_K_M)
    path = write_gguf(source, tmp_path / f"tiny-{kind.name}.gguf", kind, arch=arch, values=values, kinds=mixed)
    ours, tokens = logits(path)
    with torch.no_grad():
        hf = as_served(source, kind, values)
        theirs = hf(torch.tensor([tokens[:-1]])).logits[0, : len(ours)].log_softmax(-1)
    mine, tol = ours.log_softmax(-1), TOL_BLOCKS if kind in BLOCK_FORMATS else TOL
    for pos, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        for ref, other in ((b, a), (a, b)):
            ids = ref.topk(5).indices
            assert (ref[ids] - other[ids]).abs().max() < tol, f"position {pos}: top-5 logprobs differ"
        top2 = b.topk(2).values
        assert top2[0] - top2[1] <= tol or a.argmax() == b.argmax(), f"position {pos}: greedy differs"


def test_block_weights_are_the_mapped_files_pages(checkpoints, tmp_path):
    """A GGUF's block tensors are held in place (views of the read-only mapping of the file), but llama's q and k,
    whose rows the converter permuted (copies, put back in HF's order)."""
    path = write_gguf(checkpoints["llama"], tmp_path / "mapped.gguf", T.Q8_0)
    runner = ModelRunner(ModelConfig.from_path(path), device="cpu", num_blocks=8, block_size=4)
    maps = Path("/proc/self/maps").read_text().splitlines()
    spans = [line.split()[0].split("-") for line in maps if line.rstrip().endswith(str(path))]
    mapped = lambda t: any(int(a, 16) <= t.data_ptr() < int(b, 16) for a, b in spans)  # noqa: E731
    layers = {n: m for n, m in runner.model.named_modules() if getattr(m, "blocks", None)}
    assert spans and len(layers) > 7
    for name, layer in layers.items():  # (qkv's parts: q, k copies; v in place)
        parts = [mapped(held) for _, _, held in layer.blocks]
        assert parts == ([False, False, True] if name.endswith("qkv_proj") else [True] * len(parts)), name


def test_the_card_holds_no_weight_and_tokenizes_as_the_checkpoint(checkpoints, tmp_path):
    source = checkpoints["llama"]
    config = ModelConfig.from_path(write_gguf(source, tmp_path / "tiny.gguf", T.F16))
    assert config.name == ModelConfig.from_path(config.path).name == "tiny"  # (the engine's, from its card: the stem)
    assert config.dtype == torch.float16 and not list(config.path.glob("*.safetensors"))
    text = "Hello, world! 12345 <|im_start|>user"
    assert (
        AutoTokenizer.from_pretrained(config.path)(text)["input_ids"]
        == AutoTokenizer.from_pretrained(source)(text)["input_ids"]
    )
    assert ModelConfig.from_path(tmp_path / "tiny.gguf").path == config.path  # (made once)


def test_llama_3s_rotary_factors_divide_the_frequencies(checkpoints, tmp_path):
    """rope_freqs.weight (llama.cpp's freq_factors): theta_i / factor_i, as HF's rotary with those frequencies."""
    source, values = checkpoints["llama"], {}
    factors = torch.linspace(1.0, 8.0, 32)  # (head_dim 64: 32 frequencies)
    ours, tokens = logits(write_gguf(source, tmp_path / "rope.gguf", T.F32, values=values, rope_freqs=factors))
    hf = as_served(source, T.F32, values)
    hf.model.rotary_emb.inv_freq /= factors
    with torch.no_grad():
        theirs = hf(torch.tensor([tokens[:-1]])).logits[0, : len(ours)].log_softmax(-1)
    assert (ours.log_softmax(-1) - theirs).abs().max() < TOL
    plain = logits(write_gguf(source, tmp_path / "plain.gguf", T.F32))[0]
    assert (plain.log_softmax(-1) - theirs).abs().max() > 100 * TOL  # (the power check: the factors matter)


def test_phi3s_longrope_factors_are_read_from_the_file(tmp_path):
    """Phi-3 128k / 3.5's longrope as llama.cpp's converter writes it (rope_factors_long/short tensors, the original
    context and attention factor as keys): served as HF computes the checkpoint (a 26-token sequence, past the
    original 16: the long factors); another file whose long factors differ serves other logits (the power check)."""
    served = []
    for name, long in (("long", torch.linspace(1.5, 12.0, 16)), ("other", torch.linspace(1.0, 2.0, 16))):
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
                "short_factor": torch.linspace(1.0, 2.0, 16).tolist(), "long_factor": long.tolist()}  # fmt: skip
        source = make_family_dir(tmp_path / name, "phi3", rope_parameters=rope, original_max_position_embeddings=16,
                                 hidden_size=256, intermediate_size=512, head_dim=64)  # fmt: skip
        values = {}
        ours, tokens = logits(
            write_gguf(source, tmp_path / f"{name}.gguf", T.F32, arch="phi3", values=values), PROMPT * 2
        )
        hf = as_served(source, T.F32, values)
        with torch.no_grad():
            theirs = hf(torch.tensor([tokens[:-1]])).logits[0, : len(ours)].log_softmax(-1)
        assert (ours.log_softmax(-1) - theirs).abs().max() < TOL
        served.append(ours.log_softmax(-1))
    assert (served[0] - served[1]).abs().max() > 100 * TOL


def test_a_split_file_loads_the_same_bits_as_the_whole(checkpoints, tmp_path):
    source = checkpoints["llama"]
    whole = logits(write_gguf(source, tmp_path / "whole.gguf", T.F16))[0]
    first = write_gguf(source, tmp_path / "split.gguf", T.F16, split_max_tensors=7)
    assert first.name.startswith("split-00001-of-") and first.is_file()
    assert "output.weight" not in GGUFFile(first).header  # (the untied head in a later part: found there)
    assert torch.equal(logits(first)[0], whole) and ModelConfig.from_path(first).name == "split"
    assert ModelConfig.from_path(served_dir(first, "dummy")).name == "split"  # (--load-format dummy: its copy too)
    with pytest.raises(ModelLoadError, match="by its first part"):
        ModelConfig.from_path(first.with_name(first.name.replace("-00001-", "-00002-")))


def test_a_moved_file_gets_a_card_of_its_own(checkpoints, tmp_path):
    (tmp_path / "a").mkdir()
    first = write_gguf(checkpoints["llama"], tmp_path / "a" / "m.gguf", T.F16)
    card = ModelConfig.from_path(first).path
    moved = first.rename(tmp_path / "m.gguf")
    assert ModelConfig.from_path(moved).path != card
    logits(moved)  # (it loads: its card names the file where it now is)
    with pytest.raises(ModelLoadError, match="--quantization q8_0 quantizes an HF checkpoint's"):
        check_quantization(ModelConfig.from_path(moved), "q8_0")  # (a GGUF is served in its own types)


def test_a_file_that_is_not_gguf_is_refused_and_leaves_no_card(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all" + bytes(64))
    with pytest.raises(ModelLoadError, match=r"broken\.gguf.*not a GGUF file"):
        ModelConfig.from_path(bad)
    with pytest.raises(ModelLoadError, match=r"GGUF file not found: .*missing\.gguf"):
        ModelConfig.from_path(tmp_path / "missing.gguf")
    assert not list(cache_dir().glob("gguf/*broken*"))
