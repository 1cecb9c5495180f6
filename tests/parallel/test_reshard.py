"""DCP checkpoints written by one layout resume in another (2 -> 1, 1 -> 2, 2 -> 4 ranks): the
model and optimizer states are resharded on load and training continues as if uninterrupted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.parallel.ranks import run_ranks
from tests.parallel.workers import small_model, train

pytestmark = pytest.mark.distributed
BEFORE, AFTER = 2, 2


@pytest.fixture(scope="module")
def uninterrupted() -> dict:
    return train(0, small_model(), {}, BEFORE + AFTER)


def _run(ranks: int, **kwargs) -> dict:
    if ranks == 1:
        return train(0, small_model(), {}, **kwargs)
    return run_ranks(ranks, train, small_model(), {}, *_positional(kwargs))[0]


def _positional(kwargs: dict) -> tuple:
    # train(rank, model_cfg, layout, steps, micro_batches, precision, grad_clip, resume_from, save_to)
    return (
        kwargs["steps"],
        1,
        "fp32",
        1.0,
        kwargs.get("resume_from", ""),
        kwargs.get("save_to", ""),
    )


@pytest.mark.parametrize(("save_ranks", "load_ranks"), [(2, 1), (1, 2), (2, 4)])
def test_resume_in_another_layout_continues_the_run(
    tmp_path: Path, uninterrupted: dict, save_ranks: int, load_ranks: int
) -> None:
    first = _run(save_ranks, steps=BEFORE, save_to=str(tmp_path))
    checkpoint = tmp_path / "step_00000002"
    assert (checkpoint / ".metadata").is_file()
    second = _run(load_ranks, steps=AFTER, resume_from=str(checkpoint))
    losses = first["losses"] + second["losses"]
    torch.testing.assert_close(losses, uninterrupted["losses"], rtol=2e-5, atol=2e-6)
    for name, tensor in uninterrupted["final"].items():
        torch.testing.assert_close(second["final"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    ("preset", "layout", "ranks"),
    [
        ("tiny", {}, 2),
        ("tiny_moe", {"ep": 2}, 2),  # experts split over the 2 ranks
        ("tiny_moe", {"ep": 2}, 4),  # experts over 2 ranks, each expert FSDP-sharded over 2
        ("tiny_moe", {"dp_replicate": 2}, 4),  # HSDP: shards over 2, replicated twice
    ],
)
def test_a_run_starts_from_whole_weights_in_any_layout(preset, layout, ranks):
    """init_from's path: whole weights, given one tensor at a time, cut into each rank's FSDP
    (HSDP, expert-parallel) shards give back exactly those weights."""
    from model.transformer import build_model
    from tests.parallel.workers import started_from_weights

    cfg = small_model(preset, **({"moe.expert_hidden": 32} if "moe" in preset else {}))
    expected = build_model(cfg, device="cpu", seed=7).state_dict()
    got = run_ranks(ranks, started_from_weights, cfg, layout)[0]
    assert set(got) >= set(expected) - {"lm_head.weight"}
    for name, tensor in got.items():
        if name in expected:
            assert torch.equal(tensor, expected[name]), name


def test_each_rank_reads_only_its_own_experts_of_a_streamed_import():
    """A streamed HF import hands per-expert matrices over as ExpertStacks: under expert
    parallelism each rank stacks only its own experts (another's would raise), and the loaded
    weights are the whole weights."""
    from model.transformer import build_model
    from tests.parallel.workers import started_from_expert_stacks

    cfg = small_model("tiny_moe", **{"moe.expert_hidden": 32})
    expected = build_model(cfg, device="cpu", seed=7).state_dict()
    got = run_ranks(2, started_from_expert_stacks, cfg, {"ep": 2})[0]
    for name, tensor in got.items():
        if name in expected:
            assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize(
    ("preset", "layout", "ranks"),
    [("tiny", {"tp": 2}, 2), ("tiny_mla", {"tp": 2}, 4), ("tiny_hybrid", {"tp": 2}, 2)],
    ids=["tp2", "mla_dp_shard2_x_tp2", "gdn_tp2"],
)
def test_under_tensor_parallelism_each_rank_reads_only_its_slices(preset, layout, ranks):
    """init_from under tensor parallelism (+ FSDP2): the loaded weights are the whole weights,
    and each rank reads of every weight exactly the elements it holds (its tp slice of the
    heads, hidden units or vocabulary, then its FSDP2 rows), never another rank's."""
    from model.transformer import build_model
    from tests.parallel.workers import started_from_counted_reads

    cfg = small_model(preset, **({"n_layers": 4} if preset == "tiny_hybrid" else {}))
    expected = build_model(cfg, device="cpu", seed=7).state_dict()
    results = run_ranks(ranks, started_from_counted_reads, cfg, layout)
    for name, tensor in results[0][0].items():
        if name in expected:
            assert torch.equal(tensor, expected[name]), name
    for _, reads, held in results:
        assert reads.keys() >= held.keys()
        for name, count in held.items():
            assert reads[name] == count, (name, reads[name], count, expected[name].numel())
        split = [n for n, c in held.items() if c < expected[n].numel()]
        assert "layers.0.attn.o_proj.weight" in split and "embed.weight" in split
