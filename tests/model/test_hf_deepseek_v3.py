"""Hugging Face interop of DeepSeek-V3: MLA (full-rank or low-rank queries, either RoPE pairing
through `rope_interleave`, YaRN with the softmax mscale), dense first layers, DeepSeekMoE (sigmoid
scores with a trained score-correction bias, group-limited top-k, scaled, shared experts) and
MTP modules in DeepSeek-V3's layout.

Both directions against transformers' DeepseekV3ForCausalLM, fp32 logits within 2e-5; bitwise
round trips with the same config; errors naming the option."""

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
    MoEConfig,
    RopeConfig,
)
from model.config import MTPConfig
from model.hf import config_from_hf, hf_config, load_hf, save_hf
from model.transformer import build_model
from tests.model.hf_helpers import perturbed, token_batch, transformers_model

transformers = pytest.importorskip("transformers")

ATOL = 2e-5
VOCAB, SEQ = 97, 30
MLA = MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
BASE = dict(vocab_size=VOCAB, d_model=64, n_layers=3, norm_eps=1e-6, init=InitConfig(std=0.1))
BASE |= dict(ffn=FFNConfig(hidden=48), max_seq_len=128)
MOE = MoEConfig(
    n_routed_experts=8, top_k=3, expert_hidden=16, n_shared_experts=1, score_func="sigmoid",
    route_scale=2.5, n_groups=4, topk_groups=2, first_k_dense=1,
)  # fmt: skip
YARN = RopeConfig(
    scaling="yarn", factor=4.0, original_max_seq_len=32, mscale=1.0, mscale_all_dim=1.0
)

CASES = {
    "moe_interleaved": ModelConfig(
        **BASE, attention=AttentionConfig(kind="mla", n_heads=4, mla=MLA), moe=MOE,
        rope=RopeConfig(pairing="interleaved"),
    ),
    "moe_low_rank_q_yarn_half_mtp": ModelConfig(
        **BASE,
        attention=AttentionConfig(
            kind="mla", n_heads=4, mla=MLAConfig(**{**vars(MLA), "q_lora_rank": 24})
        ),
        moe=MoEConfig(**{**vars(MOE), "n_shared_experts": 2, "n_groups": 1, "topk_groups": 1}),
        rope=YARN,
        mtp=MTPConfig(depth=1),
    ),
    "dense": ModelConfig(**BASE, attention=AttentionConfig(kind="mla", n_heads=4, mla=MLA)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_exported_models_give_transformers_our_logits(name, tmp_path):
    model = perturbed(CASES[name])
    save_hf(model, tmp_path / "hf")
    theirs = transformers_model(tmp_path / "hf")
    assert type(theirs).__name__ == "DeepseekV3ForCausalLM"
    with torch.no_grad():
        ours, ref = model(token_batch(VOCAB, SEQ)), theirs(token_batch(VOCAB, SEQ)).logits
    assert ref.abs().max() > 1.0  # not a comparison of near-zero logits
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_is_bitwise_and_keeps_the_config(name, tmp_path):
    cfg = CASES[name]
    model = perturbed(cfg, seed=2)
    save_hf(model, tmp_path / "hf")
    back = load_hf(tmp_path / "hf")  # the pairing comes from rope_interleave
    ours, theirs = model.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()  # MTP modules included
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    assert back.cfg == cfg
    assert config_from_hf(hf_config(cfg)) == cfg


def small_hf_config(interleave: bool):
    """A small DeepseekV3Config with every feature: dense first layer, groups, shared experts."""
    return transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        num_experts_per_tok=3, n_shared_experts=1, n_group=4, topk_group=2,
        first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, rope_interleave=interleave,
        max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip


def _hf_random(config, seed: int = 3):
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # every tensor off its initial value
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("interleave", [True, False])
def test_imported_transformers_models_give_their_logits(interleave, tmp_path):
    """A random DeepseekV3ForCausalLM (its save_pretrained keeps the default of 1 MTP layer in
    the config but writes no MTP weights: imported without MTP) -> load_hf -> the same logits,
    and back out."""
    theirs = _hf_random(small_hf_config(interleave))
    theirs.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf").eval()
    assert ours.cfg.mtp.depth == 0 and ours.cfg.rope.pairing == (
        "interleaved" if interleave else "half"
    )
    with torch.no_grad():
        ref, got = theirs(token_batch(VOCAB, SEQ)).logits, ours(token_batch(VOCAB, SEQ))
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    save_hf(ours, tmp_path / "again")
    with torch.no_grad():
        torch.testing.assert_close(
            transformers_model(tmp_path / "again")(token_batch(VOCAB, SEQ)).logits,
            ref,
            atol=ATOL,
            rtol=0,
        )


@pytest.mark.parametrize(
    ("change", "option"),
    [
        ({"moe": MoEConfig(**{**vars(MOE), "score_func": "softmax"})}, "moe.score_func"),
        ({"moe": MoEConfig(**{**vars(MOE), "n_shared_experts": 0})}, "moe.n_shared_experts=0"),
        ({"moe": MoEConfig(**{**vars(MOE), "shared_expert_gate": True})}, "moe.shared_expert_gate"),
        (
            {"attention": AttentionConfig(kind="mla", n_heads=4, mla=MLAConfig(**{**vars(MLA), "norm_eps": 1e-5}))},
            "attention.mla.norm_eps=1e-05",
        ),
        ({"norm": "layer"}, "norm='layer'"),
    ],
)  # fmt: skip
def test_export_names_the_option_it_cannot_express(change, option, tmp_path):
    cfg = ModelConfig(**{**vars(CASES["moe_interleaved"]), **change})
    with pytest.raises(ConfigError, match=f"model.{option}.* has no DeepseekV3ForCausalLM"):
        save_hf(build_model(cfg), tmp_path / "hf")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
        ({"topk_method": "greedy"}, "topk_method='greedy' is not supported"),
        ({"moe_layer_freq": 2}, "moe_layer_freq=2 is not supported"),
    ],
)
def test_import_refuses_settings_it_cannot_represent(change, message, tmp_path):
    save_hf(build_model(CASES["moe_interleaved"]), tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text()) | change
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        load_hf(tmp_path / "hf")


def test_the_preset_has_transformers_count_for_the_release_config():
    """deepseek_v3 against transformers' DeepseekV3Config defaults (the release's config.json:
    61 layers, 256 + 1 experts, YaRN factor 40), which transformers builds without the MTP
    module: the same parameters (671.0B), and the release's config imports as the preset."""
    from model.presets import load_preset

    cfg = load_preset("deepseek_v3")
    ours = build_model(cfg, device="meta")
    release = transformers.DeepseekV3Config(
        max_position_embeddings=163840,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
            "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0,
        },
    )  # fmt: skip
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(release)
    main = sum(p.numel() for n, p in ours.named_parameters() if not n.startswith("mtp."))
    assert main == sum(p.numel() for p in theirs.parameters())
    imported = config_from_hf(release.to_dict())
    assert imported.attention == cfg.attention and imported.rope == cfg.rope
    assert imported.moe.n_routed_experts == cfg.moe.n_routed_experts
    assert imported.layer_specs() == cfg.layer_specs()
