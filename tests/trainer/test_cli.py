"""`python -m trainer` end to end: the run directory contract, exact resume after SIGKILL,
fallback past a damaged checkpoint, graceful SIGTERM, config errors, wandb modes, export."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from model.config import ModelConfig, config_from_dict
from model.transformer import build_model
from parallel.precision import cpu_has_bf16
from tests.commands import ROOT
from tests.trainer.helpers import SMALL_OVERRIDES, metric_rows, run_trainer
from trainer.config import COMPILE_MIN_STEPS, TrainerConfig, compiles

pytestmark = pytest.mark.integration
REQUIRED = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu"}


def small(dataset: Path, run_dir: Path, *extra: str) -> list[str]:
    return [f"data.path={dataset}", f"hydra.run.dir={run_dir}", *SMALL_OVERRIDES, *extra]


def test_the_default_run_writes_the_run_directory_contract(tmp_path):
    """No data.path: the default corpus is prepared (into LMFORGE_DATA_DIR) on first use."""
    run_dir = tmp_path / "run"
    result = run_trainer(
        f"hydra.run.dir={run_dir}",
        "trainer.max_steps=2",
        "trainer.log_every=1",
        "trainer.batch_size=2",
        "trainer.sample_tokens=4",
        "data.val_batches=1",
        "logging.progress=false",
        cwd=tmp_path,
        env={"LMFORGE_DATA_DIR": str(tmp_path / "data")},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metric_rows(run_dir)
    train_rows = [r for r in rows if "loss" in r]
    assert set(train_rows[0]) >= REQUIRED and [r["step"] for r in train_rows] == [1, 2]
    assert [r["step"] for r in rows if "val_loss" in r] == [0, 2]  # the start and the end
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert (run_dir / "checkpoints" / "step_00000002" / ".metadata").is_file()
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    log = (run_dir / "train.log").read_text()
    assert (run_dir / "loss.png").is_file() and "validation loss" in log
    # the default trainer.compile=auto: a 2-step run stays eager, and says why
    assert f"torch.compile: off (eager) (trainer.compile=auto: 2 steps < {COMPILE_MIN_STEPS}" in log
    assert "CPU allocator: " in log  # trainer.cpu_malloc=keep: what it did is logged
    # trainer.precision=auto: bf16 only where this CPU has bf16 instructions
    chosen = "bf16" if cpu_has_bf16() else "fp32"
    assert f"trainer.precision=auto: {chosen} (this CPU (" in log
    assert (
        tmp_path / "data" / "stdlib-py{}.{}-bpe8192".format(*sys.version_info[:2]) / "manifest.json"
    ).is_file()


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    out = run_dir / "final.pt"
    dcp_to_torch_save(str(latest), str(out))
    return torch.load(out, weights_only=False)["model"]


def test_resume_after_sigkill_is_bitwise_exact(dataset, tmp_path):
    common = ("trainer.max_steps=8", "checkpoint.every=4", "trainer.eval_every=0")
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert run_trainer(*small(dataset, whole, *common), cwd=tmp_path).returncode == 0
    first = run_trainer(*small(dataset, killed, *common, "trainer.fault_step=4"), cwd=tmp_path)
    assert first.returncode == -signal.SIGKILL
    assert (killed / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    second = run_trainer(*small(dataset, killed, *common, "trainer.fault_step=4"), cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in (killed / "train.log").read_text()
    losses = {r["step"]: r["loss"] for r in metric_rows(whole) if "loss" in r}
    resumed = {r["step"]: r["loss"] for r in metric_rows(killed) if "loss" in r}
    assert resumed == losses  # bitwise: JSON keeps every float digit; steps 1-4 are not repeated
    a, b = final_weights(whole), final_weights(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(dataset, tmp_path):
    run_dir = tmp_path / "run"
    base = ("checkpoint.every=2", "trainer.eval_every=0")
    assert (
        run_trainer(*small(dataset, run_dir, "trainer.max_steps=4", *base), cwd=tmp_path).returncode
        == 0
    )
    shard = next((run_dir / "checkpoints" / "step_00000004").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    result = run_trainer(*small(dataset, run_dir, "trainer.max_steps=5", *base), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    log = (run_dir / "train.log").read_text()
    assert "step_00000004 is damaged" in log and "step_00000002 at step 2" in log


def test_sigterm_saves_and_exits_then_resume_finishes(dataset, tmp_path):
    run_dir = tmp_path / "run"
    args = small(dataset, run_dir, "trainer.max_steps=400", "trainer.eval_every=0")
    env = {"PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer", *args],
        cwd=tmp_path,
        env=os.environ | env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    log = (run_dir / "train.log").read_text()
    assert "stopped by SIGTERM" in log
    step = int((run_dir / "checkpoints" / "latest").read_text().strip().split("_")[1])
    assert 3 <= step < 400


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.max_step=3"], "trainer.max_step is not a setting"),
        (["trainer.max_steps=abc"], "Value 'abc' of type 'str' could not be converted to Integer"),
        (
            ["trainer.batch_size=6", "trainer.micro_batch_size=4"],
            "trainer.batch_size=6 is not divisible by trainer.micro_batch_size=4",
        ),
        (["data.seq_len=128"], "data.seq_len=128 exceeds the model's context of 64 tokens"),
        (["model.vocab_size=100"], "model.vocab_size=100 is smaller than the tokenizer's 300 ids"),
        (["trainer.precision=fp16"], "trainer.precision='fp16' is not one of"),
        (["trainer.compile=sometimes"], "trainer.compile='sometimes' is not one of"),
        (["trainer.cpu_malloc=jemalloc"], "trainer.cpu_malloc='jemalloc' is not one of"),
        (["parallel.engine=megatron"], "unknown training engine (parallel.engine) 'megatron'"),
        (
            ["model.layer_pattern=[gqa,mamba]"],
            "model.layer_pattern='mamba' is not a known token mixer",
        ),
    ],
)
def test_config_errors_stop_before_training(dataset, tmp_path, overrides, message):
    run_dir = tmp_path / "run"
    result = run_trainer(*small(dataset, run_dir, "trainer.max_steps=2", *overrides), cwd=tmp_path)
    assert result.returncode != 0
    assert (
        message in result.stderr + (run_dir / "train.log").read_text()
        if (run_dir / "train.log").exists()
        else message in result.stderr
    )
    assert not (run_dir / "metrics.jsonl").exists()
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("mode", ["offline", "disabled"])
def test_wandb_offline_writes_a_run_and_disabled_writes_nothing(dataset, tmp_path, mode):
    run_dir = tmp_path / "run"
    result = run_trainer(
        *small(dataset, run_dir, "trainer.max_steps=2", f"logging.wandb={mode}"), cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = list((run_dir / "wandb").glob("offline-run-*")) if (run_dir / "wandb").exists() else []
    if mode == "offline":
        assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    else:
        assert not (run_dir / "wandb").exists()


def test_export_gives_a_transformers_model_with_the_same_logits(dataset, tmp_path):
    transformers = pytest.importorskip("transformers")
    run_dir = tmp_path / "run"
    assert (
        run_trainer(*small(dataset, run_dir, "trainer.max_steps=2"), cwd=tmp_path).returncode == 0
    )
    out = tmp_path / "hf"
    result = subprocess.run(
        [sys.executable, "-m", "trainer.export", f"path={run_dir}", f"out={out}", "dtype=fp32"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()

    from trainer.export import export  # noqa: F401  (the same code path, imported for clarity)

    ckpt = run_dir / "checkpoints" / "step_00000002"
    extra = torch.load(ckpt / "trainer_rank0.pt", weights_only=False)
    ours = build_model(config_from_dict(ModelConfig, extra["model_config"]))
    state = {"model": ours.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to load in a single process"
        dcp.load(state, checkpoint_id=str(ckpt))
    ours.load_state_dict(state["model"])
    tokens = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), atol=1e-5, rtol=1e-5)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 320
    assert (out / "tokenizer" / "tokenizer.tiktoken").is_file()


@pytest.mark.parametrize("compile_eval", ["auto", "true"])
def test_a_compiled_model_trains(dataset, tmp_path, compile_eval):
    """trainer.compile=true: every block compiled (the composition path of every layout). A
    run this short evaluates and samples eagerly (auto): nothing recompiles for them (TORCH_LOGS
    reports every recompile; the old path recompiled every block for no_grad and decoding);
    trainer.compile_eval=true compiles the validation forwards (the training graphs then
    recompile for grad mode)."""
    run_dir = tmp_path / "run"
    overrides = [
        "trainer.max_steps=3",
        "trainer.compile=true",
        f"trainer.compile_eval={compile_eval}",
    ]
    result = run_trainer(
        *small(dataset, run_dir, *overrides), cwd=tmp_path, env={"TORCH_LOGS": "recompiles"}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [r["loss"] for r in metric_rows(run_dir) if "loss" in r]
    assert len(losses) == 3 and all(isinstance(x, float) for x in losses)
    assert [r["step"] for r in metric_rows(run_dir) if "val_loss" in r] == [0, 3]
    how = "eager" if compile_eval == "auto" else "compiled"
    line = f"evaluation forwards {how} (trainer.compile_eval={compile_eval}: 6 evaluation batches"
    assert line in result.stderr
    assert ("Recompiling" in result.stderr) is (compile_eval == "true")


def test_world_size_without_a_rendezvous_is_a_clear_error(dataset, tmp_path):
    """WORLD_SIZE > 1 set by hand, without torchrun's MASTER_ADDR/PORT: one line, no hang."""
    run_dir = tmp_path / "run"
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    env |= {key: "" for key in ("MASTER_ADDR", "MASTER_PORT")}
    result = run_trainer(*small(dataset, run_dir, "trainer.max_steps=2"), cwd=tmp_path, env=env)
    assert result.returncode == 2
    assert "MASTER_ADDR, MASTER_PORT is not set: launch with torchrun" in result.stderr
    assert not (run_dir / "metrics.jsonl").exists()


