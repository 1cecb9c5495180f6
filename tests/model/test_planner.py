"""The layout planner (model/planner.py, `python -m model.inspect tp=... dp_shard=...`) against
measurement:

(a) weights, gradients and AdamW moments per rank, measured on gloo ranks of the library's
    tensor parallelism (+ FSDP2): summed over the ranks they equal the planner's exactly (its
    figures are means), and each rank is within one row per parameter of it (uneven shards);
(b) what a forward keeps for backward (saved_tensors_hooks, each storage once, weights apart) on
    one process, without and with full activation checkpointing, within ACTIVATION_MARGIN, and on
    2 tensor-parallel ranks, with and without sequence parallelism;
(c) the bytes a tp rank sends (every collective counted as it runs, in the planner's ring model)
    equal the planner's, with and without sequence parallelism and checkpointing;
(d) the command's new table, JSON fields, and one-line errors for layouts that cannot work.
"""

from __future__ import annotations

import json

import pytest

from model.config import ConfigError
from model.inspect import main
from model.planner import MUON_ROLES, Layout, rank_plan
from model.presets import load_preset
from model.transformer import build_model
from tests.commands import ROOT, run_module
from tests.model.planner_workers import measured_process, measured_rank, measured_split
from tests.parallel.ranks import run_ranks

DENSE = {"vocab_size": 128, "max_seq_len": 64, "d_model": 64, "n_layers": 2}
DENSE |= {"attention.n_heads": 4, "attention.n_kv_heads": 2}
# Engram in blocks 1 and 3, tables of 2 orders x 4 heads (~8k rows each): split by rows over tp
ENGRAM = DENSE | {"n_layers": 4, "engram.table_sizes": [1000, 1000], "engram.dim": 64}
# the activation estimate's constants are fitted on the torch paths (model/planner_activations.py)
ACTIVATION_MARGIN = 0.10


def plan_of(preset: str, overrides: dict, **layout) -> object:
    model = build_model(load_preset(preset, overrides), device="meta")
    return rank_plan(model, Layout(**layout))


