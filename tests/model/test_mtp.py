"""Multi-token prediction: the shifted inputs and labels equal torchtitan's tables (MTP.md 2.2-2.3)
on plain and packed rows; the objective equals a hand-written composition of the depth losses; a
module equals transformers' generic MtpLayer (Llama decoder layer) with copied weights; lambda = 0
skips the modules; the accounting counts them; bad settings fail with the key."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model import ModelConfig, build_model
from model.accounting import param_counts, training_flops_per_token
from model.config import ConfigError, MTPConfig
from model.loss import IGNORE_INDEX
from model.mixers.masks import document_starts
from model.mtp.heads import roll_left, shifted_valid

V = 97


def mtp_model(depth=2, seed=0, **kw) -> torch.nn.Module:
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, mtp=MTPConfig(depth=depth), **kw)
    return build_model(cfg, seed=seed)


def shift(tokens, k, fill, doc_ids=None):
    starts = document_starts(doc_ids) if doc_ids is not None else None
    return roll_left(tokens, k, shifted_valid(starts, tokens.shape, k, tokens.device), fill)


def test_shifts_equal_torchtitans_unpacked_table():
    t = torch.arange(7)[None]  # t0 .. t6
    inputs, labels = t[:, :6], t[:, 1:]
    F_, I_ = 0, IGNORE_INDEX
    assert shift(inputs, 1, F_).tolist() == [[1, 2, 3, 4, 5, F_]]
    assert shift(labels, 1, I_).tolist() == [[2, 3, 4, 5, 6, I_]]
    assert shift(inputs, 2, F_).tolist() == [[2, 3, 4, 5, F_, F_]]
    assert shift(labels, 2, I_).tolist() == [[3, 4, 5, 6, I_, I_]]


def test_shifts_equal_torchtitans_packed_table():
    # [A0, A1, A2, B0, B1, B2, B3, C0, C1, C2] as 10 .. 12, 20 .. 23, 30 .. 32; FILL = -1
    tokens = torch.tensor([[10, 11, 12, 20, 21, 22, 23, 30, 31, 32]])
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2]])
    X = -1
    assert shift(tokens, 1, X, doc_ids).tolist() == [[11, 12, X, 21, 22, 23, X, 31, 32, X]]
    assert shift(tokens, 2, X, doc_ids).tolist() == [[12, X, X, 22, 23, X, X, 32, X, X]]
    assert shift(tokens, 10, X, doc_ids).tolist() == [[X] * 10]


def reference_objective(model, tokens, targets, weight):
    """The composition written out: h^0 before the final norm, then each depth's module and
    loss with F.cross_entropy over the valid shifted targets."""
    h = model._trunk(tokens, None, None)[0]
    positions = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    ctx = model._context(tokens, positions, 0, None, h.dtype)
    losses = []
    for k, module in enumerate(model.mtp.layers, start=1):
        x = shift(tokens, k, 0)
        y = shift(targets, k, IGNORE_INDEX)
        mixed = module.eh_proj(torch.cat([module.enorm(model.embed(x)), module.hnorm(h)], -1))
        h = module.block(mixed, ctx)
        logits = F.linear(module.norm(h), model.head_weight)
        losses.append(F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX))
    return weight / len(losses) * sum(losses), losses


def test_objective_is_lambda_over_depth_times_the_depth_losses():
    model = mtp_model(depth=2)
    model.mtp.weight = 0.3
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, V, (3, 13), generator=g)
    tokens, targets = seq[:, :-1], seq[:, 1:]
    main = model(tokens, targets)
    objective = model.pop_mtp_objective()
    expected, losses = reference_objective(model, tokens, targets, 0.3)
    torch.testing.assert_close(objective, expected, rtol=1e-5, atol=1e-6)
    stats = model.mtp.stats()
    assert stats["mtp/loss_1"] == pytest.approx(losses[0].item(), rel=1e-5)
    assert stats["mtp/loss_2"] == pytest.approx(losses[1].item(), rel=1e-5)
    assert stats["mtp/weight"] == 0.3 and model.mtp.stats() == {}  # read once
    plain = build_model(ModelConfig(vocab_size=V, d_model=32, n_layers=2), seed=0)
    torch.testing.assert_close(main, plain(tokens, targets), rtol=0, atol=0)  # same main model


def test_lambda_zero_skips_the_modules_and_eval_never_runs_them():
    model = mtp_model(depth=1)
    tokens = torch.randint(0, V, (2, 9))
    model.mtp.weight = 0.0
    model(tokens, tokens)
    assert model.pop_mtp_objective() is None and model.mtp.stats() == {}
    model.mtp.weight = 0.3
    with torch.no_grad():
        model(tokens, tokens)
    assert model.pop_mtp_objective() is None  # evaluation: the main loss alone


def test_a_module_equals_transformers_mtp_layer_with_copied_weights():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_layers import MtpLayer
    from transformers.models.llama.modeling_llama import (
        LlamaDecoderLayer,
        LlamaRMSNorm,
        LlamaRotaryEmbedding,
    )

    model = mtp_model(depth=1)
    cfg = model.cfg
    module = model.mtp.layers[0]
    hf_cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=cfg.ffn_hidden,
        num_attention_heads=cfg.attention.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.norm_eps,
        vocab_size=V,
        rope_theta=cfg.rope.theta,
        attn_implementation="eager",
    )
    layer = MtpLayer(hf_cfg, LlamaDecoderLayer, LlamaRMSNorm, 2).eval()
    block, hf = module.block, layer.mtp_block
    with torch.no_grad():
        for ours, theirs in [
            (module.enorm, layer.enorm),
            (module.hnorm, layer.hnorm),
            (module.eh_proj, layer.eh_proj),
            (module.norm, layer.post_norm),
            (block.attn_norm, hf.input_layernorm),
            (block.ffn_norm, hf.post_attention_layernorm),
            (block.attn.q_proj, hf.self_attn.q_proj),
            (block.attn.k_proj, hf.self_attn.k_proj),
            (block.attn.v_proj, hf.self_attn.v_proj),
            (block.attn.o_proj, hf.self_attn.o_proj),
            (block.ffn.gate_proj, hf.mlp.gate_proj),
            (block.ffn.up_proj, hf.mlp.up_proj),
            (block.ffn.down_proj, hf.mlp.down_proj),
        ]:
            theirs.weight.copy_(ours.weight)
    g = torch.Generator().manual_seed(1)
    T = 11
    tokens = torch.randint(0, V, (2, T), generator=g)
    hidden, embedded = torch.randn(2, T, 32, generator=g), torch.randn(2, T, 32, generator=g)
    positions = torch.arange(T)[None].expand(2, T)
    ctx = model._context(tokens, positions, 0, None, torch.float32)
    ours = module(hidden, embedded, ctx)[1]
    rope = LlamaRotaryEmbedding(hf_cfg)(hidden, positions)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    theirs = layer(embedded, hidden, rope, mask, positions, None)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_accounting_counts_the_modules_and_their_head():
    model = mtp_model(depth=2)
    base = build_model(ModelConfig(vocab_size=V, d_model=32, n_layers=2), device="meta")
    counts = param_counts(model)
    assert counts.mtp == sum(p.numel() for p in model.mtp.parameters())
    assert counts.total == param_counts(base).total + counts.mtp
    assert counts.blocks == param_counts(base).blocks
    flops, base_flops = training_flops_per_token(model, 16), training_flops_per_token(base, 16)
    per_module = sum(
        p.numel() for n, p in model.mtp.layers[0].named_parameters() if "norm" not in n
    )
    expected = base_flops.matmul + 6 * 2 * (per_module + model.head_weight.numel())
    assert flops.matmul == pytest.approx(expected)
    assert flops.attention == pytest.approx(base_flops.attention * 2)  # 2 layers + 2 MTP blocks


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(mtp=dict(depth=1), residual="mhc"), "model.residual='mhc'"),
        (dict(mtp=dict(depth=-1)), "model.mtp.depth=-1"),
        (dict(mtp=dict(depth=1, switch_fraction=2.0)), "switch_fraction"),
    ],
)
def test_bad_mtp_settings_fail_with_the_key(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        mtp = MTPConfig(**kwargs.pop("mtp"))
        ModelConfig(vocab_size=V, d_model=32, n_layers=2, mtp=mtp, **kwargs)


def test_the_weight_schedule_switches_at_the_fraction():
    cfg = MTPConfig(depth=1, weight=0.3, final_weight=0.1, switch_fraction=0.7)
    assert [cfg.weight_at(s, 10) for s in (0, 6, 7, 9)] == [0.3, 0.3, 0.1, 0.1]
    assert MTPConfig(depth=1, switch_fraction=1.0).weight_at(99, 100) == 0.3
