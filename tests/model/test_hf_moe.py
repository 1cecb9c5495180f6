"""Hugging Face interop of the softmax-attention MoE families: Qwen3-MoE (QK-norm, optional
dense first layers, optional renormalized top-k) and Mixtral (renormalized top-k in every layer).

Both directions against transformers' own classes, fp32 logits within 2e-5: ours -> save_hf ->
AutoModelForCausalLM, and a random transformers model -> save_pretrained -> load_hf (and back
out); bitwise weight round trips with the same config; errors naming the option."""

from __future__ import annotations

import json

import pytest
import torch

from model import (
    AttentionConfig,
    ConfigError,
    FFNConfig,
    InitConfig,
    ModelConfig,
    MoEConfig,
    RopeConfig,
)
from model.hf import config_from_hf, hf_config, load_hf, save_hf
from model.transformer import build_model
from tests.model.hf_helpers import perturbed, token_batch, transformers_model

transformers = pytest.importorskip("transformers")

ATOL = 2e-5
VOCAB, SEQ = 97, 30
GQA = AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=16)
BASE = dict(vocab_size=VOCAB, d_model=64, n_layers=3, attention=GQA, init=InitConfig(std=0.1))
BASE |= dict(ffn=FFNConfig(hidden=48), norm_eps=1e-6)
MOE = dict(n_routed_experts=4, top_k=2, expert_hidden=16)

CASES = {
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        ModelConfig(
            **BASE | {"attention": AttentionConfig(**{**vars(GQA), "qk_norm": True})},
            moe=MoEConfig(**MOE, first_k_dense=1, norm_topk_prob=False, aux_loss_coef=0.01),
        ),
    ),
    "qwen3_moe_interleaved_tied_biased": (
        "Qwen3MoeForCausalLM",
        ModelConfig(
            **BASE
            | {
                "attention": AttentionConfig(**{**vars(GQA), "qk_norm": True, "bias": True}),
                "rope": RopeConfig(pairing="interleaved", theta=1e6),
            },
            moe=MoEConfig(**MOE),
            tie_embeddings=True,
        ),
    ),
    "mixtral": ("MixtralForCausalLM", ModelConfig(**BASE, moe=MoEConfig(**MOE | {"top_k": 3}))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_exported_models_give_transformers_our_logits(name, tmp_path):
    architecture, cfg = CASES[name]
    model = perturbed(cfg)
    save_hf(model, tmp_path / "hf")
    theirs = transformers_model(tmp_path / "hf")
    assert type(theirs).__name__ == architecture
    with torch.no_grad():
        ours, ref = model(token_batch(VOCAB, SEQ)), theirs(token_batch(VOCAB, SEQ)).logits
    assert ref.abs().max() > 1.0  # not a comparison of near-zero logits
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_is_bitwise_and_keeps_the_config(name, tmp_path):
    _, cfg = CASES[name]
    model = perturbed(cfg, seed=2)
    save_hf(model, tmp_path / "hf")
    back = load_hf(tmp_path / "hf", rope_pairing=cfg.rope.pairing)
    ours, theirs = model.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    assert hf_config(back.cfg) == hf_config(cfg)
    assert config_from_hf(hf_config(cfg), cfg.rope.pairing) == back.cfg  # ours -> HF -> ours
    assert back.cfg.moe == cfg.moe and back.cfg.attention == cfg.attention


def _hf_random(cls, config, seed: int = 3):
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # every tensor off its initial value (the norms' ones included)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


HF_MODELS = {
    "qwen3_moe": lambda: (
        transformers.Qwen3MoeForCausalLM,
        transformers.Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[0],
            norm_topk_prob=True,
        ),
    ),
    "mixtral": lambda: (
        transformers.MixtralForCausalLM,
        transformers.MixtralConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
            num_experts_per_tok=2, pad_token_id=None, bos_token_id=None, eos_token_id=None,
        ),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(HF_MODELS))