@pytest.mark.parametrize("optimizer", ["muon", "muonclip"])
def test_optim_muon_trains_and_prints_its_groups(dataset, tmp_path, optimizer):
    run_dir = tmp_path / "run"
    extra = [f"optim={optimizer}", "trainer.max_steps=3"]
    result = run_trainer(*small(dataset, run_dir, *extra), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    log = (run_dir / "train.log").read_text()
    assert "optimizer group muon: 14 tensors" in log and "optimizer group adamw_vectors" in log
    rows = [r for r in metric_rows(run_dir) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert f"name: {optimizer}" in (run_dir / ".hydra" / "config.yaml").read_text()
    if optimizer == "muonclip":  # per-layer max logits and clipped heads are logged
        assert rows[-1]["qk/max_logit"] > 0 and "qk/layer1/max_logit" in rows[-1]
        assert rows[-1]["qk/clipped_heads"] == 0  # tau = 100 is far above a fresh model's logits


@pytest.mark.integration
def test_a_local_sweep_runs_every_point(dataset, tmp_path):
    # `-m`: Hydra's basic launcher runs the points one after the other in this process; a point
    # must not exit the process (it used to end the sweep after the first point)
    sweep = tmp_path / "sweep"
    overrides = [f"data.path={dataset}", *SMALL_OVERRIDES, "trainer.eval_every=0"]
    result = run_trainer(
        "-m", f"hydra.sweep.dir={sweep}", *overrides, "trainer.max_steps=2,3", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [sorted(r["step"] for r in metric_rows(sweep / p) if "loss" in r) for p in "01"] == [
        [1, 2],
        [1, 2, 3],
    ]


@pytest.mark.parametrize(
    ("value", "steps", "expected"),
    [
        ("auto", COMPILE_MIN_STEPS - 1, False),
        ("auto", COMPILE_MIN_STEPS, True),
        (True, 2, True),
        ("False", 5000, False),
    ],
)
def test_compile_auto_compiles_runs_long_enough_to_pay_back(value, steps, expected):
    """auto: runs of COMPILE_MIN_STEPS steps or more compile (bench/default_speed.py); a bool
    from Python or YAML is accepted as true / false."""
    trainer = TrainerConfig(compile=value, max_steps=steps)
    assert trainer.compile in ("auto", "true", "false") and compiles(trainer) is expected


def test_compile_auto_stays_eager_without_a_cpp_compiler(monkeypatch):
    """auto on a machine without the C++ compiler torch.compile needs: eager, and the log line
    says why; an explicit true still compiles (and fails in Inductor, as asked)."""
    from trainer.app import compile_summary

    monkeypatch.setenv("CXX", "no-such-compiler++")
    trainer = TrainerConfig(compile="auto", max_steps=COMPILE_MIN_STEPS)
    assert not compiles(trainer)
    assert "no C++ compiler (no-such-compiler++)" in compile_summary(trainer, compiles(trainer))
    assert compiles(TrainerConfig(compile="true", max_steps=2))