def one_row_per_parameter(preset: str, overrides: dict, width: int) -> float:
    """The most a rank's shards can differ from the mean: one (fp32) row of every parameter."""
    model = build_model(load_preset(preset, overrides), device="meta")
    return sum(p.numel() / p.shape[0] * width for p in model.parameters())


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("world", "tp", "ep", "preset", "overrides"),
    [
        (2, 2, 1, "tiny", DENSE | {"attention.qk_norm": True, "tie_embeddings": False}),
        (4, 2, 1, "tiny", DENSE),
        (4, 2, 1, "tiny_moe", DENSE),  # the routed experts replicated over tp, the shared split
        # routed experts whole on the tp ranks, split over ep, sharded over dp_shard / ep (= 1)
        (4, 2, 2, "tiny_moe", DENSE),
        (2, 2, 1, "tiny_hybrid", DENSE | {"n_layers": 4}),  # Gated DeltaNet's plan
        (4, 2, 1, "tiny_engram", ENGRAM),  # Engram's tables by rows over tp, then dp_shard
    ],
    ids=[
        "tp2_qk_norm_untied",
        "dp_shard2_x_tp2",
        "dp_shard2_x_tp2_moe",
        "dp_shard2_x_tp2_x_ep2_moe",
        "tp2_hybrid",
        "dp_shard2_x_tp2_engram",
    ],
)
def test_weights_gradients_and_adamw_state_per_rank_are_measured_ones(
    world, tp, ep, preset, overrides
):
    got = run_ranks(world, measured_rank, preset, overrides, tp, ep)
    layout = {"dp_shard": world // tp, "tp": tp, "ep": ep, "micro_batch_size": 2, "seq_len": 64}
    plan = plan_of(preset, overrides, **layout)
    row = one_row_per_parameter(preset, overrides, 4)
    for key, planned in (("weights", plan.weights), ("grads", plan.grads)):
        assert sum(g[key] for g in got) == pytest.approx(planned * world, rel=1e-9), key
        for rank in got:
            assert abs(rank[key] - planned) <= row, (key, rank[key], planned)
    # AdamW: two fp32 moments per element (its step counters, 4 bytes per tensor, left out)
    assert sum(g["optimizer"] for g in got) == pytest.approx(plan.optimizer * world, rel=1e-9)
    if world == tp:  # tensor parallelism alone: the activations each rank keeps
        for rank in got:
            assert rank["activations"] == pytest.approx(plan.activations, rel=ACTIVATION_MARGIN)


# (preset, overrides, sequence_parallel, whether the planner models its activations): each
# layer kind's tp collectives (QK-norm's and the gated norms' gains, the conv/decay head rows,
# MLA's rope key, the shared expert), sequence parallelism's gathers, and mHC's n-stream state
SPLIT_CASES = {
    "tiny_qk_norm": ("tiny", DENSE | {"attention.qk_norm": True}, False, True),
    "tiny_qk_norm_sp": ("tiny", DENSE | {"attention.qk_norm": True}, True, True),
    "tiny_mla_sp": ("tiny_mla", DENSE, True, True),
    "tiny_hybrid_sp": ("tiny_hybrid", DENSE | {"n_layers": 4}, True, True),
    "tiny_moe": ("tiny_moe", DENSE, False, True),  # each rank's positions, summed
    # the shared experts' gate: its gradient summed over tp (the experts' outputs are partial)
    "tiny_moe_gated_sp": ("tiny_moe", DENSE | {"moe.shared_expert_gate": True}, True, True),
    "tiny_moe_sp": ("tiny_moe", DENSE, True, True),
    "tiny_mhc_sp": ("tiny_mhc", DENSE, True, False),  # (mHC's own activations: not modelled)
    "tiny_engram": ("tiny_engram", ENGRAM, False, False),  # the tables' lookups (not modelled)
}


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_a_tp_rank_keeps_and_sends_what_the_plan_says(case):
    """2 tensor-parallel gloo ranks, without and with full checkpointing: the bytes each sends
    in a step equal the plan (every collective counted: the rowwise outputs, the colwise
    inputs' gradients, the head-shared gains' and rows' gradients, MLA's rope key, the
    embedding and the loss, and with sequence parallelism each sublayer's gathers, the
    recompute's and the split region's gradient sum); the activations within the margin."""
    preset, overrides, sequence_parallel, modelled = SPLIT_CASES[case]
    ranks = run_ranks(2, measured_split, preset, overrides, sequence_parallel)
    for ac in ("none", "full"):
        plan = plan_of(
            preset,
            overrides,
            tp=2,
            micro_batch_size=2,
            seq_len=64,
            sequence_parallel=sequence_parallel,
            activation_checkpoint=ac,
        )
        for rank in (r[ac] for r in ranks):
            assert sum(rank["sent"].values()) == pytest.approx(plan.comm_tp, rel=1e-9), (
                ac,
                rank["sent"],
            )
            if modelled:
                # full checkpointing's forward keeps the block inputs; the recompute comes later
                planned = plan.activations_checkpointed - plan.recompute
                planned = plan.activations if ac == "none" else planned
                assert rank["activations"] == pytest.approx(planned, rel=ACTIVATION_MARGIN), ac


def test_sequence_parallelism_trades_gathers_for_the_stream_memory():
    """The stream between the sublayers (norm inputs, checkpointed block inputs) on T / tp
    positions; two all-gathers of (B, T, C) per whole-sequence sublayer (its input in forward,
    its output's gradient in backward) plus the stream's first and last, and the recompute's;
    a reduce-scatter of each sublayer's output in place of its all-reduce."""
    T, C, layers = 64, 64, 2
    tokens = {"micro_batch_size": 2, "seq_len": T}
    base = plan_of("tiny", DENSE, tp=2, **tokens)
    split = plan_of("tiny", DENSE, tp=2, sequence_parallel=True, **tokens)
    norms = layers * 2 * (C + 1) * 2 * T * 4  # per sublayer: the norm's input and statistic
    assert base.activations - split.activations == pytest.approx(norms / 2)
    inputs = layers * C * 2 * T * 4  # the checkpointed block inputs (the recompute apart)
    kept = [p.activations_checkpointed - p.recompute for p in (base, split)]
    assert kept[0] - kept[1] == pytest.approx(inputs / 2)
    gains = layers * 2 * C * 4  # the norms' weight gradients, summed once a step
    gathers = (2 * 2 * layers + 2) * 2 * T * C * 4 / 2
    # each sublayer's output reduce-scattered ((p - 1) / p of it) instead of all-reduced (twice)
    scatters = 2 * layers * 2 * T * C * 4 / 2
    assert split.comm_tp - base.comm_tp == pytest.approx(gathers + gains - scatters)
    ac = {"activation_checkpoint": "full"}
    recompute = 2 * layers * 2 * T * C * 4 / 2
    # the recompute's gathers and the attention's reduce-scatter (the FFN's, last, is not redone)
    assert plan_of(
        "tiny", DENSE, tp=2, sequence_parallel=True, **tokens, **ac
    ).comm_tp - split.comm_tp == pytest.approx(recompute + layers * 2 * T * C * 4 / 2)


@pytest.mark.parametrize("preset", ["tiny", "tiny_moe", "tiny_hybrid"])
@pytest.mark.parametrize("ac", ["none", "full"])
def test_activations_within_the_margin_of_what_a_forward_keeps(preset, ac):
    # a small vocabulary: the head's weight gradient (V x C, saved once) would hide the blocks'
    overrides, B, T = {"vocab_size": 512, "max_seq_len": 256}, 2, 128
    measured = measured_process(preset, overrides, ac, B, T)
    plan = plan_of(preset, overrides, micro_batch_size=B, seq_len=T)
    # full checkpointing's forward keeps the block inputs; the recompute comes in backward
    planned = plan.activations if ac == "none" else plan.activations_checkpointed - plan.recompute
    assert planned == pytest.approx(measured, rel=ACTIVATION_MARGIN)
    if ac == "full":
        assert plan.activations_checkpointed < plan.activations / 2


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_optimizer_state_is_what_the_optimizer_keeps(name):
    """Muon: one fp32 momentum for the roles it orthogonalizes, AdamW's two moments for the
    rest (embedding, norms), as optim/ builds them; measured after one step on one process."""
    import torch

    from optim.builder import build_optimizer
    from optim.config import OptimConfig
    from optim.roles import ROLE_SETTINGS

    assert {role for role, s in ROLE_SETTINGS.items() if s.muon} == MUON_ROLES
    model = build_model(load_preset("tiny_moe", DENSE), seed=0)
    optimizer = build_optimizer(OptimConfig(name=name), model)
    tokens = torch.randint(0, 128, (2, 17))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    kept = sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim() > 0  # (not the step counters)
    )
    assert plan_of("tiny_moe", DENSE, optimizer=name).optimizer == kept


