"""Hugging Face interop: logits parity with transformers (fp32, 1e-5), bitwise round trips, errors."""

from __future__ import annotations

import json

import pytest
import torch

from model import (
    AttentionConfig,
    ConfigError,
    FFNConfig,
    InitConfig,
    MLAConfig,
    ModelConfig,
    RopeConfig,
    Transformer,
)
from model.hf import hf_config, load_hf, save_hf

transformers = pytest.importorskip("transformers")

PARITY_ATOL = 1e-5  # fp32 logits of magnitude ~3; observed differences are ~2e-6
VOCAB, SEQ = 97, 40


def _config(attention: AttentionConfig, **kw) -> ModelConfig:
    base = dict(vocab_size=VOCAB, d_model=64, n_layers=2, max_seq_len=128, init=InitConfig(std=0.1))
    return ModelConfig(attention=attention, **{**base, **kw})


CASES = {
    "mha_untied": _config(AttentionConfig(n_heads=4)),
    "gqa_untied": _config(AttentionConfig(n_heads=4, n_kv_heads=2)),
    "mqa_tied": _config(AttentionConfig(n_heads=4, n_kv_heads=1), tie_embeddings=True),
    "gqa_tied_interleaved": _config(
        AttentionConfig(n_heads=4, n_kv_heads=2),
        tie_embeddings=True,
        rope=RopeConfig(pairing="interleaved"),
    ),
    "qwen3_qk_norm": _config(
        AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=32, qk_norm=True), tie_embeddings=True
    ),
    "qwen3_interleaved_bias": _config(
        AttentionConfig(n_heads=4, n_kv_heads=2, qk_norm=True, bias=True),
        rope=RopeConfig(pairing="interleaved"),
    ),
    "llama_biases": _config(
        AttentionConfig(n_heads=4, bias=True), ffn=FFNConfig(bias=True, multiple_of=32)
    ),
    "rope_linear": _config(
        AttentionConfig(n_heads=4), rope=RopeConfig(theta=5e5, scaling="linear", factor=4.0)
    ),
    "rope_yarn": _config(
        AttentionConfig(n_heads=4, n_kv_heads=2),
        rope=RopeConfig(scaling="yarn", factor=4.0, original_max_seq_len=16),
    ),
    "rope_llama3": _config(
        AttentionConfig(n_heads=4, n_kv_heads=2),
        rope=RopeConfig(theta=5e5, scaling="llama3", factor=8.0, original_max_seq_len=16),
    ),
    "rope_dynamic": _config(
        AttentionConfig(n_heads=4),
        rope=RopeConfig(scaling="dynamic_ntk", factor=2.0, original_max_seq_len=64),
    ),
}


def _hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    )


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(name, tmp_path):
    torch.manual_seed(0)
    model = Transformer(CASES[name]).eval()
    save_hf(model, tmp_path / "hf")
    theirs = _hf_model(tmp_path / "hf").eval()
    expected_arch = "Qwen3ForCausalLM" if model.cfg.attention.qk_norm else "LlamaForCausalLM"
    assert type(theirs).__name__ == expected_arch
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    with torch.no_grad():
        ours, ref = model(tokens), theirs(tokens).logits
    assert ref.abs().max() > 1.0  # the comparison is not between near-zero logits
    torch.testing.assert_close(ours, ref, atol=PARITY_ATOL, rtol=0)


@pytest.mark.parametrize(
    "name",
    ["gqa_untied", "gqa_tied_interleaved", "qwen3_interleaved_bias", "rope_yarn", "rope_dynamic"],
)
def test_export_import_round_trip_is_bitwise(name, tmp_path):
    torch.manual_seed(1)
    model = Transformer(CASES[name])
    save_hf(model, tmp_path / "hf")
    back = load_hf(tmp_path / "hf", rope_pairing=model.cfg.rope.pairing)
    ours, theirs = model.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    assert hf_config(back.cfg) == hf_config(model.cfg)
    tokens = torch.randint(0, VOCAB, (1, 16))
    assert torch.equal(model(tokens), back(tokens))


def test_interleaved_model_imported_in_half_layout_is_equivalent(tmp_path):
    torch.manual_seed(2)
    model = Transformer(CASES["gqa_tied_interleaved"])
    save_hf(model, tmp_path / "hf")
    half = load_hf(tmp_path / "hf")  # HF layout, half-split pairing
    assert half.cfg.rope.pairing == "half"
    assert not torch.equal(
        half.layers["0"].attn.q_proj.weight, model.layers["0"].attn.q_proj.weight
    )
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    torch.testing.assert_close(half(tokens), model(tokens), atol=1e-5, rtol=0)


