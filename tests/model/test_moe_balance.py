"""Balance losses against their formulas (written as loops here), the trainer hooks (pop_aux_loss,
expert_load, apply_bias_update, moe_stats) and the fp32 balancing state."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from model import FFNConfig, ModelConfig, MoEConfig, Transformer
from model.moe import (
    MoE,
    apply_bias_update,
    expert_load,
    moe_layers,
    moe_stats,
    pop_aux_loss,
    reset_moe_stats,
    router_z_loss,
    sequence_balance_loss,
    switch_balance_loss,
)

# fp32 losses vs float64 loops over <= 48 tokens
ATOL, RTOL = 1e-6, 1e-5


def moe_model(n_layers: int = 3, seed: int = 0, **moe: Any) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=64,
        d_model=32,
        n_layers=n_layers,
        ffn=FFNConfig(hidden=24),
        moe=MoEConfig(**({"n_routed_experts": 8, "top_k": 2, "first_k_dense": 1} | moe)),
    )
    return Transformer(cfg)


def routing_sample(score_func: str, B: int = 3, T: int = 16, E: int = 8, k: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B * T, E, generator=g) * 2
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    idx = torch.randn(B * T, E, generator=g).topk(k, dim=-1).indices  # any selection will do
    return logits, scores, idx


def ref_balance(scores: torch.Tensor, idx: torch.Tensor) -> float:
    """f_e P_e summed: f_e = E/(k N) x tokens choosing e, P_e = mean over tokens of s_e / sum(s)."""
    N, E = scores.shape
    k = idx.shape[1]
    total = 0.0
    for e in range(E):
        count = sum(int(e in row) for row in idx.tolist())
        mean_prob = sum(scores[t, e].item() / scores[t].sum().item() for t in range(N)) / N
        total += E / (k * N) * count * mean_prob
    return total


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_switch_and_sequence_losses_follow_the_formulas(score_func):
    _, scores, idx = routing_sample(score_func)
    assert switch_balance_loss(scores, idx).item() == pytest.approx(
        ref_balance(scores, idx), rel=RTOL
    )
    per_sequence = [
        ref_balance(scores[b * 16 : (b + 1) * 16], idx[b * 16 : (b + 1) * 16]) for b in range(3)
    ]
    assert sequence_balance_loss(scores, idx, batch=3).item() == pytest.approx(
        sum(per_sequence) / 3, rel=RTOL
    )
    assert len(set(round(v, 4) for v in per_sequence)) == 3  # the sequences differ


def test_balance_loss_is_one_when_perfectly_balanced():
    scores = torch.full((8, 4), 0.25)
    idx = torch.tensor([[0, 1], [2, 3]] * 4)
    assert switch_balance_loss(scores, idx).item() == pytest.approx(1.0, abs=1e-7)
    assert sequence_balance_loss(scores, idx, batch=2).item() == pytest.approx(1.0, abs=1e-7)


def test_z_loss_is_the_mean_squared_log_partition():
    logits, _, _ = routing_sample("softmax")
    want = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / len(
        logits
    )
    assert router_z_loss(logits).item() == pytest.approx(want, rel=RTOL)


def _capture_routing(model: Transformer) -> list:
    seen = []
    for layer in moe_layers(model):
        layer.router.register_forward_hook(lambda mod, args, out: seen.append(out))
    return seen


def test_pop_aux_loss_is_the_weighted_sum_over_layers_and_forwards_and_clears():
    coefs = dict(aux_loss_coef=0.01, seq_aux_loss_coef=0.003, z_loss_coef=0.0007)
    model = moe_model(**coefs)
    routings = _capture_routing(model)
    tokens = torch.randint(0, 64, (2, 12))
    model(tokens)
    model(tokens.flip(1))
    assert len(routings) == 4  # 2 MoE layers x 2 forwards

    want = sum(
        coefs["aux_loss_coef"] * switch_balance_loss(r.scores, r.topk_idx)
        + coefs["seq_aux_loss_coef"] * sequence_balance_loss(r.scores, r.topk_idx, batch=2)
        + coefs["z_loss_coef"] * router_z_loss(r.logits)
        for r in routings
    )
    loss = pop_aux_loss(model)
    torch.testing.assert_close(loss, want, atol=ATOL, rtol=RTOL)
    assert pop_aux_loss(model) is None  # cleared

    loss.backward()  # the balance losses reach the routers and, through their inputs, earlier layers
    first, last = moe_layers(model)
    assert first.router.gate.weight.grad.abs().sum() > 0
    assert last.router.gate.weight.grad.abs().sum() > 0
    assert first.experts.w_gate.grad.abs().sum() > 0  # feeds the last router's input
    assert last.experts.w_gate.grad is None  # nothing downstream of the last experts
    assert model.embed.weight.grad.abs().sum() > 0


def test_nothing_is_kept_without_coefficients_or_outside_training():
    model = moe_model()
    model(torch.randint(0, 64, (2, 8)))
    assert pop_aux_loss(model) is None  # no coefficient set
    model = moe_model(aux_loss_coef=0.1)
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 8)))
    assert pop_aux_loss(model) is None
    assert expert_load(model).sum() == 0


def test_expert_load_accumulates_over_forwards_as_one_tensor():
    model = moe_model()
    routings = _capture_routing(model)
    model(torch.randint(0, 64, (2, 8)))
    model(torch.randint(0, 64, (2, 8)))
    load = expert_load(model)
    assert load.shape == (2, 8) and load.dtype == torch.float32
    for i in range(2):
        want = sum(torch.bincount(r.topk_idx.flatten(), minlength=8) for r in routings[i::2])
        assert torch.equal(load[i], want.float())
    assert load.sum() == 2 * 2 * 16 * 2  # layers x forwards x tokens x k
    reset_moe_stats(model)
    assert expert_load(model).sum() == 0


def test_apply_bias_update_follows_the_sign_rule_per_layer_and_resets_the_counters():
    model = moe_model(n_layers=4, bias_update_rate=0.01)
    moe_layers(model)[1].cfg = MoEConfig(n_routed_experts=8, top_k=2, bias_update_rate=0.0)
    model(torch.randint(0, 64, (2, 8)))
    load = torch.tensor(
        [
            [
                10.0,
                0,
                5,
                5,
                5,
                5,
                5,
                5,
            ],  # mean 5: expert 0 overloaded, 1 idle, the rest at the mean
            [9.0, 1, 5, 5, 5, 5, 5, 5],  # a layer with the update off
            [0.0, 0, 0, 0, 0, 0, 0, 40],
        ]
    )
    apply_bias_update(model, load)
    layers = moe_layers(model)
    torch.testing.assert_close(
        layers[0].router.expert_bias, torch.tensor([-0.01, 0.01, 0, 0, 0, 0, 0, 0])
    )
    assert layers[1].router.expert_bias.abs().sum() == 0
    torch.testing.assert_close(layers[2].router.expert_bias, torch.tensor([0.01] * 7 + [-0.01]))
    assert expert_load(model).sum() == 0  # counters reset
    with pytest.raises(ValueError, match="expected"):
        apply_bias_update(model, load[:2])


def test_the_bias_moves_selection_towards_idle_experts_without_touching_the_weights():
    model = moe_model(n_layers=2, bias_update_rate=0.02)
    (layer,) = moe_layers(model)
    x = torch.randn(256, 32)
    with torch.no_grad():  # a router that favours expert 0 for most tokens
        layer.router.gate.weight[0] = x.mean(0) / x.mean(0).norm() * 1.5
    before = layer.router(x)
    load = torch.bincount(before.topk_idx.flatten(), minlength=8).float()
    assert load.argmax() == 0
    apply_bias_update(model, load[None])
    after = layer.router(x)
    new_load = torch.bincount(after.topk_idx.flatten(), minlength=8).float()
    # the most loaded expert loses tokens, the under-loaded ones gain them
    under = load < load.mean()
    assert new_load[0] < load[0] and new_load[under].sum() > load[under].sum()
    torch.testing.assert_close(after.scores, before.scores, atol=0, rtol=0)
    same = (after.topk_idx == before.topk_idx).all(dim=-1)
    assert 0 < same.sum() < len(x)
    torch.testing.assert_close(after.topk_weight[same], before.topk_weight[same], atol=0, rtol=0)


def test_moe_stats_keys_and_values():
    model = moe_model(aux_loss_coef=0.01, capacity_factor=0.5)
    model(torch.randint(0, 64, (2, 16)))
    stats = moe_stats(model)
    names = (
        "imbalance",
        "dropped_frac",
        "bias_min",
        "bias_max",
        "aux_loss",
        "seq_aux_loss",
        "z_loss",
    )
    assert set(stats) == {f"moe/layer{i}/{n}" for i in (1, 2) for n in names} | {
        "moe/imbalance",
        "moe/dropped_frac",
        "moe/aux_loss",
    }
    layers = moe_layers(model)
    load = expert_load(model)
    for layer, row in zip(layers, load):
        i = layer.layer_id
        assert stats[f"moe/layer{i}/imbalance"] == pytest.approx((row.max() / row.mean()).item())
        routed = 32 * 2
        assert stats[f"moe/layer{i}/dropped_frac"] == pytest.approx(
            layer.dropped_tokens.item() / routed
        )
        assert stats[f"moe/layer{i}/dropped_frac"] > 0  # capacity 0.5 drops
    assert stats["moe/aux_loss"] == pytest.approx(pop_aux_loss(model).item(), rel=1e-6)
    assert stats["moe/imbalance"] == pytest.approx(
        (stats["moe/layer1/imbalance"] + stats["moe/layer2/imbalance"]) / 2
    )
    glob = torch.ones(2, 8)
    glob[0, 3] = 3.0  # a given (all-reduced) load replaces the local counters
    stats = moe_stats(model, glob)
    assert stats["moe/layer1/imbalance"] == pytest.approx(3 / 1.25)
    assert stats["moe/layer2/imbalance"] == 1.0
    reset_moe_stats(model)
    assert moe_stats(model)["moe/imbalance"] == 0.0  # nothing counted


def test_balancing_state_stays_fp32_and_only_the_bias_is_checkpointed():
    model = moe_model()
    layer = moe_layers(model)[0]
    layer.router.expert_bias.copy_(torch.linspace(-1e-3, 1e-3, 8) + 0.1234567)
    bias = layer.router.expert_bias.clone()
    model.to(torch.bfloat16)
    assert layer.router.gate.weight.dtype == torch.bfloat16
    assert layer.router.expert_bias.dtype == torch.float32
    assert torch.equal(layer.router.expert_bias, bias)  # not rounded through bf16
    assert layer.tokens_per_expert.dtype == layer.dropped_tokens.dtype == torch.float32
    keys = model.state_dict().keys()
    assert "layers.1.ffn.router.expert_bias" in keys
    assert not any("tokens_per_expert" in k or "dropped_tokens" in k for k in keys)
    model(torch.randint(0, 64, (1, 8)))  # a bf16 model still runs and counts in fp32
    assert expert_load(model).sum() == 2 * 8 * 2


def test_moe_layers_are_found_in_block_order():
    model = moe_model(n_layers=4, first_k_dense=2)
    assert [m.layer_id for m in moe_layers(model)] == [2, 3]
    assert all(isinstance(m, MoE) for m in moe_layers(model))
    assert moe_stats(Transformer(ModelConfig(vocab_size=64, n_layers=1))) == {}
