"""`python -m trainer parallel.engine=deepspeed` end to end on CPU: torchrun with 2 ranks under
ZeRO-3 trains, evaluates, samples (whole weights gathered for it) and checkpoints inside the
trainer's scheme; a killed run resumes with the same losses bitwise, and on one rank (resharded
through DeepSpeed's universal checkpoint); one process works (a 1-rank group); a checkpoint of
the other engine is refused in one line, and settings
the engine does not take yet fail at start with their reasons; experts (ep=2) and Engram tables
under ZeRO-2 train, resume and move to FSDP2."""

from __future__ import annotations

import re
import shutil
from functools import partial

import pytest
import torch

from model.accounting import param_counts
from model.presets import load_preset
from model.transformer import build_model
from tests.trainer.concurrent import concurrently
from tests.trainer.helpers import SMALL_MODEL, SMALL_OVERRIDES, run_trainer, train_losses
from tests.trainer.test_torchrun import torchrun

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.integration, pytest.mark.distributed]

# MFU's peak given: no ~1 s matmul measurement at each start (test_mfu_peak.py tests it)
PEAK = "trainer.peak_flops=1e11"
FP32 = ["trainer.precision=fp32", "trainer.eval_every=2", PEAK]
ZERO3 = ["parallel.engine=deepspeed", "parallel.deepspeed.zero_stage=3"]


