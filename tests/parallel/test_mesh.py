"""Mesh sizes from `parallel.*` and the world size; config errors name the keys."""

from __future__ import annotations

import pytest

from model.errors import ConfigError
from parallel.config import ParallelConfig
from parallel.mesh import ParallelDims


def test_dp_shard_takes_all_remaining_ranks() -> None:
    dims = ParallelDims.resolve(ParallelConfig(dp_replicate=2), 8)
    assert (dims.dp_replicate, dims.dp_shard, dims.ep, dims.expert_shard) == (2, 4, 1, 4)
    dims = ParallelDims.resolve(ParallelConfig(ep=2), 4)
    assert (dims.dp_shard, dims.ep, dims.expert_shard) == (4, 2, 2)
    assert "ep 2 (expert weights sharded over 2)" in dims.describe()
    dims = ParallelDims.resolve(ParallelConfig(tp=2, dp_replicate=2), 8)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.dp_ranks) == (2, 2, 2, 4)
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]  # tp innermost
    assert dims.describe().endswith("tp 2")
    dims = ParallelDims.resolve(ParallelConfig(cp=2, tp=2), 8)
    assert (dims.dp_shard, dims.cp, dims.tp, dims.dp_ranks, dims.ranks_per_row) == (2, 2, 2, 2, 4)
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]  # cp x tp innermost
    assert dims.describe().endswith("cp 2, tp 2")


def test_context_parallel_meshes_shard_over_data_and_context_ranks() -> None:
    """Rank 5 of dp_replicate 2 x dp_shard 2 (ep 2) x cp 2 x tp 1 (one process, a fake group):
    dense weights sharded over dp_shard x cp of its replica, experts over cp (dp_shard is all
    ep), its cp partner the next rank."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from parallel.mesh import build_meshes

    dims = ParallelDims.resolve(ParallelConfig(dp_replicate=2, ep=2, cp=2), 8)
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        meshes = build_meshes(dims, "cpu")
        assert meshes.dense.mesh.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert meshes.experts.mesh.tolist() == [[0, 1], [4, 5]]
        assert meshes.ep.mesh.tolist() == [5, 7]
        assert meshes.cp.mesh.tolist() == [4, 5]
        assert meshes.tp is None
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("cfg", "world", "message"),
    [
        (dict(dp_replicate=3), 4, "parallel.dp_replicate=3 does not divide the world size 4"),
        (
            dict(dp_shard=2),
            4,
            r"parallel.dp_replicate=1 x parallel.dp_shard=2 = 2 ranks, but the world size is 4",
        ),
        (dict(ep=4, dp_replicate=2), 4, "parallel.ep=4 must divide parallel.dp_shard=2"),
        (dict(ep=4), 2, "parallel.ep=4 must divide parallel.dp_shard=2"),
        (dict(ep=2), 1, "parallel.ep=2 must divide parallel.dp_shard=1"),
        (dict(tp=3), 4, r"parallel.dp_replicate=1 x parallel.tp=3 = 3 does not divide the world"),
        (
            dict(tp=2, dp_shard=4),
            4,
            r"parallel.dp_replicate=1 x parallel.dp_shard=4 x parallel.tp=2 = 8 ranks, but the",
        ),
        (dict(tp=2, ep=4), 4, "parallel.ep=4 must divide parallel.dp_shard=2"),
        (
            dict(cp=2, tp=2),
            6,
            r"parallel.dp_replicate=1 x parallel.cp=2 x parallel.tp=2 = 4 does not divide",
        ),
    ],
)
def test_inconsistent_sizes_fail_with_the_keys(cfg: dict, world: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ParallelDims.resolve(ParallelConfig(**cfg), world)


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (dict(dp_shard=0), "parallel.dp_shard=0 must be >= 1, or -1"),
        (dict(ep=0), "parallel.ep=0 must be >= 1"),
        (dict(tp=0), "parallel.tp=0 must be >= 1"),
        (dict(cp=0), "parallel.cp=0 must be >= 1"),
        (dict(sequence_parallel=True), r"they need parallel.tp > 1 \(got parallel.tp=1\)"),
        (dict(async_tp=True), r"they need parallel.tp > 1 \(got parallel.tp=1\)"),
        (dict(activation_checkpoint="some"), "parallel.activation_checkpoint='some' is not one of"),
        (dict(param_dtype="fp16"), "parallel.param_dtype='fp16' is not one of"),
    ],
)
def test_bad_values_fail_with_the_key(cfg: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ParallelConfig(**cfg)


@pytest.mark.parametrize(
    ("preset", "ep", "message"),
    [
        ("tiny", 2, "parallel.ep=2 needs a MoE model"),
        ("tiny_moe", 3, "model.moe.n_routed_experts=8 is not divisible by parallel.ep=3"),
        ("selective", 2, "parallel.activation_checkpoint=selective does not work with"),
    ],
)
def test_expert_parallelism_needs_a_fitting_moe_model(preset: str, ep: int, message: str) -> None:
    from model.presets import load_preset
    from trainer.build import check_expert_parallel

    dims = ParallelDims.resolve(ParallelConfig(ep=ep), 6 if ep == 3 else 2)
    checkpointing = "selective" if preset == "selective" else "none"
    model = load_preset("tiny_moe" if preset == "selective" else preset)
    with pytest.raises(ConfigError, match=message):
        check_expert_parallel(model, dims, checkpointing)


@pytest.mark.parametrize(("compile", "device"), [(True, "cpu"), (False, "cuda")])
def test_async_tensor_parallelism_needs_cuda_and_compile(compile: bool, device: str) -> None:
    from parallel.compose import enable_async_tp

    with pytest.raises(ConfigError, match="parallel.async_tp=true needs CUDA devices and trainer"):
        enable_async_tp(compile, device)
