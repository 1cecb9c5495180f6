"""Hugging Face interop of the hybrid families: Qwen3-Next (GDN + gated attention + MoE with a
gated shared expert), Qwen3.5's text model (dense) and Kimi Linear (KDA + MLA NoPE + sigmoid MoE).

Both directions against transformers' own classes, fp32 logits within 2e-5 (observed ~5e-6; the
chunked delta rule sums in a different order): ours -> save_hf -> AutoModelForCausalLM, and a
randomly initialized transformers model -> save_pretrained -> load_hf. Plus bitwise weight round
trips, configs that round-trip, the published-size presets, and errors naming the option.

transformers dispatches its delta-rule functions to fla's Triton kernels when fla is importable
(no CPU backend), so these tests run only where fla is not installed.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from model import (
    AttentionConfig,
    ConfigError,
    FFNConfig,
    GDNConfig,
    InitConfig,
    KDAConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    RopeConfig,
)
from model.accounting import param_counts
from model.hf import config_from_hf, hf_config, load_hf, save_hf
from model.presets import load_preset
from model.transformer import build_model
from tests.model.hf_helpers import perturbed, token_batch, transformers_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("fla") is not None,
    reason="transformers dispatches to fla's Triton kernels when fla is importable (no CPU backend)",
)

ATOL = 2e-5
VOCAB, SEQ = 97, 30

GATED = AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=16, output_gate=True, qk_norm=True)
GDN = GDNConfig(n_heads=2, n_v_heads=4, head_dim=16, v_head_dim=8, chunk_size=8)
QWEN = dict(
    vocab_size=VOCAB,
    d_model=64,
    n_layers=4,
    layer_pattern=["gdn", "gdn", "gdn", "gqa"],
    gdn=GDN,
    attention=GATED,
    rope=RopeConfig(fraction=0.5),
    norm_eps=1e-6,
    ffn=FFNConfig(hidden=48),
    init=InitConfig(std=0.1),
)
QWEN_MOE = MoEConfig(
    n_routed_experts=4,
    top_k=2,
    n_shared_experts=1,
    expert_hidden=16,
    shared_expert_gate=True,
    first_k_dense=1,
)
MLA = AttentionConfig(
    kind="mla",
    n_heads=4,
    mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, nope=True),
)
KIMI = dict(
    vocab_size=VOCAB,
    d_model=64,
    n_layers=5,
    layer_types=["kda", "kda", "kda", "mla", "mla"],
    kda=KDAConfig(n_heads=2, head_dim=16, chunk_size=8),
    attention=MLA,
    position="none",
    norm_eps=1e-6,
    ffn=FFNConfig(hidden=48),
    init=InitConfig(std=0.1),
)
KIMI_MOE = MoEConfig(
    n_routed_experts=4,
    top_k=2,
    n_shared_experts=1,
    expert_hidden=16,
    first_k_dense=1,
    score_func="sigmoid",
    route_scale=2.4,
)

CASES = {
    "qwen3_next_moe": ("Qwen3NextForCausalLM", ModelConfig(**QWEN, moe=QWEN_MOE)),
    "qwen3_next_interleaved_bias": (
        "Qwen3NextForCausalLM",
        ModelConfig(
            **QWEN
            | {
                "rope": RopeConfig(fraction=0.5, pairing="interleaved"),
                "attention": AttentionConfig(**{**vars(GATED), "bias": True}),
            },
            moe=QWEN_MOE,
        ),
    ),
    "qwen3_5_dense_tied": ("Qwen3_5ForCausalLM", ModelConfig(**QWEN, tie_embeddings=True)),
    "kimi_linear_moe": ("KimiLinearForCausalLM", ModelConfig(**KIMI, moe=KIMI_MOE)),
    "kimi_linear_dense_low_rank_q": (
        "KimiLinearForCausalLM",
        ModelConfig(
            **KIMI
            | {
                "attention": AttentionConfig(
                    kind="mla",
                    n_heads=4,
                    bias=True,
                    mla=MLAConfig(**{**vars(MLA.mla), "q_lora_rank": 12}),
                )
            }
        ),
    ),
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
    assert back.cfg.layer_specs() == cfg.layer_specs()
    assert hf_config(back.cfg) == hf_config(cfg)
    with torch.no_grad():  # the chunk size is not part of the checkpoint: equal, not bitwise
        torch.testing.assert_close(
            back(token_batch(VOCAB, SEQ)), model(token_batch(VOCAB, SEQ)), atol=1e-5, rtol=0
        )


def _hf_random(cls, config, seed: int = 3):
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # move every tensor off its initial value (zero-centred norms included)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    return model


HF_MODELS = {
    "qwen3_next": lambda: (
        transformers.Qwen3NextForCausalLM,
        transformers.Qwen3NextConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=48,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            mlp_only_layers=[0],
        ),
    ),
    "qwen3_5_text": lambda: (
        transformers.Qwen3_5ForCausalLM,
        transformers.Qwen3_5TextConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=48,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=16,
        ),
    ),
    "kimi_linear": lambda: (
        transformers.KimiLinearForCausalLM,
        transformers.KimiLinearConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=48,
            num_hidden_layers=5,
            num_attention_heads=4,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            rms_norm_eps=1e-5,  # the release's; its MLA latent norms keep 1e-6 (mla.norm_eps)
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
            linear_attn_config={  # 1-indexed, as checkpoints list them
                "num_heads": 2,
                "head_dim": 16,
                "short_conv_kernel_size": 4,
                "kda_layers": [1, 2, 4],
                "full_attn_layers": [3, 5],
            },
        ),
    ),
}


@pytest.mark.parametrize("name", list(HF_MODELS))
def test_imported_transformers_models_give_their_logits(name, tmp_path):
    cls, config = HF_MODELS[name]()
    theirs = _hf_random(cls, config)
    theirs.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf").eval()
    with torch.no_grad():
        ref, got = theirs(token_batch(VOCAB, SEQ)).logits, ours(token_batch(VOCAB, SEQ))
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    if name == "kimi_linear":
        assert ours.cfg.mixer_kinds() == ["kda", "kda", "mla", "kda", "mla"]
    # and back: our export of the imported model loads into transformers with the same logits
    save_hf(ours, tmp_path / "again")
    with torch.no_grad():
        torch.testing.assert_close(
            transformers_model(tmp_path / "again")(token_batch(VOCAB, SEQ)).logits,
            ref,
            atol=ATOL,
            rtol=0,
        )


def test_a_multimodal_qwen3_5_directory_imports_its_text_model(tmp_path):
    """Qwen3.5 checkpoints are Qwen3_5ForConditionalGeneration: the text model's weights are under
    model.language_model, beside a vision tower and MTP weights that the text model ignores."""
    from safetensors.torch import load_file, save_file

    cls, config = HF_MODELS["qwen3_5_text"]()
    theirs = _hf_random(cls, config)
    theirs.save_pretrained(tmp_path / "text")
    state = load_file(tmp_path / "text" / "model.safetensors")
    wrapped = {k.replace("model.", "model.language_model.", 1): v for k, v in state.items()}
    wrapped |= {
        "model.visual.patch_embed.proj.weight": torch.zeros(2, 3),
        "mtp.fc.weight": torch.zeros(2, 2),
    }
    (tmp_path / "mm").mkdir()
    save_file(wrapped, tmp_path / "mm" / "model.safetensors")
    text_config = json.loads((tmp_path / "text" / "config.json").read_text())
    mm = {"model_type": "qwen3_5", "text_config": text_config, "tie_word_embeddings": False}
    (tmp_path / "mm" / "config.json").write_text(json.dumps(mm))
    ours = load_hf(tmp_path / "mm").eval()
    with torch.no_grad():
        torch.testing.assert_close(
            ours(token_batch(VOCAB, SEQ)), theirs(token_batch(VOCAB, SEQ)).logits, atol=ATOL, rtol=0
        )


@pytest.mark.parametrize(
    ("preset", "overrides"),
    [("tiny_kda", {}), ("tiny_hybrid", {"attention.qk_norm": True})],  # tiny_hybrid: QK-clip-able
)
def test_the_tiny_hybrid_presets_export_with_their_logits(preset, overrides, tmp_path):
    model = build_model(load_preset(preset, overrides), seed=0).eval()
    save_hf(model, tmp_path / "hf")
    tokens = torch.randint(
        0, model.cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(5)
    )
    with torch.no_grad():
        ours, ref = model(tokens), transformers_model(tmp_path / "hf")(tokens).logits
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


# ---- published sizes ----------------------------------------------------------------------------

PUBLISHED = {  # preset: (transformers config of the release, published total, published active)
    "qwen3_next_80b_a3b": (
        lambda: transformers.Qwen3NextConfig(  # Qwen/Qwen3-Next-80B-A3B-Instruct config.json
            intermediate_size=5120,
            max_position_embeddings=262144,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e7,
                "partial_rotary_factor": 0.25,
            },
        ),
        80e9,
        3e9,
    ),
    "kimi_linear_48b_a3b": (
        lambda: (
            transformers.KimiLinearConfig(  # moonshotai/Kimi-Linear-48B-A3B-Instruct config.json
                linear_attn_config={
                    "num_heads": 32,
                    "head_dim": 128,
                    "short_conv_kernel_size": 4,
                    "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                    "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
                }
            )
        ),
        48e9,
        3e9,
    ),
}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_presets_have_the_published_sizes_and_transformers_counts(preset):
    """Exactly transformers' parameter count for the release config, and the published rounded
    totals: Qwen3-Next 79.67B ("80B"); Kimi Linear 49.12B, 48.37B without embedding and head
    ("48B"). Active per token, without the embedding and head, is about 3B for both ("A3B")."""
    make_config, total, active = PUBLISHED[preset]
    cfg = load_preset(preset)
    counts = param_counts(build_model(cfg, device="meta"))
    hf = make_config()
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(hf)
    assert counts.total == sum(p.numel() for p in reference.parameters())
    body = counts.total - counts.embedding - counts.head
    assert (
        abs(min(counts.total, body) - total) / total < 0.01
        or abs(counts.total - total) / total < 0.01
    )
    body_active = counts.active - counts.embedding - counts.head
    assert 0.8 * active < body_active < 1.15 * active
    assert config_from_hf(hf.to_dict()).layer_specs() == cfg.layer_specs()


# ---- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "option"),
    [
        (dict(attention=AttentionConfig(n_heads=4, qk_norm=True)), "attention.output_gate=false"),
        (dict(attention=AttentionConfig(n_heads=4, output_gate=True)), "attention.qk_norm=false"),
        (
            dict(gdn=GDNConfig(n_heads=2, head_dim=16, allow_neg_eigval=True)),
            "gdn.allow_neg_eigval",
        ),
        (
            dict(moe=MoEConfig(**{**vars(QWEN_MOE), "shared_expert_gate": False})),
            "moe.shared_expert_gate",
        ),
        (dict(moe=MoEConfig(**{**vars(QWEN_MOE), "score_func": "sigmoid"})), "moe.score_func"),
        (dict(norm="layer"), "norm='layer'"),
        (dict(residual="post"), "residual='post'"),
    ],
)
def test_qwen_export_names_the_option_it_cannot_express(overrides, option, tmp_path):
    cfg = ModelConfig(**{**QWEN, "moe": QWEN_MOE, **overrides})
    with pytest.raises(ConfigError, match="equivalent") as err:
        save_hf(build_model(cfg, seed=0), tmp_path / "hf")
    assert option in str(err.value)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    ("overrides", "option"),
    [
        (
            dict(
                position="rope",
                attention=AttentionConfig(
                    kind="mla", n_heads=4, mla=MLAConfig(**{**vars(MLA.mla), "nope": False})
                ),
            ),
            "position='rope'",
        ),
        (dict(norm_eps=1e-5), "attention.mla.norm_eps=1e-05"),
        (dict(moe=MoEConfig(**{**vars(KIMI_MOE), "score_func": "softmax"})), "moe.score_func"),
        (
            dict(moe=MoEConfig(**{**vars(KIMI_MOE), "n_shared_experts": 0})),
            "moe.n_shared_experts=0",
        ),
    ],
)
def test_kimi_export_names_the_option_it_cannot_express(overrides, option, tmp_path):
    cfg = ModelConfig(**{**KIMI, "moe": KIMI_MOE, **overrides})
    with pytest.raises(ConfigError, match="KimiLinearForCausalLM equivalent") as err:
        save_hf(build_model(cfg, seed=0), tmp_path / "hf")
    assert option in str(err.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
        ({"mlp_only_layers": [2]}, "mlp_only_layers=[2]"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        (
            {
                "layer_types": [
                    "linear_attention",
                    "sliding_attention",
                    "linear_attention",
                    "full_attention",
                ]
            },
            "sliding_attention",
        ),
    ],
)
def test_import_refuses_qwen3_next_settings_it_cannot_represent(change, message, tmp_path):
    save_hf(build_model(ModelConfig(**QWEN, moe=QWEN_MOE), seed=0), tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | change))
    with pytest.raises(ConfigError, match="not supported") as err:
        load_hf(tmp_path / "hf")
    assert message in str(err.value)


def test_a_checkpoint_missing_a_tensor_names_it(tmp_path):
    from safetensors.torch import load_file, save_file

    save_hf(build_model(ModelConfig(**KIMI, moe=KIMI_MOE), seed=0), tmp_path / "hf")
    file = tmp_path / "hf" / "model.safetensors"
    state = load_file(file)
    del state["model.layers.1.self_attn.k_conv1d.weight"]
    save_file(state, file)
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.self_attn\.k_conv1d\.weight"):
        load_hf(tmp_path / "hf")


# ---- checkpoint details (review findings) ---------------------------------------------------------


def test_qwen3_next_checkpoints_with_mtp_weights_import(tmp_path):
    """Released Qwen3-Next checkpoints carry MTP weights; transformers' model ignores them."""
    from safetensors.torch import load_file, save_file

    cls, config = HF_MODELS["qwen3_next"]()
    theirs = _hf_random(cls, config)
    theirs.save_pretrained(tmp_path / "hf")
    file = tmp_path / "hf" / "model.safetensors"
    save_file(load_file(file) | {"mtp.fc.weight": torch.zeros(4, 4)}, file)
    with torch.no_grad():
        torch.testing.assert_close(
            load_hf(tmp_path / "hf")(token_batch(VOCAB, SEQ)),
            theirs(token_batch(VOCAB, SEQ)).logits,
            atol=ATOL,
            rtol=0,
        )


