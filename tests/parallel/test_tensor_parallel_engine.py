"""The trainer's engine with parallel.tp on gloo ranks against one process (fp32, AdamW or Muon,
the training hooks: MoE balancing, MTP, ...): the same initial weights, losses, gradient norms
and final weights for every preset family, each built as the trainer builds it (tensor
parallelism, then FSDP2 over the data-parallel ranks of the same root mesh), also with sequence
parallelism (the residual stream, AttnRes's sources and mHC's streams split along the sequence)
and activation checkpointing."""

from __future__ import annotations

import pytest
import torch

from model.transformer import build_model
from tests.parallel.ranks import run_ranks
from tests.parallel.workers import small_model, train

pytestmark = pytest.mark.distributed
STEPS = 3
# fp32: tp ranks sum partial products (row-wise projections, the vocab-parallel loss) in another
# order than one process. AdamW's update m / sqrt(v) of a gradient near 0 turns that rounding into
# up to lr per step on single elements (measured after 3 steps at lr 3e-3: 1.1e-4 on one weight
# of 12,288, 1.4e-4 in norm on mHC's stream mixing), so the final weights compare elementwise to
# WEIGHT_ATOL, 5% of the largest change AdamW can make in the run (3 x lr); the losses and
# gradient norms, which would show a wrong gradient, compare tightly
RTOL, ATOL = 2e-5, 2e-6
WEIGHT_ATOL = 0.05 * STEPS * 3e-3

CASES = {
    "mla": (small_model("tiny_mla"), "adamw"),
    "gdn": (small_model("tiny_hybrid", n_layers=4), "adamw"),
    "kda": (small_model("tiny_kda", n_layers=4), "adamw"),
    "moe": (small_model("tiny_moe"), "adamw"),  # shared experts split, routed ones whole
    "attnres": (small_model("tiny_attnres"), "adamw"),
    "mhc": (small_model("tiny_mhc"), "adamw"),
    "engram": (small_model("tiny_engram", n_layers=4), "adamw"),
    "mtp": (small_model("tiny", **{"mtp.depth": 1}), "adamw"),
    "muon": (small_model("tiny"), "muon"),
}


def train_cases(rank: int, names: list[str], layout: dict) -> dict[str, dict]:
    """Every case of `names` trained on this rank, in one process group."""
    return {name: train(rank, CASES[name][0], layout, STEPS, optimizer_name=CASES[name][1])
            for name in names}  # fmt: skip


def assert_same_run(got: dict, ref: dict, name: str) -> None:
    for key, tensor in ref["initial"].items():
        assert torch.equal(got["initial"][key], tensor), f"{name}: initial {key} differs"
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=RTOL, atol=ATOL, msg=name)
    torch.testing.assert_close(got["norms"], ref["norms"], rtol=1e-4, atol=1e-6, msg=name)
    persistent = build_model(CASES[name][0], device="meta").state_dict().keys()
    for key, tensor in ref["final"].items():
        if key not in persistent:  # statistics of this rank's tokens (mHC's stream RMS)
            continue
        torch.testing.assert_close(
            got["final"][key],
            tensor,
            rtol=0,
            atol=WEIGHT_ATOL,
            msg=lambda m, k=key: f"{name} {k}: {m}",
        )
    assert ref["losses"][-1] < ref["losses"][0], name  # it did train


@pytest.mark.parametrize(
    ("ranks", "layout", "names"),
    [
        (2, {"tp": 2}, ["mla", "moe", "attnres", "mtp", "muon"]),
        (
            4,
            {"tp": 2, "sequence_parallel": True, "activation_checkpoint": "full"},
            ["gdn", "kda", "mhc", "attnres", "mtp"],
        ),
    ],
    ids=["tp2", "dp_shard2_x_tp2_sequence_parallel_checkpointed"],
)
def test_every_family_trains_under_tensor_parallelism_as_one_process(ranks, layout, names):
    single = {name: train(0, CASES[name][0], {}, STEPS, optimizer_name=CASES[name][1])
              for name in names}  # fmt: skip
    results = run_ranks(ranks, train_cases, names, layout)
    for name in names:
        assert_same_run(results[0][name], single[name], name)
        for other in results[1:]:  # every rank logs the same values
            assert other[name]["losses"] == results[0][name]["losses"], name
    placements = results[0][names[0]]["placements"]
    # the vocabulary rows split over tp (innermost), then FSDP2 rows of those over the data ranks
    expected = "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert placements["embed.weight"] == expected, placements


def stream_shapes(rank: int, layout: dict, length: int) -> dict[str, tuple[int, ...]]:
    """The input shapes of a block's norm (on the stream) and of its attention's q projection in
    one forward of `length` tokens through the trainer's engine."""
    from tests.parallel.workers import engine_for

    model = engine_for(small_model("tiny"), layout).model
    shapes: dict[str, tuple[int, ...]] = {}

    def record(name: str):
        def hook(_: torch.nn.Module, args: tuple) -> None:
            shapes.setdefault(name, tuple(args[0].shape))

        return hook

    for name in ("attn_norm", "attn.q_proj"):
        model.layers["0"].get_submodule(name).register_forward_pre_hook(record(name))
    model(torch.zeros(2, length, dtype=torch.long))
    return shapes


@pytest.mark.parametrize(("length", "stream"), [(16, 8), (15, 15)])
def test_sequence_parallelism_splits_the_stream_between_sublayers(length, stream):
    """tp=2: the norms see half the positions, the attention all of them; a length tp does not
    divide keeps the stream whole (the same numbers, no split)."""
    layout = {"tp": 2, "sequence_parallel": True}
    for shapes in run_ranks(2, stream_shapes, layout, length):
        assert shapes == {"attn_norm": (2, stream, 64), "attn.q_proj": (2, length, 64)}