def test_sharded_export_writes_an_index_and_loads(tmp_path):
    torch.manual_seed(3)
    model = Transformer(CASES["gqa_untied"])
    save_hf(model, tmp_path / "hf", max_shard_bytes=40_000, dtype=torch.bfloat16)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2 and all((tmp_path / "hf" / f).is_file() for f in files)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = load_hf(tmp_path / "hf")
    assert back.embed.weight.dtype == torch.bfloat16
    assert torch.equal(back.embed.weight, model.embed.weight.to(torch.bfloat16))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(theirs.model.embed_tokens.weight, back.embed.weight)


def test_export_refuses_to_overwrite_and_leaves_no_partial_directory(tmp_path):
    model = Transformer(CASES["mha_untied"])
    save_hf(model, tmp_path / "hf")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_hf(model, tmp_path / "hf")
    save_hf(model, tmp_path / "hf", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary leftovers


@pytest.mark.parametrize(
    ("overrides", "option"),
    [
        (  # MLA NoPE outside a Kimi Linear hybrid (MLA with RoPE exports as DeepSeek-V3)
            dict(attention=AttentionConfig(kind="mla", n_heads=4, mla=MLAConfig(nope=True))),
            "attention.kind='mla'",
        ),
        (dict(position="alibi"), "position='alibi'"),
        (dict(residual="deepnorm"), "residual='deepnorm'"),
        (dict(norm="layer"), "norm='layer'"),
        (dict(ffn=FFNConfig(kind="gelu")), "ffn.kind='gelu'"),
        (dict(attention=AttentionConfig(n_heads=4, output_gate=True)), "attention.output_gate"),
        (
            dict(attention=AttentionConfig(n_heads=4, sliding_window=8)),
            "attention.sliding_window=8",
        ),
        (dict(rope=RopeConfig(fraction=0.5)), "rope.fraction=0.5"),
        (dict(rope=RopeConfig(scaling="ntk", factor=2.0)), "rope.scaling='ntk'"),
        (
            dict(rope=RopeConfig(scaling="yarn", factor=4.0, mscale=1.0, mscale_all_dim=1.0)),
            "rope.mscale_all_dim=1.0",
        ),
    ],
)
def test_unsupported_options_name_themselves(overrides, option, tmp_path):
    cfg = ModelConfig(
        **{
            **dict(vocab_size=VOCAB, d_model=64, n_layers=1, attention=AttentionConfig(n_heads=4)),
            **overrides,
        }
    )
    with pytest.raises(ConfigError, match="no Llama/Qwen3 equivalent") as err:
        save_hf(Transformer(cfg), tmp_path / "hf")
    assert option in str(err.value)
    assert not (tmp_path / "hf").exists()


def test_two_rotary_dims_export_without_error(tmp_path):
    cfg = ModelConfig(vocab_size=VOCAB, d_model=8, n_layers=1, attention=AttentionConfig(n_heads=4))
    assert cfg.rotary_dim == 2
    save_hf(Transformer(cfg), tmp_path / "hf")
    assert load_hf(tmp_path / "hf").cfg.head_dim == 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"use_sliding_window": True}, "sliding-window layers"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": False}},
            "rope parameter truncate=False",
        ),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_type='longrope'"),
    ],
)
def test_import_refuses_settings_it_would_drop(change, message, tmp_path):
    torch.manual_seed(4)
    save_hf(Transformer(CASES["gqa_untied"]), tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError, match=message):
        load_hf(tmp_path / "hf")


def test_import_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="model_type='gpt2'"):
        load_hf(tmp_path)


def test_a_family_is_an_adapter_file_registered_by_name(tmp_path):
    """Families come from the HF_FAMILIES registry: a new adapter (here a Llama clone under
    another model_type) is found for import and export without touching the others."""
    from model.hf import HF_FAMILIES, config_from_hf
    from model.hf.llama import Llama

    class Clone(Llama):
        model_types = ("llama_clone",)

        def claims(self, cfg):
            return False  # export keeps choosing the real Llama adapter

    HF_FAMILIES.register("llama_clone")(Clone)
    try:
        cfg = ModelConfig(
            vocab_size=VOCAB, d_model=64, n_layers=1, attention=AttentionConfig(n_heads=4)
        )
        exported = hf_config(cfg)
        assert exported["model_type"] == "llama"
        imported = config_from_hf(exported | {"model_type": "llama_clone"})
        assert imported.d_model == 64 and imported.attention.n_heads == 4
        with pytest.raises(ConfigError, match="supported: .*llama, .*llama_clone"):
            config_from_hf(exported | {"model_type": "gpt2"})
    finally:
        HF_FAMILIES.remove("llama_clone")
