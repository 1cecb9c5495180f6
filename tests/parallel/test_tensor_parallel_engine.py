"""The trainer's engine with parallel.tp on gloo ranks against one process (fp32, AdamW or Muon,
the training hooks: MoE balancing, MTP, ...): the same initial weights, losses, gradient norms
and final weights for every preset family, each built as the trainer builds it (tensor
parallelism, then FSDP2 over the data-parallel ranks of the same root mesh), also with sequence
parallelism (the residual stream, AttnRes's sources and mHC's streams split along the sequence)
and activation checkpointing."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from model.transformer import build_model
from parallel.engine import plain_loss
from tests.parallel.ranks import run_ranks
from tests.parallel.workers import engine_for, global_batches, local_batch, small_model, train

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
# Engram's gate sigmoid(sign(s) sqrt|s|) has the derivative 1 / (2 sqrt|s|): where a token's score s
# is near 0 (6.6e-4 in layer 1 of this batch) the gate path's gradients (keys, its norms, the
# tables through them) carry tp's 1e-7 rounding of the residual stream up to 1.3e-5 relative at
# the first step (every other weight: 1e-6), and Adam turns the elements whose gradient is near 0
# into lr-sized differences. One process whose Engram inputs are perturbed by 3e-8 (relative)
# moves as far: step 3's gradient norm 4.6e-4 relative, `table` and `keys` elements by 3.7e-3. So
# the engram run compares its norms to 1e-3 (measured 2.7e-4) and each weight's whole update
# (final - initial) to 5% of its norm (measured 2.3% on layer 1's keys); its first-step gradients
# compare tightly (test_engram_gradients_under_tensor_parallelism_equal_one_process, which also
# covers model.engram.sharding=replicated: it trains to the same numbers as "rows" under tp)
ENGRAM_NORM_RTOL, ENGRAM_UPDATE_RTOL = 1e-3, 5e-2

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
    norm_rtol = ENGRAM_NORM_RTOL if name == "engram" else 1e-4
    torch.testing.assert_close(got["norms"], ref["norms"], rtol=norm_rtol, atol=1e-6, msg=name)
    if name == "engram":
        assert_same_updates(got, ref, name)
        return
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


def assert_same_updates(got: dict, ref: dict, name: str) -> None:
    """Each weight's change over the run (final - initial) equal to one process's within
    ENGRAM_UPDATE_RTOL of its norm (a wrong gradient or optimizer step moves it by far more)."""
    for key, final in ref["final"].items():
        if not final.is_floating_point():  # Engram's hash multipliers, token maps
            assert torch.equal(got["final"][key], final), f"{name} {key}"
            continue
        ref_update = final - ref["initial"][key]
        error = (got["final"][key] - ref["initial"][key] - ref_update).norm()
        limit = ENGRAM_UPDATE_RTOL * ref_update.norm() + 1e-6
        assert error <= limit, f"{name} {key}: update differs by {error:.3g} > {limit:.3g}"


@pytest.mark.parametrize(
    ("ranks", "layout", "names"),
    [
        (2, {"tp": 2}, ["mla", "moe", "attnres", "mtp", "muon"]),
        (
            4,
            {"tp": 2, "sequence_parallel": True, "activation_checkpoint": "full"},
            ["gdn", "kda", "mhc", "attnres", "mtp", "engram"],
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
    if "engram" in names:  # Engram's tables split by rows the same way
        tables = results[0]["engram"]["placements"]
        assert tables["layers.1.engram.table.weight"] == expected, tables


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


ENGRAM_SHARDINGS = {
    sharding: small_model("tiny_engram", n_layers=4, **{"engram.sharding": sharding})
    for sharding in ("rows", "replicated")
}
ENGRAM_LAYOUTS = {"tp2": {"tp": 2}, "tp2_sp": {"tp": 2, "sequence_parallel": True}}


def first_gradients(rank: int, layouts: dict[str, dict]) -> dict[tuple[str, str], dict]:
    """For each layout and Engram sharding: the first batch's forward and backward through the
    trainer's engine, then its gradient synchronization and norm (not clipped): the norm and
    every whole gradient (dense)."""
    out = {}
    for layout_name, layout in layouts.items():
        for sharding, cfg in ENGRAM_SHARDINGS.items():
            engine = engine_for(cfg, layout)
            batch = local_batch(global_batches(1, cfg.vocab_size)[0], engine.ranks_per_forward)
            engine.forward_backward(batch.inputs, batch.targets, None, 1, True, plain_loss)
            norm = float(engine.clip_gradients(float("inf")))
            grads = {}
            for name, p in engine.model.named_parameters():
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                grads[name] = g.to_dense() if g.is_sparse else g.clone()
            out[layout_name, sharding] = {"norm": norm, "grads": grads}
    return out


def test_engram_gradients_under_tensor_parallelism_equal_one_process():
    """dp_shard=2 x tp=2, with and without sequence parallelism: Engram's tables (FSDP2 units by
    rows, or whole on every rank with sparse gradients averaged over the world, tp copies
    included) and its modules without a tp plan get one process's gradients and norm: every
    gradient to 1e-4 of its norm (the gate path's rounding: 1.3e-5, see ENGRAM_NORM_RTOL)."""
    single = first_gradients(0, {"one process": {}})
    results = run_ranks(4, first_gradients, ENGRAM_LAYOUTS)
    for (layout, sharding), got in results[0].items():
        ref = single["one process", sharding]
        for rank, result in enumerate(results):
            got = result[layout, sharding]
            where = f"{layout}, {sharding}, rank {rank}"
            assert got["norm"] == pytest.approx(ref["norm"], rel=1e-5), where
            for name, grad in ref["grads"].items():
                error = (got["grads"][name] - grad).norm()
                assert error <= 1e-4 * grad.norm() + 1e-7, f"{where} {name}: {error:.3g}"


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_expert_parallelism_composes_with_tensor_parallelism(sequence_parallel):
    """parallel.ep=2 borrows its ranks from dp_shard; with tp=2 each tp rank's ep group
    exchanges the tokens of that rank's positions (routed experts whole on the tp ranks,
    shared experts split). Against ep=2 without tp (the same 2 data-parallel ranks: expert
    parallelism alone differs from one process by its own routing tolerance,
    tests/parallel/test_expert_parallel.py): the same losses, norms and weights, with and
    without sequence parallelism."""
    ep_only = run_ranks(2, train_cases, ["moe"], {"ep": 2})[0]["moe"]
    layout = {"ep": 2, "tp": 2, "sequence_parallel": sequence_parallel}
    results = run_ranks(4, train_cases, ["moe"], layout)
    assert_same_run(results[0]["moe"], ep_only, "moe")
    placements = results[0]["moe"]["placements"]
    # 4 of the 8 experts on each ep rank (FSDP2 over dp_shard / ep = 1 rank keeps them whole)
    assert placements["layers.1.ffn.experts.w_gate"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"


def routed_tokens(rank: int, layout: dict, overrides: dict | None = None) -> list[int]:
    """The tokens each MoE layer sends through its routed experts in one forward of 2 x 16
    tokens through the trainer's engine."""
    from tests.parallel.workers import engine_for

    model = engine_for(small_model("tiny_moe", **(overrides or {})), layout).model
    counts: list[int] = []
    for block in model.layers.values():
        moe = block.ffn
        if hasattr(moe, "local_positions"):
            route = moe._route
            moe._route = lambda flat, *rest, route=route: (
                counts.append(len(flat)),
                route(flat, *rest),
            )[1]
    model(torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long))
    return counts


def test_the_tp_ranks_share_the_expert_work():
    """tp=2, with and without sequence parallelism: each rank's routed experts take its 16 of
    the 32 tokens, and training equals one process (the router sees every token: its balance
    losses and bias updates are the whole sequence's; tp=2 without sequence parallelism:
    test_every_family_trains_under_tensor_parallelism_as_one_process). A capacity factor keeps
    every token on every rank (its drops would depend on the split). (With dp_shard=2 too:
    test_expert_parallelism_composes_with_tensor_parallelism.)"""
    single = train(0, CASES["moe"][0], {}, STEPS)
    layout = {"tp": 2, "sequence_parallel": True}
    assert_same_run(run_ranks(2, train_cases, ["moe"], layout)[0]["moe"], single, "moe")
    for counts in run_ranks(2, routed_tokens, {"tp": 2, "sequence_parallel": True}):
        assert counts == [16]
    for counts in run_ranks(2, routed_tokens, {"tp": 2}):
        assert counts == [16]
    for counts in run_ranks(2, routed_tokens, {"tp": 2}, {"moe.capacity_factor": 1.25}):
        assert counts == [32]
