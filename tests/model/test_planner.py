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
(d) the command's new table, JSON fields, and one-line errors for layouts that cannot work;
(e) pipeline parallelism: the stage split the command prints is the trainer's, each pipeline
    rank's weights (parameter counts) and traffic (hand formulas, and measured on gloo ranks of
    the pipeline engine), the micro-batches a stage keeps in flight (torch's own action lists).
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


# -- pipeline parallelism (pp) -------------------------------------------------------------
# (4 blocks of 49,280 parameters, embedding and head 128 x 64 each)
EVEN = DENSE | {"n_layers": 4, "tie_embeddings": False}


def pipeline_plans(preset: str, overrides: dict, **layout) -> list:
    from model.planner_pipeline import pipeline_rank_plans

    model = build_model(load_preset(preset, overrides), device="meta")
    return pipeline_rank_plans(model, Layout(**layout))


def test_the_command_prints_the_trainers_stage_split(capsys):
    """One line per stage (its pipeline rank, blocks, embedding or head) from
    model/stages.py's pipeline_layouts and stage_rank, as the trainer splits and places them,
    and each pipeline rank's total; the per-rank rows are the heaviest rank's."""
    from model.stages import pipeline_layouts, stage_rank

    model = build_model(load_preset("tiny", {}), device="meta")
    for schedule, v_style in (("Interleaved1F1B", False), ("ZBVZeroBubble", True)):
        args = ["model=tiny", "pp=2", f"pp_schedule={schedule}", "seq_len=512"]
        assert main([*args, "format=json"]) == 0
        row = json.loads(capsys.readouterr().out)["tiny"]
        stages = pipeline_layouts(model, 512, 2, schedule, 0, ())
        assert row["pp_stages"] == len(stages) == 4 and row["pp_microbatches"] == 4
        for stage in stages:
            where = f"rank {stage_rank(stage.index, 2, v_style)}: "
            assert row[f"pp_stage_{stage.index}"] == where + stage.describe().split(": ", 1)[1]
        totals = [row[f"pp_rank_{r}_total"] for r in range(2)]
        assert row["rank_total"] == max(totals) == totals[row["pp_rank"]]
        assert main(args) == 0
        table = capsys.readouterr().out
        assert "Pipeline (pp)" in table and "PP stage boundaries" in table
        for stage in stages:
            assert row[f"pp_stage_{stage.index}"] in table
    assert main(["model=tiny", "pp=2", "pp_layers=1,5", "format=json"]) == 0
    row = json.loads(capsys.readouterr().out)["tiny"]
    assert row["pp_stage_0"] == "rank 0: embedding, layer 0"
    assert row["pp_stage_1"] == "rank 1: layers 1-5, head + loss"


def test_two_pipeline_ranks_hold_the_weights_of_their_stages():
    """A dense untied model of 4 even blocks on pp=2: rank 0 the embedding and blocks 0-1, rank
    1 blocks 2-3, the final norm and the head (parameter counts); together the whole model. A
    tied head adds the embedding's copy on the last stage, under FSDP2 sharded like the rest."""
    model = build_model(load_preset("tiny", EVEN), device="meta")
    block = sum(p.numel() for p in model.layers["0"].parameters())  # 49,280
    V_C, C = model.embed.weight.numel(), model.cfg.d_model
    whole = plan_of("tiny", EVEN, seq_len=64)
    first, last = pipeline_plans("tiny", EVEN, pp=2, seq_len=64)
    assert first.weights == 4 * (V_C + 2 * block) and first.optimizer == 8 * (V_C + 2 * block)
    assert last.weights == 4 * (2 * block + C + V_C)
    assert first.weights + last.weights == whole.weights
    tied = DENSE | {"n_layers": 4}
    first, last = pipeline_plans("tiny", tied, pp=2, dp_shard=2, seq_len=64)
    assert (
        last.weights == 4 * (2 * block + C + V_C) / 2 and first.weights == last.weights - 4 * C / 2
    )


def test_comm_pp_is_the_stage_boundaries_and_the_shared_embedding():
    """For `tiny` (B 2, T 64, C 64, V 128, tied): m micro-batches of the stream's (B, T, C) sent
    forward from each stage but the last, their gradients back from each but the first, and the
    tied embedding's fp32 gradient shard all-reduced between the first and last rank (a ring of
    2 sends its size); none between two stages of one rank (ZBV's middle)."""
    B, T, C, V, m = 2, 64, 64, 128, 4
    shape = {"micro_batch_size": B, "seq_len": T, "pp_microbatches": m}
    boundary, embedding = m * B * T * C * 4, V * C * 4
    first, last = pipeline_plans("tiny", DENSE | {"n_layers": 4}, pp=2, **shape)
    assert first.comm_pp == last.comm_pp == boundary + embedding
    ranks = pipeline_plans("tiny", DENSE | {"n_layers": 4}, pp=4, param_dtype="bf16", **shape)
    assert [r.comm_pp for r in ranks] == [
        boundary / 2 + embedding,
        boundary,  # forward and backward, bf16
        boundary,
        boundary / 2 + embedding,
    ]
    untied = pipeline_plans("tiny", EVEN, pp=2, dp_shard=2, **shape)
    assert [r.comm_pp for r in untied] == [boundary, boundary]
    # V: rank 0 runs stages 0 and 3 (blocks 0 and 3), rank 1 stages 1 and 2: the embedding's
    # gradient stays on rank 0, where the last stage keeps a copy of it (weights: 2 V C)
    v = {"pp": 2, "pp_schedule": "ZBVZeroBubble"}
    zbv = pipeline_plans("tiny", DENSE | {"n_layers": 4}, **v, **shape)
    assert [r.comm_pp for r in zbv] == [2 * boundary, 2 * boundary]
    model = build_model(load_preset("tiny", EVEN), device="meta")
    block = sum(p.numel() for p in model.layers["0"].parameters())
    assert zbv[0].weights == 4 * (2 * V * C + 2 * block + C)


def test_a_stage_keeps_the_micro_batches_in_flight_gpipe_all_1f1b_pp_minus_rank():
    """One micro-batch per stage: the two stages keep what one process keeps, plus the output
    the first sent (held for its backward, (B, T, C) fp32) and the token ids both read (8 bytes
    each). With m = 8, GPipe keeps all 8 on every rank, 1F1B min(m, pp - r): 2 on rank 0, 1 on
    rank 1, with and without full checkpointing (whose one block's recompute is not per
    micro-batch)."""
    B, T, C = 2, 64, 64
    shape = {"micro_batch_size": B, "seq_len": T}
    whole = plan_of("tiny", EVEN, **shape)
    first, last = pipeline_plans("tiny", EVEN, pp=2, pp_microbatches=1, **shape)
    assert first.activations + last.activations == whole.activations + B * T * (C * 4 + 8)
    for ac in ("none", "full"):
        kw = shape | {"pp": 2, "pp_microbatches": 8, "activation_checkpoint": ac}
        gpipe = pipeline_plans("tiny", EVEN, pp_schedule="GPipe", **kw)
        one_f_one_b = pipeline_plans("tiny", EVEN, **kw)
        for rank, held in ((0, 2), (1, 1)):
            a, b = gpipe[rank], one_f_one_b[rank]
            if ac == "none":
                assert a.activations == pytest.approx(8 / held * b.activations, rel=1e-12)
            else:
                kept = a.activations_checkpointed - a.recompute
                assert kept == pytest.approx(8 / held * (b.activations_checkpointed - b.recompute))
        assert gpipe[0].total > one_f_one_b[0].total


def _torch_actions(schedule: str, pp: int, m: int, v: int = 2) -> dict[int, list]:
    """torch.distributed.pipelining's own action list of each rank for a multi-stage schedule of
    v stages per rank, computed without stages or a process group: only the attributes its
    `_calculate_single_rank_operations` reads are set (torch's internals: a new torch that
    changes them fails here, and model/planner_activations.py's counts need a look)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    cls = get_schedule_class(schedule)
    order = cls.__new__(cls)
    order.pp_group_size, order.n_local_stages, order._n_microbatches = pp, v, m
    order.number_of_rounds = max(1, m // pp)
    order.microbatches_per_round = m // order.number_of_rounds
    order.num_stages = order._num_stages = v * pp
    order._stages = [None] * v
    return {r: order._calculate_single_rank_operations(r) for r in range(pp)}


def _held_over_time(actions: list) -> list[dict[int, int]]:
    """Micro-batches each stage holds after every action: from its forward until its full
    backward or its weight pass (overlapped forward-backward actions counted as their parts)."""
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    held: set[tuple[int, int]] = set()
    states = []
    for action in (a for a in actions if a is not None):
        parts = action.sub_actions if action.computation_type == Kind.OVERLAP_F_B else [action]
        for part in parts:
            key = (part.stage_index, part.microbatch_index)
            if part.computation_type == Kind.FORWARD:
                held.add(key)
            elif part.computation_type in (Kind.FULL_BACKWARD, Kind.BACKWARD_WEIGHT):
                held.discard(key)
            states.append({s: sum(1 for h, _ in held if h == s) for s in {h for h, _ in held}})
    return states


@pytest.mark.parametrize(
    "schedule",
    ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"],
)
def test_in_flight_counts_are_the_schedules_own(schedule):
    """model/planner_activations.py's counts for 2 stages per rank equal what torch's action lists
    hold: per stage and together, and the peak of any per-micro-batch sizes of the two stages
    (the heaviest stage filled first), for pp 2-4 and every number of micro-batches the
    schedule takes up to 4 pp; with 3 stages per rank the total too, and the peak a bound."""
    from model.planner_activations import in_flight, pipeline_peak
    from model.stages import V_SCHEDULES, stage_rank

    for pp in (2, 3, 4):
        for m in range(1, 4 * pp + 1):
            if m % max(1, m // pp) or (schedule == "DualPipeV" and m < 2 * pp):
                continue  # (the schedule refuses these)
            for rank, actions in _torch_actions(schedule, pp, m).items():
                v_style = schedule in V_SCHEDULES
                stages = [s for s in range(2 * pp) if stage_rank(s, pp, v_style) == rank]
                states = _held_over_time(actions)
                caps, total = in_flight(schedule, pp, m, 2, rank)
                assert caps == [max(s.get(i, 0) for s in states) for i in stages], (pp, m, rank)
                assert total == max(sum(s.values()) for s in states), (pp, m, rank)
                for sizes in ((1.0, 3.0), (3.0, 1.0), (1.0, 1.0)):
                    peak = max(sum(s.get(i, 0) * x for i, x in zip(stages, sizes)) for s in states)
                    assert pipeline_peak(list(sizes), caps, total) == peak, (pp, m, rank, sizes)
            if schedule in V_SCHEDULES:
                continue
            # 3 stages per rank: the total exact, the peak an upper bound
            for rank, actions in _torch_actions(schedule, pp, m, 3).items():
                states = _held_over_time(actions)
                caps, total = in_flight(schedule, pp, m, 3, rank)
                assert total == max(sum(s.values()) for s in states), (pp, m, rank)
                stages = [rank, rank + pp, rank + 2 * pp]
                sizes = (3.0, 1.0, 2.0)
                peak = max(sum(s.get(i, 0) * x for i, x in zip(stages, sizes)) for s in states)
                assert pipeline_peak(list(sizes), caps, total) >= peak


@pytest.mark.parametrize(
    ("overrides", "layout", "message"),
    [
        ({}, {"pp_layers": (1, 2)}, r"parallel.pp_layers=\[1, 2\] must list the layers of each"),
        (
            {},
            {"pp_layers": (3, 3, 0)},
            r"of the 2 stages \(pp x stages per rank; at least 1 each\), summing to",
        ),
        ({}, {"pp_schedule": "zero"}, "parallel.pp_schedule='zero' is not one of GPipe"),
        ({}, {"pp_schedule": "GPipe", "pp_stages_per_rank": 2}, "runs one stage per rank"),
        ({}, {"pp": 4, "pp_schedule": "Interleaved1F1B"}, "8 pipeline stages for 6 layers"),
        ({}, {"pp_schedule": "Interleaved1F1B", "pp_microbatches": 5}, "multiple of 2"),
        ({}, {"pp_schedule": "DualPipeV", "pp_microbatches": 3}, "at least 4"),
        ({"mtp.depth": 1}, {"pp_schedule": "zbvzerobubble"}, "splits the backward"),
        ({}, {"tp": 2, "sequence_parallel": True}, "sequence_parallel=true with pp > 1"),
        ({}, {"pp_microbatches": -1}, r"pp_microbatches=-1 must be >= 0"),
    ],
)
def test_a_pipeline_that_cannot_work_is_refused_in_one_line(overrides, layout, message):
    with pytest.raises(ConfigError, match=message) as refused:
        plan_of("tiny", overrides, **({"pp": 2, "seq_len": 64} | layout))
    assert "\n" not in str(refused.value)


# (preset, model overrides, parallel layout, ranks): tests/parallel/workers.py's model (4 blocks,
# C 64, V 128) and batch (8 rows of 16 tokens), in 4 micro-batches
PIPELINE_CASES = {
    "1f1b_tied": ("tiny", {}, {"pp": 2}, 2),  # the tied embedding's gradient all-reduced
    "zbv_tied": ("tiny", {}, {"pp": 2, "pp_schedule": "ZBVZeroBubble"}, 2),  # (one rank: a copy)
    "interleaved_untied_dp2": (
        "tiny",
        {"tie_embeddings": False},
        {"pp": 2, "pp_schedule": "Interleaved1F1B", "dp_shard": 2},
        4,
    ),
    "gpipe_dp2": ("tiny", {}, {"pp": 2, "pp_schedule": "GPipe", "dp_shard": 2}, 4),  # its shard
    "mhc": ("tiny_mhc", {}, {"pp": 2}, 2),  # n streams cross
    "attnres": ("tiny_attnres", {}, {"pp": 2}, 2),  # the depth sources cross
    "mtp": ("tiny", {"mtp.depth": 1}, {"pp": 2}, 2),  # the embedding shared with MTP
}


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(PIPELINE_CASES))
def test_a_pipeline_rank_sends_what_the_plan_says(case):
    """One step of the trainer's pipeline engine on gloo ranks: the bytes each rank sends to the
    other stages (and the shared embedding's gradient all-reduce) equal comm_pp, and FSDP2's
    all-gather and reduce-scatter (once a step: the gathered weights stay for its micro-batches)
    the plan's."""
    from tests.model.planner_workers import measured_pipeline
    from tests.parallel.workers import SMALL

    preset, overrides, layout, world = PIPELINE_CASES[case]
    model_overrides = SMALL | {"n_layers": 4} | overrides
    got = run_ranks(
        world, measured_pipeline, {"n_layers": 4, "preset": preset} | overrides, layout, 4
    )
    rows = 8 // (world // layout["pp"]) // 4  # a data rank's rows per micro-batch
    plans = pipeline_plans(
        preset, model_overrides, micro_batch_size=rows, seq_len=16, pp_microbatches=4, **layout
    )
    for rank, sent in enumerate(got):
        plan = plans[rank // (world // layout["pp"])]
        assert sent["pp"] == plan.comm_pp, (rank, sent)
        assert sent["fsdp"] == pytest.approx(plan.comm_all_gather + plan.comm_reduce_scatter)
