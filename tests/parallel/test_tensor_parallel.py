"""Tensor parallelism (parallel/tensor_parallel.py) on 2 gloo ranks against one process, fp32:
the loss, every gradient, the scoring log-probabilities and the logits of a dense model whose
attention heads, FFN hidden units and vocabulary (also one tp does not divide) are split over the
ranks; kinds without a plan yet run replicated, exactly, and are named; what cannot be split is
refused in one line."""

from __future__ import annotations

import pytest
import torch

from model.errors import ConfigError
from model.presets import load_preset
from model.transformer import build_model
from tests.parallel.ranks import run_ranks
from tests.parallel.tp_workers import (
    T,
    assert_equal_one_process,
    assert_same_training,
    tp_forward_backward,
    tp_fsdp_train,
)

pytestmark = pytest.mark.distributed

DENSE = {"d_model": 64, "n_layers": 2, "attention.n_heads": 4, "attention.n_kv_heads": 2}


@pytest.mark.parametrize(
    "overrides",
    [
        DENSE,
        DENSE | {"tie_embeddings": False, "attention.output_gate": True},
        DENSE | {"attention.qk_norm": True},
        DENSE | {"vocab_size": 127},  # shards of 64 and 63 rows
    ],
    ids=["tied", "untied_gated", "qk_norm", "uneven_vocab"],
)
def test_two_tp_ranks_equal_one_process(overrides):
    whole = tp_forward_backward(0, "tiny", overrides)
    for got in run_ranks(2, tp_forward_backward, "tiny", overrides):
        assert got["replicated"] == []  # every weight-holding module of a dense model is split
        assert "layers.0.attn.q_proj.weight" in got["sharded"] and "embed.weight" in got["sharded"]
        assert_equal_one_process(got, whole)


GATED = {"d_model": 64, "n_layers": 2, "moe.shared_expert_gate": True}


@pytest.mark.parametrize(
    ("preset", "overrides", "replicated", "sequence_parallel"),
    [
        # the router and routed experts (MLA, GDN, KDA: tests/parallel/test_tensor_parallel_kinds.py)
        ("tiny_moe", {"d_model": 64, "n_layers": 2}, "layers.1.ffn", False),
        # the shared experts' gate multiplies their output: its gradient needs their whole sum,
        # not the rank's partial one (their row-wise projection's partial_output), with and
        # without sequence parallelism
        ("tiny_moe", GATED, "layers.1.ffn", False),
        ("tiny_moe", GATED, "layers.1.ffn", True),
    ],
    ids=["moe", "moe_shared_expert_gate", "moe_shared_expert_gate_sequence_parallel"],
)
def test_kinds_without_a_plan_run_replicated_and_exact(
    preset, overrides, replicated, sequence_parallel
):
    whole = tp_forward_backward(0, preset, overrides)
    for got in run_ranks(2, tp_forward_backward, preset, overrides, T, sequence_parallel):
        assert any(name.startswith(replicated) for name in got["replicated"]), got["replicated"]
        assert "embed.weight" in got["sharded"]
        torch.testing.assert_close(got["loss"], whole["loss"], rtol=1e-6, atol=1e-6)
        for name, grad in whole["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_moe_forward_shorter_than_tp_gets_one_process_gradients():
    """A forward of fewer positions than tp ranks runs the MoE layer whole on every rank
    (parallel/routed_work.py): its router and routed experts then hold whole gradients, which
    the per-step sum over the tp ranks must not add up again."""
    overrides = {"d_model": 64, "n_layers": 2}
    whole = tp_forward_backward(0, "tiny_moe", overrides, 1)
    for got in run_ranks(2, tp_forward_backward, "tiny_moe", overrides, 1):
        for name, grad in whole["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"attention.n_heads": 3, "attention.head_dim": 16, "attention.n_kv_heads": 1},
            "parallel.tp=2 must divide the attention's 3 query heads",
        ),
    ],
)
def test_what_cannot_be_split_is_refused_in_one_line(overrides, message):
    cfg = load_preset("tiny", {"vocab_size": 128} | DENSE | overrides)
    attn = build_model(cfg, device="meta").layers["0"].attn
    with pytest.raises(ConfigError, match=message):
        attn.tensor_parallel_plan(2)


@pytest.mark.parametrize(
    ("ranks", "tp", "overrides"),
    [(2, 2, DENSE), (4, 2, DENSE), (4, 2, DENSE | {"attention.qk_norm": True})],
    ids=["tp2", "dp_shard2_x_tp2", "dp_shard2_x_tp2_qk_norm"],
)
def test_training_steps_with_fsdp2_over_the_data_ranks_equal_one_process(ranks, tp, overrides):
    """Built on the meta device, split over tp, sharded by FSDP2 over the data ranks of the same
    root mesh, initialized as one process would be; 3 SGD steps clipped at 1.0 with the tp-aware
    global norm (the optimizer's own part is the trainer's business)."""
    whole = tp_fsdp_train(0, "tiny", overrides, 1)
    for got in run_ranks(ranks, tp_fsdp_train, "tiny", overrides, tp):
        assert_same_training(got, whole)