def test_zero3_on_two_ranks_trains_checkpoints_and_resumes_exactly(dataset, tmp_path):
    run_dir = tmp_path / "run"
    common = [f"data.path={dataset}", *SMALL_OVERRIDES, *FP32, *ZERO3, f"hydra.run.dir={run_dir}"]
    result = torchrun(2, *common, "trainer.max_steps=4", "checkpoint.every=2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    log = (run_dir / "train.log").read_text()
    assert "sample at step 4" in log and "validation loss" in log
    # counted on the config, not on ZeRO-3's partitions (which hold no elements)
    vocab = int(re.search(r"; vocab (\d+)", log)[1])
    whole = build_model(load_preset("tiny", SMALL_MODEL | {"vocab_size": vocab}), device="meta")
    assert f"model: {param_counts(whole).total:,} parameters" in log, log[:3000]
    first = train_losses(run_dir)
    step2 = run_dir / "checkpoints" / "step_00000002"
    assert sorted(p.name for p in (step2 / "deepspeed").iterdir()) == [
        "lmforge_layout.json",
        *(
            f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt"
            for r in (0, 1)
            for kind in ("model", "optim")
        ),
    ]
    # as if killed after step 3: the newest checkpoint is step 2; resumed on 2 ranks, and at
    # the same time on one rank (resharded through DeepSpeed's universal checkpoint, in the
    # one-rank run's own folder: step 2 is only read)
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")
    (run_dir / "checkpoints" / "latest").write_text("step_00000002\n")
    other = tmp_path / "one_rank"
    two_ranks, one_rank = concurrently(
        partial(torchrun, 2, *common, "trainer.max_steps=4", "checkpoint.every=2", cwd=tmp_path),
        partial(
            run_trainer,
            *common[:-1],
            f"hydra.run.dir={other}",
            f"resume={step2}",
            "trainer.max_steps=4",
            cwd=tmp_path,
        ),
    )
    assert two_ranks.returncode == 0, two_ranks.stderr[-4000:]
    assert "resumed from" in (run_dir / "train.log").read_text()
    resumed = train_losses(run_dir)
    assert {step: resumed[step] for step in (3, 4)} == {step: first[step] for step in (3, 4)}

    assert one_rank.returncode == 0, one_rank.stderr[-3000:]
    assert (
        "converting it to DeepSpeed's universal checkpoint (ZeRO-3 on 2 rank(s) -> ZeRO-3 on 1)"
        in (other / "train.log").read_text()
    )
    one = train_losses(other)
    assert sorted(one) == [3, 4]
    for step in (3, 4):
        assert one[step] == pytest.approx(first[step], rel=2e-5)  # sums in another order
    assert not list(step2.parent.glob(".*universal"))


def test_one_process_trains_and_an_fsdp2_checkpoint_is_refused_by_name(dataset, tmp_path):
    fsdp2_dir, ds_dir = tmp_path / "fsdp2", tmp_path / "deepspeed"
    common = [f"data.path={dataset}", *SMALL_OVERRIDES, *FP32, "trainer.max_steps=2"]
    fsdp2, ds = concurrently(  # independent runs
        partial(
            run_trainer, *common, "checkpoint.every=2", f"hydra.run.dir={fsdp2_dir}", cwd=tmp_path
        ),
        partial(run_trainer, *common, *ZERO3, f"hydra.run.dir={ds_dir}", cwd=tmp_path),
    )
    assert fsdp2.returncode == 0, fsdp2.stderr[-3000:]
    assert ds.returncode == 0, ds.stderr[-3000:]  # one process: a 1-rank group
    assert sorted(train_losses(ds_dir)) == [1, 2]
    checkpoint = fsdp2_dir / "checkpoints" / "step_00000002"
    result = run_trainer(
        *common, *ZERO3, f"hydra.run.dir={tmp_path / 'mixed'}", f"resume={checkpoint}", cwd=tmp_path
    )
    assert result.returncode == 2
    assert "was written by parallel.engine=fsdp2 (DCP)" in result.stderr


REFUSED = [
    ("optim=muon", "trainer.grad_clip=1.0 under ZeRO-2 with Muon: DeepSpeed 0.19 clips"),
    ("parallel.deepspeed.zero_stage=5", "parallel.deepspeed.zero_stage=5 must be 0, 1, 2 or 3"),
    ("parallel.deepspeed.offload_params=cpu", "offload_params=cpu needs zero_stage=3"),
]


@pytest.fixture(scope="module")
def refused_runs(dataset, tmp_path_factory) -> dict:
    """override -> the finished command of each REFUSED setting, all started at once."""
    common = [f"data.path={dataset}", *SMALL_OVERRIDES, "trainer.max_steps=1"]
    commands = []
    for override, _ in REFUSED:
        cwd = tmp_path_factory.mktemp("refused")
        commands.append(
            partial(run_trainer, *common, "parallel.engine=deepspeed", override, cwd=cwd)
        )
    return dict(zip([override for override, _ in REFUSED], concurrently(*commands), strict=True))


@pytest.mark.parametrize(("override", "message"), REFUSED)
def test_settings_the_engine_does_not_take_fail_at_start(refused_runs, override, message):
    result = refused_runs[override]
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_runs_move_between_engines_through_their_weights_and_both_export(dataset, tmp_path):
    """init_from=<checkpoint> starts a run of either engine from a checkpoint of the other
    (weights only, a fresh optimizer at step 0). With an lr too small to move an fp32 weight,
    the weights survive DeepSpeed -> FSDP2 -> DeepSpeed bit for bit, as their Hugging Face
    exports (trainer.export reads both formats) show; another model is refused in one line."""
    from safetensors.torch import load_file

    from trainer.export import ExportConfig, export

    common = [f"data.path={dataset}", *SMALL_OVERRIDES, *FP32, "checkpoint.every=1"]
    still = ["optim.lr=1e-30", "trainer.max_steps=1"]  # updates below fp32's resolution
    runs = {name: tmp_path / name for name in ("ds", "fsdp2", "back")}
    steps = [
        [*ZERO3, "trainer.max_steps=2", f"hydra.run.dir={runs['ds']}"],
        [*still, f"init_from={runs['ds']}", f"hydra.run.dir={runs['fsdp2']}"],
        [
            *ZERO3,
            "parallel.deepspeed.zero_stage=2",
            *still,
            f"init_from={runs['fsdp2']}",
            f"hydra.run.dir={runs['back']}",
        ],
    ]
    result = run_trainer(*common, *steps[0], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    # another model from the first run's checkpoint, refused while the FSDP2 run starts from it
    other_model = [*still, "model.n_layers=3", f"init_from={runs['ds']}"]
    refused, result = concurrently(
        partial(run_trainer, *common, *other_model, cwd=tmp_path),
        partial(run_trainer, *common, *steps[1], cwd=tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_trainer(*common, *steps[2], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "starting from the weights of" in (runs["back"] / "train.log").read_text()
    weights = {}
    for name, run in runs.items():
        out = export(ExportConfig(path=str(run), out=str(tmp_path / f"hf_{name}"), dtype="fp32"))
        weights[name] = load_file(out / "model.safetensors")
    for name in ("fsdp2", "back"):
        assert weights[name].keys() == weights["ds"].keys()
        for key, tensor in weights["ds"].items():
            assert torch.equal(weights[name][key], tensor), (name, key)

    assert refused.returncode == 2
    assert "holds another model (model.n_layers=2 in the checkpoint, 3 now)" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_muonclip_under_deepspeed_resumes_exactly(dataset, tmp_path):
    """optim=muonclip through the CLI on ZeRO-2 (DeepSpeed's Muon, the trainer's schedule and
    QK-clip): killed after step 2 and resumed, steps 3-4 repeat bitwise (the Muon momentum and
    Adam moments are in DeepSpeed's checkpoint); the run exports."""
    run_dir = tmp_path / "run"
    muon = ["optim=muonclip", "optim.qk_clip_tau=0.5", "trainer.grad_clip=0"]
    common = [f"data.path={dataset}", *SMALL_OVERRIDES, *FP32, "parallel.engine=deepspeed", *muon]
    common += ["trainer.max_steps=4", "checkpoint.every=2", f"hydra.run.dir={run_dir}"]
    result = run_trainer(*common, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    first = train_losses(run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")
    (run_dir / "checkpoints" / "latest").write_text("step_00000002\n")
    result = run_trainer(*common, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in (run_dir / "train.log").read_text()
    resumed = train_losses(run_dir)
    assert {step: resumed[step] for step in (3, 4)} == {step: first[step] for step in (3, 4)}
    # its weights leave through trainer.export (consolidated from Muon's ZeRO partitions)
    from safetensors.torch import load_file

    from trainer.export import ExportConfig, export

    out = export(ExportConfig(path=str(run_dir), out=str(tmp_path / "hf"), dtype="fp32"))
    assert load_file(out / "model.safetensors")


def test_experts_and_engram_under_zero2_train_resume_and_move_to_fsdp2(dataset, tmp_path):
    """A MoE model with Engram tables, parallel.ep=2 under ZeRO-2 on 2 torchrun ranks: trains,
    evaluates and samples (the all-to-all over DeepSpeed's expert group, the tables outside
    ZeRO); killed after step 2, steps 3-4 repeat bitwise; an FSDP2 run in one process starts
    from its whole weights (init_from: experts and tables included)."""
    run_dir = tmp_path / "run"
    moe = ["model=tiny_moe", "model.moe.expert_hidden=32", "model.engram.layers=[1]"]
    moe += ["model.engram.table_sizes=[97,89]", "model.engram.sharding=replicated"]
    moe += ["model.engram.heads=2", "model.engram.dim=32"]
    common = [f"data.path={dataset}", *SMALL_OVERRIDES, *moe, *FP32, "trainer.max_steps=4"]
    ds = [*ZERO3, "parallel.deepspeed.zero_stage=2", "parallel.ep=2", "checkpoint.every=2"]
    ds.append(f"hydra.run.dir={run_dir}")
    result = torchrun(2, *common, *ds, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    log = (run_dir / "train.log").read_text()
    assert "sample at step 4" in log and "validation loss" in log and "ep 2" in log
    first = train_losses(run_dir)
    whole = shutil.copytree(run_dir, tmp_path / "whole")  # the run as it ended, for FSDP2
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")
    (run_dir / "checkpoints" / "latest").write_text("step_00000002\n")
    fsdp2 = tmp_path / "fsdp2"
    result, from_fsdp2 = concurrently(  # the resume, and FSDP2 from the whole run's weights
        partial(torchrun, 2, *common, *ds, cwd=tmp_path),
        partial(
            run_trainer, *common[:-1], "trainer.max_steps=1", f"init_from={whole}",
            f"hydra.run.dir={fsdp2}", cwd=tmp_path,
        ),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    resumed = train_losses(run_dir)
    assert {step: resumed[step] for step in (3, 4)} == {step: first[step] for step in (3, 4)}
    refuses_a_payload_in_every_file(run_dir / "checkpoints" / "step_00000004", tmp_path)

    assert from_fsdp2.returncode == 0, from_fsdp2.stderr[-3000:]
    assert "starting from the weights of" in (fsdp2 / "train.log").read_text()


def refuses_a_payload_in_every_file(ckpt, tmp_path):
    """Every file this layout writes (the module, each rank's optimizer partitions with their
    experts, Engram's tables) refuses a pickled payload, named, without running it."""
    from tests.trainer.test_deepspeed_safety import plant
    from trainer.checkpoint.errors import UnsafeCheckpointError
    from trainer.checkpoint.load import read_checked

    names = sorted(p.name for p in (ckpt / "deepspeed").glob("*.pt"))
    assert "lmforge_tables.pt" in names and len(names) == 4, names
    marker = tmp_path / "pwned"
    for name in names:
        copy = tmp_path / "payload" / ckpt.name
        shutil.rmtree(copy.parent, ignore_errors=True)
        shutil.copytree(ckpt, copy)
        plant(copy / "deepspeed" / name, marker)
        with pytest.raises(UnsafeCheckpointError, match=f"{name} refused"):
            read_checked(copy, rank=0, form="deepspeed")
    assert not marker.exists()