def test_bf16_zero_centred_gains_convert_in_fp32(tmp_path):
    """1 + w of a bf16 checkpoint's zero-centred gain, added in fp32 as transformers does (in
    bf16 the sum would round to a step of 1/128)."""
    cls, config = HF_MODELS["qwen3_5_text"]()
    theirs = _hf_random(cls, config)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if name.endswith("norm.weight") and "linear_attn" not in name:
                p.copy_(torch.randn_like(p) * 0.05)  # zero-centred: values near 0
    theirs.to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        ref = theirs.float()(token_batch(VOCAB, SEQ)).logits
        torch.testing.assert_close(ours(token_batch(VOCAB, SEQ)), ref, atol=ATOL, rtol=0)


def test_kimi_keeps_its_router_and_decay_tensors_fp32_in_a_bf16_export(tmp_path):
    from safetensors import safe_open

    save_hf(perturbed(ModelConfig(**KIMI, moe=KIMI_MOE)), tmp_path / "hf", dtype=torch.bfloat16)
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        dtypes = {name: f.get_tensor(name).dtype for name in f.keys()}  # noqa: SIM118
    fp32 = {n for n, d in dtypes.items() if d == torch.float32}
    assert fp32 and all(
        n.endswith(("e_score_correction_bias", "gate.weight", "dt_bias")) for n in fp32
    )
    assert "model.layers.1.block_sparse_moe.gate.e_score_correction_bias" in fp32
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["first_k_dense_replace"] == 1  # for Moonshot's own config class too