def test_layouts_move_memory_and_traffic_as_they_should():
    """Sharding divides the state; tp divides the split weights and adds all-reduces; ep adds
    all-to-all and shrinks the gathered expert units; HSDP adds an all-reduce."""
    base = plan_of("tiny_moe", {}, seq_len=256)
    sharded = plan_of("tiny_moe", {}, dp_shard=4, seq_len=256)
    assert sharded.weights == pytest.approx(base.weights / 4)
    assert base.comm == 0 and sharded.comm_all_gather > 0 and sharded.comm_reduce_scatter > 0
    experts = plan_of("tiny_moe", {}, dp_shard=4, ep=4, seq_len=256)
    assert experts.weights == pytest.approx(sharded.weights) and experts.comm_ep > 0
    assert (
        experts.transient < sharded.transient and experts.comm_all_gather < sharded.comm_all_gather
    )
    split = plan_of("tiny", {}, tp=2, seq_len=256)
    assert split.weights < plan_of("tiny", {}, seq_len=256).weights * 0.55  # norms stay whole
    assert split.comm_tp > 0 and split.comm_all_gather == 0
    hsdp = plan_of("tiny", {}, dp_replicate=2, dp_shard=2, seq_len=256)
    assert hsdp.comm_hsdp_all_reduce > 0