def test_imported_transformers_models_give_their_logits(name, tmp_path):
    cls, config = HF_MODELS[name]()
    theirs = _hf_random(cls, config)
    theirs.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf").eval()
    with torch.no_grad():
        ref, got = theirs(token_batch(VOCAB, SEQ)).logits, ours(token_batch(VOCAB, SEQ))
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    save_hf(ours, tmp_path / "again")  # and back out, with the same logits
    with torch.no_grad():
        torch.testing.assert_close(
            transformers_model(tmp_path / "again")(token_batch(VOCAB, SEQ)).logits,
            ref,
            atol=ATOL,
            rtol=0,
        )


@pytest.mark.parametrize(
    ("name", "overrides", "option"),
    [
        ("qwen3_moe", {"n_shared_experts": 1}, "moe.n_shared_experts=1"),
        ("qwen3_moe", {"score_func": "sigmoid"}, "moe.score_func='sigmoid'"),
        ("qwen3_moe", {"bias_update_rate": 1e-3}, "moe.bias_update_rate>0"),
        ("qwen3_moe", {"capacity_factor": 1.25}, "moe.capacity_factor=1.25"),
        ("mixtral", {"first_k_dense": 1}, "moe.first_k_dense=1"),
        ("mixtral", {"norm_topk_prob": False}, "moe.norm_topk_prob=false"),
    ],
)
def test_export_names_the_option_it_cannot_express(name, overrides, option, tmp_path):
    _, cfg = CASES[name]
    moe = MoEConfig(**{**vars(cfg.moe), **overrides})
    model = build_model(ModelConfig(**{**vars(cfg), "moe": moe}))
    with pytest.raises(ConfigError, match=f"model.{option}.* has no"):
        save_hf(model, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_a_moved_selection_bias_is_refused(tmp_path):
    model = build_model(CASES["mixtral"][1])
    with torch.no_grad():
        model.layers["1"].ffn.router.expert_bias.fill_(0.5)
    with pytest.raises(ConfigError, match="expert_bias .* is not zero"):
        save_hf(model, tmp_path / "hf")


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step=2 is not supported"),
        ("qwen3_moe", {"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\] is not supported"),
        ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 8}, "sliding_window=8"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 is not supported"),
    ],
)
def test_import_refuses_settings_it_cannot_represent(name, change, message, tmp_path):
    save_hf(build_model(CASES[name][1]), tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text()) | change
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        load_hf(tmp_path / "hf")


PUBLISHED = {  # preset: (transformers config of the release, published total, active)
    "qwen3_30b_a3b": (
        lambda: transformers.Qwen3MoeConfig(  # Qwen/Qwen3-30B-A3B config.json
            vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
            num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
            num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
            max_position_embeddings=40960, rope_parameters={"rope_type": "default",
            "rope_theta": 1e6}, tie_word_embeddings=False,
        ),
        30.5e9,
        3.3e9,
    ),
    "mixtral_8x7b": (
        lambda: transformers.MixtralConfig(  # mistralai/Mixtral-8x7B-v0.1 config.json
            max_position_embeddings=32768, router_aux_loss_coef=0.02,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
        46.7e9,
        12.9e9,
    ),
}  # fmt: skip


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_presets_have_the_published_sizes_and_export_the_release_config(preset):
    """Exactly transformers' parameter count for the release config, the published total (to
    1%) and active (to 2%: the model cards round them) counts, and the release's config.json
    imports as the preset."""
    from model.accounting import param_counts
    from model.presets import load_preset

    make_config, total, active = PUBLISHED[preset]
    cfg = load_preset(preset)
    counts = param_counts(build_model(cfg, device="meta"))
    hf = make_config()
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(hf)
    assert counts.total == sum(p.numel() for p in reference.parameters())
    assert abs(counts.total - total) / total < 0.01
    assert abs(counts.active - active) / active < 0.02  # (3.35B: "3.3B" rounded)
    imported = config_from_hf(hf.to_dict())
    assert imported.moe == cfg.moe and imported.attention == cfg.attention
    assert hf_config(imported)["architectures"] == hf_config(cfg)["architectures"]