def test_a_tied_kimi_config_still_uses_its_own_lm_head(tmp_path):
    """KimiLinearForCausalLM never ties, whatever tie_word_embeddings says."""
    cls, config = HF_MODELS["kimi_linear"]()
    config.tie_word_embeddings = True
    theirs = _hf_random(cls, config)
    assert not torch.equal(theirs.lm_head.weight, theirs.model.embed_tokens.weight)
    theirs.save_pretrained(tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(
            load_hf(tmp_path / "hf")(token_batch(VOCAB, SEQ)),
            theirs(token_batch(VOCAB, SEQ)).logits,
            atol=ATOL,
            rtol=0,
        )


def test_qwen3_next_export_refuses_a_nonzero_selection_bias(tmp_path):
    model = perturbed(ModelConfig(**QWEN, moe=QWEN_MOE))
    model.layers["1"].ffn.router.expert_bias.fill_(0.1)  # trained with aux-loss-free balancing
    with pytest.raises(ConfigError, match="expert_bias .* is not zero"):
        save_hf(model, tmp_path / "hf")


def test_inspect_twin_of_a_full_attention_every_stack_is_all_attention(capsys):
    from model.inspect import main

    assert (
        main(
            [
                "model=tiny_hybrid",
                "model.layer_pattern=[]",
                "model.full_attention_every=4",
                "format=json",
            ]
        )
        == 0
    )
    row = json.loads(capsys.readouterr().out)["tiny_hybrid"]
    assert row["attention_twin_state_bytes_32k"] > 3 * row["state_bytes_32k"]
