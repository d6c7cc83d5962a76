"""Encoders for pooling (issue 52), in-process: a tiny random BERT, RoBERTa, XLM-R and MPNet that HF builds and saves,
against HF's own forward
(with padding and an attention mask: HF's batched path), each pooling type against its formula over HF's hidden
states, normalized or not; batch invariance on the native kernels; sentence-transformers' files read as it reads
them; a checkpoint's head skipped by name, a tensor of a wrong shape refused by name."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from gpu.kernels import native
from gpu.layers.pooling import pool
from gpu.loading.encoder import load_encoder
from gpu.loading.encoder_config import EncoderConfig, Pooling, is_pooling_model
from gpu.loading.errors import ModelLoadError
from gpu.models.bert import relative_buckets

LENS = [1, 5, 17, 40]
FAMILIES = ["Bert", "Roberta", "XLMRoberta", "MPNet"]


def tiny_bert(path, head: str = "Model", family: str = "Bert", **overrides):
    """A tiny random `family`+`head` (HF's class, e.g. RobertaForSequenceClassification) saved in `path`."""
    config = getattr(transformers, f"{family}Config")(vocab_size=120, hidden_size=32, intermediate_size=64,
                                                       num_hidden_layers=2, num_attention_heads=4,
                                                       max_position_embeddings=64, **overrides)  # fmt: skip
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}{head}")(config).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=FAMILIES)
def bert(tmp_path_factory, request):
    path = tmp_path_factory.mktemp(request.param)
    return path, tiny_bert(path, family=request.param)


def inputs(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 120, (n,), generator=g).tolist() for n in LENS]


def padded(model, ids: list[list[int]]) -> dict:
    """The inputs right-padded with the model's padding id in one batch, and the mask (HF's batched path)."""
    width, pad = max(map(len, ids)), model.config.pad_token_id
    return {"input_ids": torch.tensor([x + [pad] * (width - len(x)) for x in ids]),
            "attention_mask": torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])}  # fmt: skip


def hf_hidden(model, ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's last hidden states of the inputs in one padded batch, and the mask."""
    batch = padded(model, ids)
    with torch.no_grad():
        return model(**batch).last_hidden_state, batch["attention_mask"]


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_hidden_states_match_hfs_batched_forward(bert, kernels):
    if kernels == "native" and native.ops() is None:
        pytest.skip("the native kernels are not built")
    path, model = bert
    ids = inputs()
    ours = load_encoder(EncoderConfig.from_path(path), cpu_kernels=kernels)
    with torch.no_grad():
        got = ours(torch.tensor([t for x in ids for t in x]), LENS).split(LENS)
    ref, _ = hf_hidden(model, ids)
    for i, n in enumerate(LENS):
        torch.testing.assert_close(got[i], ref[i, :n], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("pooling_type", ["CLS", "MEAN", "MAX", "LAST"])
@pytest.mark.parametrize("normalize", [False, True])
def test_each_pooling_is_its_formula_over_hfs_states(bert, pooling_type, normalize):
    path, model = bert
    ids = inputs(2)
    ours = load_encoder(EncoderConfig.from_path(path))
    with torch.no_grad():
        got = pool(ours(torch.tensor([t for x in ids for t in x]), LENS), LENS, pooling_type, normalize)
    h, mask = hf_hidden(model, ids)
    m = mask.unsqueeze(-1).bool()
    ref = {
        "CLS": h[:, 0],
        "MEAN": (h * m).sum(1) / m.sum(1),
        "MAX": h.masked_fill(~m, float("-inf")).max(1).values,
        "LAST": h[torch.arange(len(LENS)), torch.tensor(LENS) - 1],
    }[pooling_type]
    if normalize:
        ref = ref / ref.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_an_inputs_embedding_is_the_same_bits_alone_or_in_any_batch(bert):
    if native.ops() is None:
        pytest.skip("the native kernels are not built")
    path, _ = bert
    ours = load_encoder(EncoderConfig.from_path(path))
    ids = inputs(3)
    with torch.no_grad():
        together = pool(ours(torch.tensor([t for x in ids for t in x]), LENS), LENS, "MEAN", True)
        for i, x in enumerate(ids):
            alone = pool(ours(torch.tensor(x), [len(x)]), [len(x)], "MEAN", True)
            assert torch.equal(alone[0], together[i]), i


@pytest.mark.parametrize("family", ["Bert", "MPNet"])
def test_a_checkpoints_head_is_skipped_and_a_wrong_shape_refused_by_name(tmp_path, family):
    tiny_bert(tmp_path / "mlm", head="ForMaskedLM", family=family)
    assert is_pooling_model(tmp_path / "mlm")
    load_encoder(EncoderConfig.from_path(tmp_path / "mlm"))  # (cls.predictions.* or lm_head.* skipped, renamed)
    tiny_bert(tmp_path / "bad")
    config = json.loads((tmp_path / "bad" / "config.json").read_text())
    (tmp_path / "bad" / "config.json").write_text(json.dumps(config | {"intermediate_size": 48}))
    with pytest.raises(ModelLoadError, match=r"intermediate\.dense\.\w+ has shape"):
        load_encoder(EncoderConfig.from_path(tmp_path / "bad"))


def test_sentence_transformers_files_and_pooler_config_say_how_to_pool(tmp_path):
    tiny_bert(tmp_path)
    assert EncoderConfig.from_path(tmp_path).pooling == Pooling("CLS", True)  # (no sentence-transformers files)
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]))  # fmt: skip
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 16}))
    c = EncoderConfig.from_path(tmp_path)
    assert (c.pooling, c.max_model_len, c.dimensions) == (Pooling("MAX", False), 16, ())
    assert EncoderConfig.from_path(tmp_path, '{"pooling_type": "mean"}').pooling == Pooling("MEAN", False)
    for bad, says in [('{"pooling_type": "SUM"}', "SUM"), ('{"dims": 3}', "unknown"), ("[1]", "JSON object")]:
        with pytest.raises(ModelLoadError, match=says):
            EncoderConfig.from_path(tmp_path, bad)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"matryoshka_dimensions": [16, 8, 32]}))
    assert EncoderConfig.from_path(tmp_path).dimensions == (8, 16, 32)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("labels", [1, 3])
