"""Multi-token prediction through the trainer, on packed documents (trainer.doc_mask=true): the
main loss is what `loss` logs, the depth losses are logged as mtp/loss_<k> and fall, lambda
switches at its fraction of the run, and an interrupted run resumes to the same losses, bitwise."""

from __future__ import annotations

import dataclasses

from model.presets import load_preset
from tests.trainer.helpers import SMALL_MODEL, metric_rows, small_config
from trainer.app import build_training
from trainer.runtime import Ranks

ONE = Ranks(rank=0, world_size=1, local_rank=0)
SMALL = SMALL_MODEL | {"mtp.depth": 2, "mtp.switch_fraction": 0.5}


def mtp_config(dataset, steps: int):
    cfg = small_config(dataset, max_steps=steps, eval_every=steps // 2, doc_mask=True)
    cfg.model = load_preset("tiny", SMALL)
    cfg.trainer.precision = "fp32"
    cfg.checkpoint.every = steps // 2
    return cfg


def test_mtp_trains_logs_each_depth_switches_lambda_and_resumes_bitwise(dataset, tmp_path):
    assert build_training(mtp_config(dataset, 20), tmp_path / "whole", ONE).run() == 0
    rows = [r for r in metric_rows(tmp_path / "whole") if "loss" in r]
    assert {"mtp/loss_1", "mtp/loss_2", "mtp/weight"} <= rows[0].keys()
    weights = {r["step"]: r["mtp/weight"] for r in rows}
    assert weights[1] == 0.3 and weights[10] == 0.3 and weights[11] == 0.1 and weights[20] == 0.1
    assert rows[-1]["mtp/loss_1"] < rows[0]["mtp/loss_1"] - 0.5
    assert rows[-1]["mtp/loss_2"] < rows[0]["mtp/loss_2"] - 0.5
    first = build_training(mtp_config(dataset, 20), tmp_path / "split", ONE)
    first.loop = dataclasses.replace(first.loop, max_steps=10)
    assert first.run() == 0
    again = build_training(mtp_config(dataset, 20), tmp_path / "split", ONE)
    assert again.step == 10 and again.run() == 0
    resumed = [r for r in metric_rows(tmp_path / "split") if "loss" in r]
    assert [(r["step"], r["loss"], r["mtp/loss_1"]) for r in resumed] == [
        (r["step"], r["loss"], r["mtp/loss_1"]) for r in rows
    ]
