"""A Gated DeltaNet hybrid under FSDP2 (and with activation checkpointing) trains like one process;
MuonClip's QK-clip touches only its softmax-attention layers."""

from __future__ import annotations

import pytest
import torch

from model.presets import load_preset
from model.transformer import build_model
from optim.qk_clip import clip_layers, enable_qk_clip
from tests.parallel.ranks import run_ranks
from tests.parallel.workers import SMALL, train

STEPS = 4
HYBRID = SMALL | {"gdn.n_heads": 2, "gdn.n_v_heads": 4, "gdn.head_dim": 16, "gdn.chunk_size": 8}


def hybrid():
    return load_preset("tiny_hybrid", HYBRID | {"n_layers": 4, "ffn.hidden": 96})


@pytest.fixture(scope="module")
def single() -> dict:
    return train(0, hybrid(), {}, STEPS, optimizer_name="muonclip", qk_clip_tau=5.0)


@pytest.mark.distributed
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_the_hybrid_under_fsdp2_matches_one_process(single: dict, checkpointing: str) -> None:
    layout = {"activation_checkpoint": checkpointing}
    got = run_ranks(2, train, hybrid(), layout, STEPS, 1, "fp32", 1.0, "", "", "muonclip", 5.0)[0]
    for name, tensor in single["initial"].items():
        assert torch.equal(got["initial"][name], tensor), name
    # Muon's bf16 Newton-Schulz turns reduction-order differences of the gradients into ~1e-4
    # differences of the update (as in tests/parallel/test_muon_fsdp.py), and the losses after
    # it drift: 7e-5 absolute (1.5e-5 relative) by step 3 measured; with AdamW 1e-7
    torch.testing.assert_close(got["losses"], single["losses"], rtol=5e-5, atol=1e-5)
    for name, tensor in single["final"].items():
        torch.testing.assert_close(got["final"][name], tensor, rtol=0, atol=5e-4, msg=name)
    assert got["placements"]["layers.0.attn.conv.weight"] == "(Shard(dim=0),)"
    for name in ("layers.0.attn.conv.weight", "layers.0.attn.A_log", "layers.1.attn.q_proj.weight"):
        assert not torch.equal(single["final"][name], single["initial"][name]), name  # trained
    # QK-clip statistics come from the one softmax-attention layer (layer 3) only
    assert {k for k in single["stats"][-1] if k.startswith("qk/layer")} == {"qk/layer3/max_logit"}


def test_qk_clip_skips_the_linear_layers():
    model = build_model(hybrid(), seed=0)
    enable_qk_clip(model)
    assert [name for name, _ in clip_layers(model)] == ["layers.3.attn"]


def hybrid_moe():
    """The hybrid with MoE FFNs after the first layer (4 experts, top-2, 1 shared)."""
    moe = {"moe.n_routed_experts": 4, "moe.top_k": 2, "moe.n_shared_experts": 1}
    moe |= {"moe.first_k_dense": 1, "moe.expert_hidden": 32, "moe.aux_loss_coef": 0.01}
    return load_preset("tiny_hybrid", HYBRID | {"n_layers": 4, "ffn.hidden": 96} | moe)


@pytest.mark.distributed
def test_the_hybrid_with_moe_ffns_under_expert_parallelism_matches_one_process() -> None:
    single = train(0, hybrid_moe(), {}, 3)
    got = run_ranks(2, train, hybrid_moe(), {"ep": 2}, 3)[0]
    # the tolerance of tests/parallel/test_expert_parallel.py (per-rank balance losses)
    torch.testing.assert_close(got["losses"], single["losses"], rtol=1e-4, atol=1e-5)
    assert got["placements"]["layers.1.ffn.experts.w_up"] != "local"  # the experts are split
    assert [k for k in single["stats"][-1] if k.startswith("moe/")]  # routing statistics came


@pytest.mark.distributed
def test_the_hybrid_under_hsdp_saves_and_resumes_in_another_layout(tmp_path) -> None:
    """HSDP 2 x 2 (4 gloo ranks) for 2 steps, a DCP checkpoint, then 2 more steps on 2 FSDP ranks:
    the losses and final weights of one uninterrupted process (AdamW, fp32)."""
    uninterrupted = train(0, hybrid(), {}, STEPS)
    hsdp = {"dp_replicate": 2, "dp_shard": 2}
    first = run_ranks(4, train, hybrid(), hsdp, 2, 1, "fp32", 1.0, "", str(tmp_path))[0]
    placement = first["placements"]["layers.0.attn.conv.weight"]
    assert placement == "(Replicate(), Shard(dim=0))"
    checkpoint = tmp_path / "step_00000002"
    second = run_ranks(2, train, hybrid(), {}, 2, 1, "fp32", 1.0, str(checkpoint), "")[0]
    losses = first["losses"] + second["losses"]
    torch.testing.assert_close(losses, uninterrupted["losses"], rtol=2e-5, atol=2e-6)
    # Adam's normalized steps turn rounding-order differences of tiny gradients into weight
    # differences of this size (issue 21's loss rounding moved one element to 1.2e-5 over 1e-5)
    for name, tensor in uninterrupted["final"].items():
        torch.testing.assert_close(second["final"][name], tensor, rtol=1e-4, atol=3e-5, msg=name)
