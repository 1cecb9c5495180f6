"""The MoE layer against transformers' own: Qwen3-MoE's sparse block (softmax, top-k, optional
renormalization) and DeepSeek-V3's MoE (sigmoid, group-limited routing with the score-correction
bias, routed scaling factor, shared experts), with copied weights.

transformers 5 stores experts fused: gate_up_proj (E, 2F, C) = [W_gate^T; W_up^T] per expert and
down_proj (E, C, F) = W_down^T; our w_gate/w_up are (E, C, F) and w_down (E, F, C).
"""

from __future__ import annotations

import pytest
import torch

from model import FFNConfig, ModelConfig, MoEConfig
from model.moe import MoE

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: E402

# fp32 on both sides; routing weights and expert sums differ only in operation order
ATOL, RTOL = 1e-5, 1e-5
C = 48


def ours(seed: int, **moe) -> MoE:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=64, d_model=C, n_layers=2, ffn=FFNConfig(hidden=64), moe=MoEConfig(**moe)
    )
    layer = MoE(cfg, layer_id=1)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer


def copy_experts(layer: MoE, experts: torch.nn.Module) -> None:
    e = layer.experts
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.cat([e.w_gate, e.w_up], dim=2).transpose(1, 2))
        experts.down_proj.copy_(e.w_down.transpose(1, 2))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_matches_qwen3_moe_sparse_block(norm_topk_prob, top_k):
    layer = ours(
        0, n_routed_experts=8, top_k=top_k, expert_hidden=32, norm_topk_prob=norm_topk_prob
    )
    hf_cfg = transformers.Qwen3MoeConfig(
        hidden_size=C,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
        hidden_act="silu",
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    theirs = Qwen3MoeSparseMoeBlock(hf_cfg).eval()
    with torch.no_grad():
        theirs.gate.weight.copy_(layer.router.gate.weight)
    copy_experts(layer, theirs.experts)
    x = torch.randn(3, 10, C)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), theirs(x), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
    ("n_groups", "topk_groups", "top_k", "n_shared"), [(4, 2, 4, 2), (8, 3, 6, 1), (1, 1, 3, 1)]
)
def test_matches_deepseek_v3_moe(n_groups, topk_groups, top_k, n_shared):
    E, F_ = 16, 32
    layer = ours(
        1,
        n_routed_experts=E,
        top_k=top_k,
        expert_hidden=F_,
        n_shared_experts=n_shared,
        score_func="sigmoid",
        norm_topk_prob=True,
        route_scale=2.5,
        n_groups=n_groups,
        topk_groups=topk_groups,
    )
    layer.router.expert_bias.copy_(0.2 * torch.randn(E))  # a trained score-correction bias
    hf_cfg = transformers.DeepseekV3Config(
        hidden_size=C,
        intermediate_size=96,
        moe_intermediate_size=F_,
        n_routed_experts=E,
        num_experts_per_tok=top_k,
        n_shared_experts=n_shared,
        n_group=n_groups,
        topk_group=topk_groups,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        hidden_act="silu",
        num_hidden_layers=1,
        num_attention_heads=4,
    )
    theirs = DeepseekV3MoE(hf_cfg).eval()
    with torch.no_grad():
        theirs.gate.weight.copy_(layer.router.gate.weight)
        theirs.gate.e_score_correction_bias.copy_(layer.router.expert_bias)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(theirs.shared_experts, name).weight.copy_(getattr(layer.shared, name).weight)
    copy_experts(layer, theirs.experts)
    x = torch.randn(3, 10, C)
    with torch.no_grad():
        y = layer(x)
        torch.testing.assert_close(y, theirs(x), atol=ATOL, rtol=RTOL)
        theirs.gate.e_score_correction_bias.zero_()  # the bias matters: without it, outputs change
        assert (y - theirs(x)).abs().max() > 1e-2


def test_the_gated_shared_expert_matches_qwen3_next_sparse_block():
    """Qwen3-Next's MoE: softmax top-k plus one shared expert scaled by sigmoid(w . x)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    layer = ours(
        2,
        n_routed_experts=8,
        top_k=2,
        expert_hidden=32,
        n_shared_experts=1,
        shared_hidden=24,
        shared_expert_gate=True,
    )
    assert layer.param_roles() == {"shared_gate.weight": "mixing"}  # AdamW, never Muon
    hf_cfg = transformers.Qwen3NextConfig(
        hidden_size=C,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=24,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=1,
    )
    theirs = Qwen3NextSparseMoeBlock(hf_cfg).eval()
    with torch.no_grad():
        theirs.gate.weight.copy_(layer.router.gate.weight)
        theirs.shared_expert_gate.weight.copy_(layer.shared_gate.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(theirs.shared_expert, name).weight.copy_(getattr(layer.shared, name).weight)
    copy_experts(layer, theirs.experts)
    x = torch.randn(3, 10, C)
    with torch.no_grad():
        y = layer(x)
        torch.testing.assert_close(y, theirs(x), atol=ATOL, rtol=RTOL)
        theirs.shared_expert_gate.weight.fill_(50.0)  # the gate matters: near 1 vs near 0
        assert (y - theirs(x)).abs().max() > 1e-2
