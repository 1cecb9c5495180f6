"""Per-layer layouts: a stack of different token mixers builds, trains, decodes and accounts."""

from __future__ import annotations

import pytest
import torch

from model import ConfigError, ModelConfig, build_model
from model.accounting import average_context, kv_cache_size, training_flops_per_token
from model.config import AttentionConfig, MLAConfig
from model.mixers.attention import Attention
from model.mixers.mla import MultiHeadLatentAttention
from model.presets import load_preset

MLA = MLAConfig(
    q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8
)


def mixed_config(**overrides) -> ModelConfig:
    """GQA and MLA layers alternating, rotating different widths: GQA heads of 16 (all 16
    dims rotate), MLA's rope part of 8."""
    kw = dict(
        vocab_size=64,
        d_model=32,
        n_layers=4,
        max_seq_len=64,
        attention=AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=16, mla=MLA),
        layer_pattern=["gqa", "mla"],
        ffn={"hidden": 48},
    )
    kw.update(overrides)
    kw["ffn"] = __import__("model").FFNConfig(**kw["ffn"])
    return ModelConfig(**kw)


def test_pattern_and_explicit_list_resolve_to_the_same_stack():
    by_pattern = mixed_config()
    explicit = mixed_config(layer_pattern=[], layer_types=["gqa", "mla", "gqa", "mla"])
    assert by_pattern.mixer_kinds() == explicit.mixer_kinds() == ["gqa", "mla", "gqa", "mla"]
    model = build_model(by_pattern, seed=0)
    kinds = [type(block.attn) for block in model.layers.values()]
    assert kinds == [Attention, MultiHeadLatentAttention, Attention, MultiHeadLatentAttention]
    assert model.rotary_dims == [8, 16]  # one table of rotations per width
    # the default layout is attention.kind everywhere, MoE from first_k_dense on
    moe = load_preset("tiny_moe")
    specs = moe.layer_specs()
    assert [s.ffn for s in specs] == [
        "dense" if i < moe.moe.first_k_dense else "moe" for i in range(moe.n_layers)
    ]
    assert {s.mixer for s in specs} == {"gqa"}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            dict(layer_pattern=[], layer_types=["gqa", "mla"]),
            "model.layer_types has 2 entries for model.n_layers=4",
        ),
        (
            dict(layer_pattern=["gqa", "flash"]),
            "model.layer_pattern='flash' is not a known token mixer",
        ),
        (
            dict(layer_types=["gqa"] * 4, layer_pattern=["gqa"]),
            "model.layer_types and model.layer_pattern are both set",
        ),
        (dict(position="alibi"), "MLA uses decoupled RoPE"),
        (
            dict(layer_pattern=["gqa"], full_attention_every=4),
            "model.layer_pattern and model.full_attention_every are both set",
        ),
        (
            dict(layer_pattern=[], full_attention_every=2, linear_mixer="rnn"),
            "model.linear_mixer='rnn' is not a known token mixer",
        ),
        (dict(layer_pattern=[], full_attention_every=-1), "full_attention_every=-1 must be >= 0"),
    ],
)
def test_bad_layouts_fail_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        mixed_config(**overrides)


def test_a_mixed_stack_trains():
    torch.manual_seed(0)
    model = build_model(mixed_config(), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(30):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]  # memorizes the four rows


def test_a_mixed_stack_prefills_and_decodes_like_a_full_forward():
    model = build_model(mixed_config(), seed=0).eval()
    tokens = torch.randint(0, 64, (2, 14), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(tokens)  # (B, T, V)
        cache = model.new_cache(2, 14)
        prefill = model(tokens[:, :9], cache=cache)
        torch.testing.assert_close(prefill, full[:, :9], atol=2e-5, rtol=1e-5)
        for t in range(9, 14):
            step = model(tokens[:, t : t + 1], cache=cache)
            torch.testing.assert_close(step[:, 0], full[:, t], atol=2e-5, rtol=1e-5)


def test_a_mixed_stack_accounts_each_layer_by_its_kind():
    cfg = mixed_config()
    model = build_model(cfg, device="meta")
    T = 32
    ctx = average_context(T)
    gqa_width = 4 * (16 + 16)  # H x (Dqk + Dv), head_dim 16
    mla_width = 4 * (8 + 8 + 8)  # H x (Dn + Dr + Dv)
    flops = training_flops_per_token(model, T)
    assert flops.attention == pytest.approx(6 * 2 * (gqa_width + mla_width) * ctx, rel=1e-12)
    kv = kv_cache_size(model, "fp32")
    per_layer = 2 * 2 * 16 + (16 + 8)  # GQA 2 x K x D, MLA R + Dr
    assert kv.bytes_per_token == 2 * per_layer * 4
    assert kv.mha_bytes_per_token == 2 * (gqa_width + mla_width) * 4


def test_inspect_prints_and_exports_the_resolved_layout(capsys):
    from model.inspect import main

    args = ["model=tiny", "model.layer_pattern=[gqa,gqa,mla]", "seq_len=256", "format=json"]
    assert main(args) == 0
    row = __import__("json").loads(capsys.readouterr().out)["tiny"]
    assert row["layout"] == (
        "layers 0-1: gqa + dense; layer 2: mla + dense; layers 3-4: gqa + dense; layer 5: mla + dense"
    )
    assert "layers 0-1: GQA: 4q / 2kv x 64" in row["attention"] and "MLA: 4 x" in row["attention"]
    cfg = load_preset("tiny", {"layer_pattern": ["gqa", "gqa", "mla"]})
    model = build_model(cfg, device="meta")
    assert row["kv_bytes_per_token"] == kv_cache_size(model, "bf16").bytes_per_token
    gqa = 2 * 2 * 64  # per layer: K x D keys and values
    mla = cfg.attention.mla.kv_lora_rank + cfg.attention.mla.qk_rope_head_dim
    assert row["kv_bytes_per_token"] == 2 * (4 * gqa + 2 * mla)  # bf16


def test_full_attention_every_is_qwen3_next_rule():
    """full_attention_every=4: layers 3, 7, 11 are softmax attention, the rest linear_mixer; the
    same stack as transformers' `full_attention_interval` rule, (i + 1) % 4 == 0."""
    from model import ModelConfig

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=12, full_attention_every=4)
    full = [i for i, kind in enumerate(cfg.mixer_kinds()) if kind == "gqa"]
    assert full == [3, 7, 11] == [i for i in range(12) if (i + 1) % 4 == 0]
    assert set(cfg.mixer_kinds()) == {"gdn", "gqa"}
    kda = ModelConfig(
        vocab_size=64, d_model=32, n_layers=8, full_attention_every=4, linear_mixer="kda"
    )
    assert kda.mixer_kinds() == ["kda", "kda", "kda", "gqa"] * 2
    pattern = ModelConfig(
        vocab_size=64, d_model=32, n_layers=12, layer_pattern=["gdn"] * 3 + ["gqa"]
    )
    assert pattern.layer_specs() == cfg.layer_specs()
