"""Tensor parallelism (parallel/tensor_parallel.py) of the layer kinds beyond dense attention, on
gloo ranks against one process, fp32: MLA (low-rank parts whole on every rank, heads split),
Gated DeltaNet and KDA (heads, conv channels, decays and gates split), softmax attention with
fewer kv heads than ranks (kv heads replicated), and MoE (shared experts split, router and
routed experts whole). The loss to 1e-6 relative and every gradient to 1e-5, and training steps
under FSDP2 over the data ranks (dp_shard=2 x tp=2); what tp cannot split is refused in one
line."""

from __future__ import annotations

import pytest

from model.errors import ConfigError
from model.presets import load_preset
from model.transformer import build_model
from parallel.tensor_parallel_styles import head_rows
from tests.parallel.ranks import run_ranks
from tests.parallel.tp_workers import (
    assert_equal_one_process,
    assert_same_training,
    tp_forward_backward,
    tp_fsdp_train,
)

pytestmark = pytest.mark.distributed

SMALL = {"d_model": 64}
DENSE = SMALL | {"n_layers": 2, "attention.n_heads": 4, "attention.n_kv_heads": 2}


@pytest.mark.parametrize(
    ("preset", "overrides", "split"),
    [
        # low-rank q (q_a -> norm -> q_b) with decoupled RoPE: its rope key feeds every head
        (
            "tiny_mla",
            SMALL | {"n_layers": 2},
            ["layers.0.attn.q_b_proj", "layers.0.attn.kv_b_proj"],
        ),
        (
            "tiny_hybrid",  # 3 GDN layers (2 key heads, 4 value heads) + gated softmax attention
            SMALL | {"n_layers": 4, "gdn.head_dim": 16, "gdn.v_head_dim": 16},
            [
                f"layers.0.attn.{name}"
                for name in ("q_proj", "v_proj", "z_proj", "a_proj", "conv", "A_log", "norm")
            ],
        ),
        (
            "tiny_kda",  # 3 KDA layers + MLA without RoPE and with a full-rank q
            SMALL | {"n_layers": 4, "kda.head_dim": 16},
            [
                f"layers.0.attn.{name}"
                for name in ("q_proj", "f_b_proj", "g_b_proj", "conv", "dt_bias", "o_proj")
            ]
            + ["layers.3.attn.q_proj"],
        ),
    ],
    ids=["mla", "gdn", "kda"],
)
def test_kinds_split_over_two_ranks_equal_one_process(preset, overrides, split):
    whole = tp_forward_backward(0, preset, overrides)
    for got in run_ranks(2, tp_forward_backward, preset, overrides):
        assert got["replicated"] == []  # every weight-holding module is planned now
        for prefix in split:
            assert any(name.startswith(prefix) for name in got["sharded"]), prefix
        assert_equal_one_process(got, whole)


@pytest.mark.parametrize(
    ("ranks", "overrides"),
    [
        (2, DENSE | {"attention.n_kv_heads": 1}),  # MQA: both ranks compute the one kv head
        # 2 query heads per rank, a kv head shared by 2 ranks; QK-norm and biases on the rows
        (2, DENSE | {"attention.n_kv_heads": 1, "attention.qk_norm": True, "attention.bias": True}),
        (4, DENSE),  # one query head per rank, kv head r // 2
    ],
    ids=["mqa_tp2", "mqa_tp2_qk_norm_bias", "gqa_tp4_kv2"],
)
def test_attention_with_fewer_kv_heads_than_ranks_replicates_them(ranks, overrides):
    whole = tp_forward_backward(0, "tiny", overrides)
    for got in run_ranks(ranks, tp_forward_backward, "tiny", overrides):
        assert got["replicated"] == []
        assert "layers.0.attn.k_proj.weight" in got["sharded"]
        assert_equal_one_process(got, whole)


def test_moe_splits_its_shared_experts_and_keeps_router_and_routed_experts_whole():
    overrides = SMALL | {"n_layers": 2, "moe.expert_hidden": 64}
    whole = tp_forward_backward(0, "tiny_moe", overrides)
    for got in run_ranks(2, tp_forward_backward, "tiny_moe", overrides):
        # layer 0 is dense (first_k_dense); layer 1's shared expert is a planned GatedFFN
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert f"layers.1.ffn.shared.{proj}.weight" in got["sharded"]
        assert sorted(got["replicated"]) == ["layers.1.ffn.experts", "layers.1.ffn.router.gate"]
        assert_equal_one_process(got, whole)


@pytest.mark.parametrize(
    ("preset", "overrides"),
    [
        ("tiny_mla", SMALL | {"n_layers": 2}),
        ("tiny_hybrid", SMALL | {"n_layers": 4, "gdn.head_dim": 16, "gdn.v_head_dim": 16}),
        ("tiny_kda", SMALL | {"n_layers": 4, "kda.head_dim": 16}),
        ("tiny", DENSE | {"attention.n_kv_heads": 1, "attention.qk_norm": True}),
    ],
    ids=["mla", "gdn", "kda", "mqa_qk_norm"],
)
def test_training_steps_with_fsdp2_over_the_data_ranks_equal_one_process(preset, overrides):
    """dp_shard=2 x tp=2 (built on the meta device, FSDP2 over the data ranks of the same root
    mesh): 3 SGD steps clipped with the tp-aware global norm, as in test_tensor_parallel.py."""
    whole = tp_fsdp_train(0, preset, overrides, 1)
    for got in run_ranks(4, tp_fsdp_train, preset, overrides, 2):
        assert_same_training(got, whole)


@pytest.mark.parametrize(
    ("preset", "overrides", "tp", "message"),
    [
        (
            "tiny",
            DENSE | {"attention.n_heads": 6, "attention.head_dim": 16},
            3,
            "parallel.tp=3 must divide the attention's 6 query heads and divide or be a "
            "multiple of its 2 key/value heads",
        ),
        ("tiny", DENSE, 8, "parallel.tp=8 must divide the attention's 4 query heads"),
        ("tiny_mla", SMALL, 3, "parallel.tp=3 must divide the MLA attention's 8 heads"),
        ("tiny_hybrid", SMALL, 4, "parallel.tp=4 must divide the gdn layers' 2 query/key"),
        ("tiny_kda", SMALL, 8, "parallel.tp=8 must divide the kda layers' 4 heads"),
    ],
)
def test_heads_tp_cannot_split_are_refused_in_one_line(preset, overrides, tp, message):
    cfg = load_preset(preset, {"vocab_size": 128} | overrides)
    mixer = build_model(cfg, device="meta").layers["0"].attn
    with pytest.raises(ConfigError, match=message) as error:
        mixer.tensor_parallel_plan(tp)
    assert "\n" not in str(error.value)


def test_head_rows_give_each_rank_its_heads_or_the_one_it_shares():
    # 4 heads of 3 rows over 2 ranks: 2 heads each; 2 heads over 4 ranks: ranks 0, 1 share head 0
    assert [head_rows(((4, 3),), r, 2) for r in range(2)] == [[(0, 6)], [(6, 12)]]
    assert [head_rows(((2, 3),), r, 4) for r in range(4)] == [[(0, 3)]] * 2 + [[(3, 6)]] * 2
    # blocks [q | k | v] of a conv: each block split on its own
    assert head_rows(((2, 4), (2, 4), (4, 2)), 1, 2) == [(4, 8), (12, 16), (20, 24)]
    with pytest.raises(ValueError, match="tp=3 neither divides nor is a multiple of 2 heads"):
        head_rows(((2, 1),), 0, 3)
