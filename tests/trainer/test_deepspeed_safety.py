"""DeepSpeed checkpoints that cannot lose or corrupt a run, or run code: every file under the
step directory is checksummed (a flipped byte in a rank's optimizer file is damage, and the run
falls back past it); a missing partition is damage, never a checkpoint of fewer ranks; a run
resumes on another ZeRO stage through DeepSpeed's universal checkpoint (ZeRO-2 <-> 3, the same
losses as the uninterrupted run) and ZeRO-0 is refused by name with nothing moved; a failed
conversion leaves no folder behind; a pickled payload in any kind of file DeepSpeed writes is
refused on resume and export without running."""

from __future__ import annotations

import os
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.commands import run_module
from tests.trainer.concurrent import concurrently
from tests.trainer.helpers import SMALL_OVERRIDES, run_trainer, train_losses
from tests.trainer.test_torchrun import torchrun
from trainer.checkpoint.errors import CheckpointError, UnsafeCheckpointError
from trainer.checkpoint.load import read_checked
from trainer.checkpoint.record import RECORD, CommitRecord, checksum_files

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.integration, pytest.mark.distributed]

# MFU's peak given: no ~1 s matmul measurement at each start (test_mfu_peak.py tests it)
PEAK = "trainer.peak_flops=1e11"
COMMON = [*SMALL_OVERRIDES, PEAK, "trainer.precision=fp32", "trainer.eval_every=0"]
COMMON += ["parallel.engine=deepspeed", "trainer.max_steps=6", "checkpoint.every=2"]
OPTIM = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