def test_a_cross_encoders_logits_are_hfs(tmp_path, family, labels):
    """BERT's pooler and classifier, RoBERTa's and MPNet's classifier head (dense, tanh, out_proj), with a pair's
    segments (MPNet has none)."""
    segmented = family != "MPNet"
    model = tiny_bert(tmp_path, "ForSequenceClassification", family, num_labels=labels,
                      **({"type_vocab_size": 2} if segmented else {}))  # fmt: skip
    config = EncoderConfig.from_path(tmp_path)
    assert len(config.labels) == labels and config.score_sigmoid == (labels == 1)
    ours = load_encoder(config)
    ids = inputs(4)
    types = [[0] * (n // 2) + [1] * (n - n // 2) for n in LENS]
    width = max(LENS)
    batch = padded(model, ids)
    if segmented:
        batch["token_type_ids"] = torch.tensor([t + [0] * (width - len(t)) for t in types])
    with torch.no_grad():
        ref = model(**batch).logits
        flat, segments = torch.tensor([t for x in ids for t in x]), torch.tensor([t for x in types for t in x])
        got = ours.classify(ours(flat, LENS, segments if segmented else None), LENS)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    identity = {"activation_fn": "torch.nn.modules.linear.Identity"}  # (sentence-transformers 6 saves it here)
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps(identity))
    assert not EncoderConfig.from_path(tmp_path).score_sigmoid


def test_sentence_transformers_6_files_are_read_and_other_modules_refused(tmp_path):
    tiny_bert(tmp_path)
    (tmp_path / "modules.json").write_text(
        json.dumps(
            [
                {
                    "idx": 0,
                    "name": "0",
                    "path": "",
                    "type": "sentence_transformers.base.modules.transformer.Transformer",
                },
                {
                    "idx": 1,
                    "name": "1",
                    "path": "1_Pooling",
                    "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
                },
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.base.modules.normalize.Normalize",
                },
            ]
        )
    )  # fmt: skip  (sentence-transformers 6.3's save: the pooling named, the length the tokenizer's)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "lasttoken"}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 24}))
    c = EncoderConfig.from_path(tmp_path)
    assert (c.pooling, c.max_model_len) == (Pooling("LAST", True), 24)
    for pooling in ({"pooling_mode": ["mean", "max"]}, {"pooling_mode": "weightedmean"},
                    {"pooling_mode_mean_tokens": True, "pooling_mode_weightedmean_tokens": True}):  # fmt: skip
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
        with pytest.raises(ModelLoadError, match="pooling"):
            EncoderConfig.from_path(tmp_path)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "cls"}))
    modules = json.loads((tmp_path / "modules.json").read_text())
    dense = {"idx": 3, "name": "3", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    (tmp_path / "modules.json").write_text(json.dumps([*modules, dense]))
    with pytest.raises(ModelLoadError, match="Dense"):
        EncoderConfig.from_path(tmp_path)


def test_mpnets_relative_buckets_are_hfs_past_its_max_distance():
    """Every offset of a 300-token input (max_distance 128: the log-spaced buckets and the last one), against HF's."""
    offsets = torch.arange(300)[None, :] - torch.arange(300)[:, None]
    ref = transformers.models.mpnet.modeling_mpnet.MPNetEncoder.relative_position_bucket(offsets)
    assert torch.equal(relative_buckets(offsets), ref)


def test_a_pairs_segments_are_taken_for_a_model_without_them(tmp_path):
    """MPNet's tokenizer gives a pair's second text segment 1, and MPNet has no segments (HF's takes none): the
    pooler's check takes them, where a BERT of one segment refuses segment 1."""
    from types import SimpleNamespace

    from actors.pooler.actor import PoolerActor
    from messages.pooling import PoolRequest

    msg = PoolRequest(request_id="r", inputs=[[5, 6, 7]], token_type_ids=[[0, 1, 1]])
    for family, refused in (("MPNet", False), ("Bert", True)):
        tiny_bert(tmp_path / family, "ForSequenceClassification", family, **({"type_vocab_size": 1} if refused else {}))
        pooler = SimpleNamespace(model_config=EncoderConfig.from_path(tmp_path / family), max_model_len=64)
        assert (PoolerActor._invalid(pooler, msg) is not None) == refused, family