def test_context_parallelism_shards_with_the_data_ranks_and_divides_the_tokens():
    """cp ranks shard the weights as data ranks do; each computes T / cp positions (the
    per-token activations halve) and keeps every rank's keys and values of one layer; the
    longest seq_len that fits a budget is the last multiple of 2 cp within it."""
    from model.planner import largest_seq_len

    dp = plan_of("tiny", {}, dp_shard=2, seq_len=512)
    cp = plan_of("tiny", {}, cp=2, seq_len=512)
    assert cp.weights == pytest.approx(dp.weights) and cp.comm_cp > 0 and dp.comm_cp == 0
    assert cp.comm_all_gather == pytest.approx(dp.comm_all_gather)
    assert dp.activations / 2 < cp.activations < dp.activations * 0.6  # + the gathered K/V
    model = build_model(load_preset("tiny", {}), device="meta")
    layout = Layout(cp=4, seq_len=8)
    budget = 2 * rank_plan(model, Layout(cp=4, seq_len=4096)).total
    longest = largest_seq_len(model, layout, budget)
    assert longest % 8 == 0 and longest > 4096
    fits = rank_plan(model, Layout(cp=4, seq_len=longest)).total
    assert fits <= budget < rank_plan(model, Layout(cp=4, seq_len=longest + 8)).total
    assert largest_seq_len(model, layout, 1.0) == 0


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ({"cp": 4, "seq_len": 36}, "cp=4 splits seq_len=36 into 2 x cp chunks: make seq_len a"),
        ({"dp_shard": 2, "ep": 4}, "ep=4 must divide dp_shard=2"),
        ({"dp_shard": 3, "ep": 3}, "ep=3 must divide the model's 8 routed experts"),
        ({"tp": 3}, "parallel.tp=3 must divide the attention's 4 query heads"),
        ({"optimizer": "sgd"}, "optimizer='sgd'; choose adamw or muon"),
        ({"sequence_parallel": True}, "sequence_parallel=true splits .* set tp > 1"),
    ],
)
def test_a_layout_that_cannot_work_is_refused_in_one_line(layout, message):
    with pytest.raises(ConfigError, match=message):
        plan_of("tiny_moe", {}, **layout)


def test_the_command_prints_the_plan_and_refuses_a_bad_layout_in_one_line(tmp_path):
    table = run_module("model.inspect", "dp_shard=2", "tp=2", "micro_batch_size=4", cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    out = table.stdout
    assert "tp 2 (4 ranks)" in " ".join(out.split())  # the title, however rich wraps it
    for row in ("Per rank: memory", "optimizer state", "activations (full checkpointing)"):
        assert row in out
    assert "TP all-reduce/gather (tp)" in out and "Per rank: sent per step" in out
    bad = run_module("model.inspect", "model=tiny", "tp=3", cwd=ROOT)
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: parallel.tp=3 must divide the attention's"
    )


def test_json_keeps_the_old_fields_and_adds_the_plan(capsys):
    assert main(["model=tiny", "dp_shard=4", "tp=2", "ep=1", "format=json"]) == 0
    row = json.loads(capsys.readouterr().out)["tiny"]
    assert row["train_state_bytes_per_device"] == row["train_state_bytes"] / 4  # as before
    assert (row["dp_shard"], row["tp"]) == (4, 2)
    for key in ("rank_weights", "rank_optimizer", "rank_activations", "rank_comm_tp"):
        assert row[key] > 0
    assert main(["model=tiny", "cp=2", "seq_len=1024", "memory_gib=1", "format=json"]) == 0
    row = json.loads(capsys.readouterr().out)["tiny"]
    assert row["cp"] == 2 and row["rank_comm_cp"] > 0 and row["rank_largest_seq_len"] > 1024
