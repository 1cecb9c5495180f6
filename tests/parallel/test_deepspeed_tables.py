"""Engram's tables under `parallel.engine=deepspeed` (parallel/deepspeed/tables.py) on 2 gloo
ranks (DS_ACCELERATOR=cpu): kept out of ZeRO, whole on every rank, their sparse row gradients
averaged, clipped by the global norm and updated by the row-wise Adam. Every ZeRO stage trains
like the FSDP2 engine with replicated tables; checkpoints hold the tables' weights and moments,
resume exactly (also on another number of ranks) and hand them to export. Skipped without
DeepSpeed."""

from __future__ import annotations

import os

import pytest
import torch

from tests.parallel.ranks import run_ranks
from tests.parallel.workers import small_model, train

os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed")
from tests.parallel.deepspeed_workers import (
    resume_and_train,
    train_and_save,
    train_deepspeed,
)

pytestmark = pytest.mark.distributed
TABLE = "layers.1.engram.table.weight"


def engram():
    small = {"engram.layers": [0, 1], "engram.heads": 2, "engram.dim": 32}
    small |= {"engram.table_sizes": [97, 89], "engram.sharding": "replicated"}
    return small_model("tiny_engram", **small)


@pytest.fixture(scope="module")
def fsdp2() -> dict:
    return run_ranks(2, train, engram(), {}, 2)[0]


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_every_stage_trains_the_tables_like_the_fsdp2_engine(fsdp2, stage):
    """2 steps against FSDP2 with replicated tables (2 of them) on 2 ranks, clipping active
    (norms 1.34, 1.54 > 1): the same losses, the same global norms (DeepSpeed's with the tables'
    included: leaving them out moved step 1's by 3e-4 relative in a one-table run) and the
    same tables (measured <= 1.4e-7; not clipping them by DeepSpeed's factor moved them 1.3e-4
    in a one-table run). Other weights to 5e-5 (measured <= 7.4e-6: Adam's first steps amplify
    rounding in near-zero gradients, see tests/parallel/test_engram_fsdp.py)."""
    got = run_ranks(2, train_deepspeed, engram(), stage, 2)[0]
    torch.testing.assert_close(got["losses"], fsdp2["losses"], rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(got["norms"], fsdp2["norms"], rtol=1e-5, atol=1e-6)
    assert min(got["norms"]) > 1.0  # clipping is active
    torch.testing.assert_close(got["final"][TABLE], fsdp2["final"][TABLE], rtol=0, atol=1e-5)
    assert not torch.equal(got["final"][TABLE], fsdp2["initial"][TABLE])  # trained
    for name, tensor in got["final"].items():
        torch.testing.assert_close(tensor, fsdp2["final"][name], rtol=0, atol=5e-5, msg=name)


@pytest.mark.parametrize(("stage", "loaded_on"), [(2, 2), (3, 1)])
def test_the_tables_resume_exactly_and_leave_with_the_checkpoint(tmp_path, stage, loaded_on):
    """Saved by 2 ranks after step 2 (the tables and their row-wise Adam moments beside
    DeepSpeed's files), loaded by 2 or 1 (DeepSpeed's part resharded through its universal
    checkpoint): steps 3-4 repeat, and the checkpoint's whole weights hold the tables."""
    from parallel.deepspeed.checkpoint import consolidated_weights

    where = tmp_path / "step_00000002"
    first = run_ranks(2, train_and_save, engram(), stage, 4, 2, str(where))[0]
    assert (where / "deepspeed" / "lmforge_tables.pt").is_file()
    again = run_ranks(loaded_on, resume_and_train, engram(), stage, 4, 2, str(where))[0]
    if loaded_on == 2:
        assert again["losses"] == first["losses"][2:]
        assert torch.equal(again["final"][TABLE], first["final"][TABLE])
    else:  # sums over another number of ranks
        torch.testing.assert_close(again["losses"], first["losses"][2:], rtol=2e-5, atol=2e-6)
        torch.testing.assert_close(again["final"][TABLE], first["final"][TABLE], atol=1e-5, rtol=0)
    whole = consolidated_weights(where)
    assert torch.equal(whole[TABLE], first["saved"][TABLE])
