"""Config validation (messages name the field) and every shipped preset composes and builds."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from model import (
    AttentionConfig,
    ConfigError,
    MLAConfig,
    ModelConfig,
    RopeConfig,
    Transformer,
    build_model,
)
from model.config import config_from_dict
from model.presets import load_preset, preset_dict, preset_names
from trainer.config import CONF_DIR, register_configs


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: AttentionConfig(n_heads=12, n_kv_heads=5),
            "model.attention.n_heads=12 is not divisible by model.attention.n_kv_heads=5",
        ),
        (
            lambda: ModelConfig(d_model=66, attention=AttentionConfig(n_heads=2)),
            r"head_dim=33 x model.rope.fraction=1.0 = 33 must be a positive even integer",
        ),
        (
            lambda: ModelConfig(
                d_model=64, attention=AttentionConfig(n_heads=4), rope=RopeConfig(fraction=0.3)
            ),
            "model.rope.fraction=0.3",
        ),
        (lambda: RopeConfig(fraction=1.5), r"model.rope.fraction=1.5 must be in \(0, 1\]"),
        (lambda: RopeConfig(fraction=0.0), "model.rope.fraction=0.0"),
        (
            lambda: ModelConfig(d_model=100, attention=AttentionConfig(n_heads=3)),
            "model.d_model=100 is not divisible by model.attention.n_heads=3",
        ),
        (
            lambda: ModelConfig(norm="batch"),
            "model.norm='batch' is not a known norm; choose one of: layer, rms",
        ),
        (lambda: ModelConfig(residual="sandwich"), "model.residual='sandwich'"),
        (
            lambda: ModelConfig(position="xpos"),
            "model.position='xpos' is not a known position encoding",
        ),
        (
            lambda: AttentionConfig(kind="flash"),
            "model.attention.kind='flash' is not a known attention kind; choose one of: gqa, mla",
        ),
        (lambda: RopeConfig(scaling="longrope"), "model.rope.scaling='longrope'"),
        (lambda: RopeConfig(pairing="zigzag"), "model.rope.pairing='zigzag'"),
        (lambda: ModelConfig(ffn=dict_ffn("swish")), "model.ffn.kind='swish'"),
        (lambda: RopeConfig(scaling="yarn", factor=0.5), "model.rope.factor=0.5 must be >= 1"),
        (
            lambda: MLAConfig(qk_rope_head_dim=7),
            "model.attention.mla.qk_rope_head_dim=7 must be even",
        ),
        (
            lambda: ModelConfig(position="alibi", attention=AttentionConfig(kind="mla")),
            "MLA uses decoupled RoPE",
        ),
        (
            lambda: AttentionConfig(kind="mla", qk_norm=True),
            "qk_norm=true is not supported with attention.kind='mla'",
        ),
        (lambda: ModelConfig(n_layers=0), "model.n_layers=0 must be > 0"),
        (
            lambda: ModelConfig(
                d_model=8,
                attention=AttentionConfig(n_heads=4),
                rope=RopeConfig(scaling="ntk", factor=2.0),
            ),
            "model.rope.scaling='ntk' needs more than 2 rotary dims",
        ),
    ],
)
def test_bad_configs_fail_at_construction_naming_the_field(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def dict_ffn(kind):
    return config_from_dict(__import__("model").FFNConfig, {"kind": kind}, "model.ffn")


def test_config_from_dict_rejects_unknown_keys_with_a_suggestion():
    with pytest.raises(
        ConfigError, match=r"model.attention.n_head is not a known key; did you mean 'n_heads'"
    ):
        config_from_dict(ModelConfig, {"attention": {"n_head": 4}})


def test_config_from_dict_rejects_wrong_types():
    with pytest.raises(ConfigError, match="model.n_layers='four' must be of type int"):
        config_from_dict(ModelConfig, {"n_layers": "four"})
    with pytest.raises(ConfigError, match="model.tie_embeddings=1 must be of type bool"):
        config_from_dict(ModelConfig, {"tie_embeddings": 1})


def test_model_without_a_vocabulary_says_how_to_set_it():
    with pytest.raises(ConfigError, match="model.vocab_size=0: set it"):
        Transformer(ModelConfig())


def _hydra_model_config(name: str) -> ModelConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=[f"model={name}"])
    return OmegaConf.to_object(cfg).model


def test_the_shipped_presets_are_the_expected_ones():
    assert {
        "tiny",
        "tiny_mla",
        "llama2_7b",
        "llama2_70b",
        "llama3_8b",
        "llama3_70b",
        "deepseek_v3",
        "qwen3_0_6b",
    } <= set(preset_names())


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_composes_with_hydra_and_builds(name):
    cfg = _hydra_model_config(name)
    assert cfg == load_preset(name)  # the Hydra path and model.inspect's loader agree
    params = sum(
        p.numel() for p in preset_dict(name) and build_model(cfg, device="meta").parameters()
    )
    assert params > 0
    if params < 50_000_000:  # small presets also run a real forward/backward on CPU
        model = build_model(cfg)
        tokens, targets = torch.randint(0, cfg.vocab_size, (2, 2, 16))
        loss = model(tokens, targets)
        loss.backward()
        assert (
            torch.isfinite(loss)
            and abs(loss.item() - torch.log(torch.tensor(cfg.vocab_size)).item()) < 1.0
        )


def test_hydra_rejects_unknown_and_mistyped_keys():
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        with pytest.raises(Exception, match="n_head"):
            compose(config_name="config", overrides=["model.attention.n_head=3"])
        with pytest.raises(Exception, match="n_layers"):
            compose(config_name="config", overrides=["model.n_layers=many"])


def test_preset_overrides_apply_and_validate():
    cfg = load_preset("llama3_8b", {"attention.n_kv_heads": 1, "n_layers": 2})
    assert cfg.n_kv_heads == 1 and cfg.n_layers == 2
    with pytest.raises(ConfigError, match="not divisible"):
        load_preset("llama3_8b", {"attention.n_kv_heads": 5})
    with pytest.raises(ConfigError, match="model='llama5' is not a preset"):
        load_preset("llama5")