@pytest.fixture(scope="module")
def zero2_run(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank ZeRO-2 run of 6 steps with checkpoints at steps 2, 4 and 6."""
    root = tmp_path_factory.mktemp("zero2")
    run_dir = root / "run"
    args = [f"data.path={dataset}", *COMMON, "parallel.deepspeed.zero_stage=2"]
    result = torchrun(2, *args, f"hydra.run.dir={run_dir}", cwd=root)
    assert result.returncode == 0, result.stderr[-4000:]
    return run_dir


def copy_run(run_dir: Path, to: Path, newest: int) -> Path:
    """A copy of the run as if it had been killed after checkpoint `newest`."""
    shutil.copytree(run_dir, to)
    for ckpt in (to / "checkpoints").glob("step_*"):
        if int(ckpt.name[len("step_") :]) > newest:
            shutil.rmtree(ckpt)
    (to / "checkpoints" / "latest").write_text(f"step_{newest:08d}\n")
    return to


def step(run_dir: Path, n: int) -> Path:
    return run_dir / "checkpoints" / f"step_{n:08d}"


def flip_bytes(path: Path, count: int) -> None:
    data = bytearray(path.read_bytes())
    for i in range(count):
        data[len(data) // 2 + i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_every_file_is_checksummed_and_partitions_are_all_there(zero2_run, tmp_path):
    record = CommitRecord.read(step(zero2_run, 4))
    folder = step(zero2_run, 4) / "deepspeed"
    assert {f"deepspeed/{p.name}" for p in folder.iterdir()} <= set(record.files)

    for name, count, problem in [
        (OPTIM, 3, f"deepspeed/{OPTIM} does not match its checksum"),
        ("mp_rank_00_model_states.pt", 64, "does not match its checksum"),
    ]:
        damaged = copy_run(zero2_run, tmp_path / f"flip{count}", 4)
        flip_bytes(step(damaged, 4) / "deepspeed" / name, count)
        with pytest.raises(CheckpointError, match=problem):
            read_checked(step(damaged, 4), rank=0, form="deepspeed")

    missing = copy_run(zero2_run, tmp_path / "missing", 4)
    (step(missing, 4) / "deepspeed" / OPTIM).unlink()
    with pytest.raises(CheckpointError, match=f"deepspeed/{OPTIM} is missing"):
        read_checked(step(missing, 4), rank=0, form="deepspeed")
    # without a record (or with one rewritten to match), the layout says 2 ranks wrote it
    from parallel.deepspeed.checkpoint import check_partitions

    with pytest.raises(FileNotFoundError, match="lacks rank 1's optim states"):
        check_partitions(step(missing, 4) / "deepspeed")
    assert check_partitions(step(zero2_run, 4) / "deepspeed") == 2


def test_damage_falls_back_and_another_zero_stage_resumes_with_the_same_losses(
    zero2_run, dataset, tmp_path
):
    """Step 4's rank-1 optimizer file has 3 flipped bytes: the run falls back to step 2, which
    ZeRO-3 loads through the universal checkpoint; steps 3-6 repeat the ZeRO-2 run's losses.
    Then its ZeRO-3 checkpoint of step 4 resumes on ZeRO-2 in one process."""
    original = train_losses(zero2_run)
    run_dir = copy_run(zero2_run, tmp_path / "zero3", 4)
    flip_bytes(step(run_dir, 4) / "deepspeed" / OPTIM, 3)
    args = [f"data.path={dataset}", *COMMON, f"hydra.run.dir={run_dir}"]
    result = torchrun(2, *args, "parallel.deepspeed.zero_stage=3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    log = (run_dir / "train.log").read_text()
    assert f"step_00000004 is damaged (CheckpointError: deepspeed/{OPTIM} does not match" in log
    assert "ZeRO-2 on 2 rank(s) -> ZeRO-3 on 2" in log
    assert "resumed from" in log and "step_00000002 at step 2" in log
    zero3 = train_losses(run_dir)
    for n in (3, 4, 5, 6):
        assert zero3[n] == pytest.approx(original[n], rel=1e-5), n
    assert not (run_dir / ".deepspeed-universal").exists()

    # ZeRO-3's files of step 4 (written by this run) -> ZeRO-2 on one rank
    shutil.rmtree(step(run_dir, 6))
    (run_dir / "checkpoints" / "latest").write_text("step_00000004\n")
    result = run_trainer(*args, "parallel.deepspeed.zero_stage=2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ZeRO-3 on 2 rank(s) -> ZeRO-2 on 1" in (run_dir / "train.log").read_text()
    zero2 = train_losses(run_dir)
    for n in (5, 6):
        assert zero2[n] == pytest.approx(original[n], rel=2e-5), n  # sums in another order


def test_zero0_against_a_zero2_checkpoint_is_refused_by_name_with_nothing_moved(
    zero2_run, dataset, tmp_path
):
    run_dir = copy_run(zero2_run, tmp_path / "zero0", 4)
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    args = [f"data.path={dataset}", *COMMON, f"hydra.run.dir={run_dir}"]
    result = run_trainer(*args, "parallel.deepspeed.zero_stage=0", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    log = (run_dir / "train.log").read_text()
    assert "holds ZeRO-2 partitions and this run has parallel.deepspeed.zero_stage=0" in log
    assert "Resume with parallel.deepspeed.zero_stage=2" in log
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before
    assert not list(run_dir.glob("unloadable-*"))


def test_a_failed_conversion_leaves_no_folder(tmp_path, monkeypatch):
    from parallel.deepspeed import reshard

    def fails(folder: Path, out: Path, zero3: bool) -> None:
        out.mkdir(parents=True)
        (out / "half_written.pt").write_bytes(b"x" * 1000)
        raise RuntimeError("shape '[256]' is invalid for input of size 128")

    monkeypatch.setattr(reshard, "convert_to_universal", fails)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        out = tmp_path / "run" / ".deepspeed-universal" / "step_00000004" / "deepspeed"
        problem = reshard.convert_on_main(tmp_path / "in", out, "ZeRO-2 -> 3", True)
    finally:
        dist.destroy_process_group()
    assert "shape '[256]' is invalid" in problem
    assert not (tmp_path / "run" / ".deepspeed-universal").exists()
    assert not list((tmp_path / "run").iterdir())  # nor its status file


class Payload:
    """Unpickling this runs `touch <marker>`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant(path: Path, marker: Path) -> None:
    """Add a payload to a checkpoint file and re-record the checksums, as an attacker would."""
    state = torch.load(path, weights_only=False)
    state["extra"] = Payload(marker)
    torch.save(state, path)
    ckpt = path.parent.parent
    record = CommitRecord.read(ckpt)
    (ckpt / RECORD).unlink()
    CommitRecord(record.run_id, record.sequence, record.step, checksum_files(ckpt)).write(ckpt)


@pytest.mark.parametrize(
    "name",
    [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_model_states.pt",  # ZeRO-3's per-rank module file
    ],
)
def test_a_pickled_payload_is_refused_without_running(zero2_run, dataset, tmp_path, name):
    """Each kind of file: refused by read_checked (resume and export check it first), by the
    export's consolidation and by DeepSpeed's own load as lmforge guards it."""
    from parallel.deepspeed.checkpoint import consolidated_weights
    from parallel.deepspeed.safe_load import UnsafeFileError, guard_engine

    run_dir = copy_run(zero2_run, tmp_path / "run", 4)
    ckpt = step(run_dir, 4)
    if name.startswith("zero_pp_rank_1_mp_rank_00_model"):  # a ZeRO-3 file in the same place
        torch.save({"module": {}, "ds_version": "0.19"}, ckpt / "deepspeed" / name)
    marker = tmp_path / "pwned"
    plant(ckpt / "deepspeed" / name, marker)
    with pytest.raises(UnsafeCheckpointError, match=f"{name} refused: .*posix.system"):
        read_checked(ckpt, rank=0, form="deepspeed")
    with pytest.raises(UnsafeFileError):
        consolidated_weights(ckpt)

    class Engine:  # what guard_engine replaces: DeepSpeed's checkpoint reader
        checkpoint_engine = type("Reader", (), {"load": None})()

    guard_engine(Engine)
    with pytest.raises(UnsafeFileError):
        Engine.checkpoint_engine.load(str(ckpt / "deepspeed" / name), map_location="cpu")
    assert not marker.exists()

    if name == "mp_rank_00_model_states.pt":  # the commands, end to end, at once
        args = [f"data.path={dataset}", *COMMON, "parallel.deepspeed.zero_stage=2"]
        exported_run = copy_run(run_dir, tmp_path / "exported", 4)  # the export's own copy
        out = tmp_path / "hf"
        result, exported = concurrently(
            partial(run_trainer, *args, f"hydra.run.dir={run_dir}", cwd=tmp_path),
            partial(
                run_module,
                "trainer.export",
                f"path={step(exported_run, 4)}",
                f"out={out}",
                cwd=tmp_path,
            ),
        )
        assert result.returncode == 2, result.stderr[-3000:]
        assert "refused" in (run_dir / "train.log").read_text()
        assert exported.returncode != 0 and "refused" in exported.stderr
        assert "Traceback" not in exported.stderr
        assert not marker.exists()


def test_weights_that_overflow_are_neither_sampled_nor_saved(dataset, tmp_path):
    """lr=1e38 makes every weight overflow at step 1, steps 2-3 are skipped: the end-of-run
    evaluation and sample are skipped in one line (DeepSpeed's sample crashed both ranks), no
    checkpoint of that state is written, and the run fails (exit 1) saying why."""
    run_dir = tmp_path / "run"
    args = [f"data.path={dataset}", *SMALL_OVERRIDES, "trainer.precision=fp32", PEAK]
    args += ["parallel.engine=deepspeed", "parallel.deepspeed.zero_stage=2"]
    args += ["optim.lr=1e38", "optim.weight_decay=0", "trainer.max_steps=3"]
    result = run_trainer(*args, "trainer.eval_every=3", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    log = (run_dir / "train.log").read_text()
    assert "evaluation and sample at step 3 skipped: 20 of 20 weight tensors hold NaN" in log
    assert "training ended with 2 skipped step(s) in a row (from step 2)" in log
    assert "not saving a checkpoint at step 3 (end of training, after 2 skipped step(s)): 20" in log
    assert not list((run_dir / "checkpoints").glob("step_*"))
