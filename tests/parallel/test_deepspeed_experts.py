"""Expert parallelism under `parallel.engine=deepspeed` (parallel/deepspeed/experts.py) on gloo
ranks (DS_ACCELERATOR=cpu): a MoE model with ep=2 under ZeRO-1/2 trains like the FSDP2 engine
with ep=2 on the same ranks (losses, clipped gradient norms: the expert gradients' scale, final
weights), resumes from its checkpoint exactly, and its whole weights come out of its files;
checkpoints of another expert layout are refused by name. Skipped without DeepSpeed."""

from __future__ import annotations

import os

import pytest
import torch

from tests.parallel.ranks import run_ranks
from tests.parallel.workers import small_model, train

os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed")
from tests.parallel.deepspeed_workers import (
    conflict_with,
    resume_and_train,
    train_and_save,
    train_deepspeed,
)

pytestmark = pytest.mark.distributed
STEPS = 3


ENGRAM = {"engram.layers": [0, 1], "engram.heads": 2, "engram.dim": 32}
ENGRAM |= {"engram.table_sizes": [97, 89], "engram.sharding": "replicated"}


def moe_model(**overrides):
    return small_model("tiny_moe", **({"moe.expert_hidden": 32} | overrides))


@pytest.mark.parametrize(("stage", "ranks"), [(2, 4), (1, 2)])
def test_expert_parallelism_trains_like_the_fsdp2_engine(stage, ranks):
    """ep=2 under ZeRO-2 on 4 ranks (each expert's ZeRO partitions over the 2 ranks that hold
    it) and ZeRO-1 on 2: the same losses, gradient norms (clipped at 1.0: the norm is 1.17-1.20,
    so a wrong expert-gradient scale changes both the norm and the step; doubling the expert
    gradients moves the first norm by 1.6e-3) and final weights as FSDP2 with ep=2 on as many
    ranks. Measured: losses equal bit for bit, norms to 1.2e-7, weights to 1.2e-6 (fp32 sums in
    another order; ZeRO-1 on 4 ranks also passed, kept out of the suite for its time)."""
    reference = run_ranks(ranks, train, moe_model(), {"ep": 2}, STEPS)[0]
    got = run_ranks(
        ranks, train_deepspeed, moe_model(), stage, STEPS, 1, "fp32", -1, None, "adamw", 1.0,
        0.0, 2,
    )[0]  # fmt: skip
    torch.testing.assert_close(got["losses"], reference["losses"], rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(got["norms"], reference["norms"], rtol=1e-6, atol=1e-6)
    assert min(got["norms"]) > 1.0  # clipping is active
    assert set(got["final"]) == parameter_names(moe_model())
    for name, tensor in got["final"].items():
        torch.testing.assert_close(tensor, reference["final"][name], rtol=1e-5, atol=1e-5)


def parameter_names(cfg) -> set[str]:
    from model.transformer import build_model

    return {name for name, _ in build_model(cfg, device="meta").named_parameters()}


def test_an_expert_parallel_checkpoint_resumes_exactly_and_holds_the_whole_weights(tmp_path):
    """4 ranks, ep=2, ZeRO-2, bf16_master, a MoE model with Engram tables, saved after step 2:
    the resumed run repeats steps 3-4 exactly (each rank's experts come from its own fp32
    partitions; DeepSpeed's module file holds rank 0's), the checkpoint's consolidated weights
    (export, init_from) are the fp32 masters of the live weights (bf16 here: equal once
    rounded), with the tables and the buffers (integer ones in their dtype), and a run with
    another expert layout or rank count is refused by name."""
    from parallel.deepspeed.checkpoint import consolidated_weights

    cfg = moe_model(**ENGRAM)
    where = tmp_path / "step_00000002"
    args = (cfg, 2, 4, 2, str(where))
    first = run_ranks(4, train_and_save, *args, "adamw", 2, "bf16_master")[0]
    resumed = run_ranks(4, resume_and_train, *args, 2, "bf16_master")[0]
    assert resumed["losses"] == first["losses"][2:]
    for name, tensor in first["final"].items():
        assert torch.equal(resumed["final"][name], tensor), name

    whole = consolidated_weights(where)
    assert whole["layers.1.ffn.experts.w_up"].shape[0] == 8  # all 8 experts
    assert set(first["saved"]) == parameter_names(cfg)
    for name, tensor in first["saved"].items():  # (saved: the live weights as fp32)
        master = whole[name]
        assert master.dtype == torch.float32, name
        # bf16 weights are their masters rounded; the tables (outside ZeRO) are fp32 themselves
        assert torch.equal(master.bfloat16().float(), tensor) or torch.equal(master, tensor), name
    for name, buffer in first["buffers"].items():
        assert whole[name].dtype == (torch.float32 if buffer.is_floating_point() else buffer.dtype)
        assert torch.equal(whole[name].to(buffer.dtype), buffer), name

    other_ep = run_ranks(2, conflict_with, cfg, 2, str(where), "adamw", 1)[0]
    assert "experts split over parallel.ep=2 and this run has parallel.ep=1" in other_ep
    other_ranks = run_ranks(2, conflict_with, cfg, 2, str(where), "adamw", 2)[0]
    assert "holds partitions of 4 ranks and this run has 2: DeepSpeed's universal" in other_ranks
    assert "knows only its own MoE layers. Resume on 4 ranks" in other_ranks
