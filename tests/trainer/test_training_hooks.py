"""A feature defined only in this file trains through `python -m trainer`'s code paths, on one
process and on 2 gloo ranks, with no edit to trainer/ or parallel/: the training-hook seam
(model.training_hooks) is all a feature needs.

The toy feature: an objective term `weight * sum(final norm gains)` whose weight follows a
schedule (10 for the first half of the run, then 0), the number of objective terms added over
every rank's micro-batches as a metric (a reduction), and an edit after each applied update
that sets the final norm's gains to 0.5 (seen by the next step's forward).

Run as a module (`python -m tests.trainer.test_training_hooks <overrides>`) it registers the
feature and runs the trainer's own entry point: the launch the tests below use.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import Tensor, nn

from model.training_hooks import (
    Reduce,
    TrainingHook,
    UpdatedWeights,
    register_hook_factory,
)
from tests.commands import OFFLINE, ROOT
from tests.trainer.helpers import SMALL_OVERRIDES, metric_rows

EDITED_GAIN = 0.5
EARLY_WEIGHT = 10.0  # the term's gradient on d_model=64 gains: norm 80, far above the LM's


class ToyFeature(TrainingHook):
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.weight = 0.0
        self.terms = torch.zeros(())  # objective terms added on this rank since the last step

    def before_step(self, step: int, total_steps: int) -> None:
        self.weight = EARLY_WEIGHT if step < total_steps // 2 else 0.0

    def objective(self) -> Tensor | None:
        self.terms += 1
        return self.weight * self.model.norm.weight.sum()

    def after_backward(self, reduce: Reduce) -> dict[str, float]:
        gains = _local(self.model.norm.weight).detach().float()
        extremes = torch.stack([gains.max(), -gains.min()])  # before this step's update
        reduce(extremes, "max")
        reduce(self.terms, "sum")
        metrics = {"toy/terms": float(self.terms), "toy/weight": self.weight}
        self.terms.zero_()
        return metrics | {"toy/gain_max": float(extremes[0]), "toy/gain_min": -float(extremes[1])}

    def after_update(self, weights: UpdatedWeights) -> dict[str, float]:
        with torch.no_grad():
            _local(weights.module.norm.weight).fill_(EDITED_GAIN)
        return {"toy/edited": 1.0}


def _local(param: Tensor) -> Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


def toy_feature(model: nn.Module) -> ToyFeature:
    return ToyFeature(model)


def _run(tmp_path, dataset, ranks: int) -> list[dict]:
    run_dir = tmp_path / f"run{ranks}"
    overrides = [
        *SMALL_OVERRIDES,
        f"data.path={dataset}",
        f"hydra.run.dir={run_dir}",
        "trainer.max_steps=4",
        "trainer.eval_every=0",
        "trainer.sample_tokens=0",
        "trainer.micro_batch_size=2" if ranks == 1 else "trainer.micro_batch_size=1",
        "checkpoint.every=0",
        "logging.wandb=disabled",
    ]
    module = ["-m", "tests.trainer.test_training_hooks"]
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", f"--nproc_per_node={ranks}"]
    env = os.environ | OFFLINE | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [*launcher, *module, *overrides],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [row for row in metric_rows(run_dir) if "loss" in row]


@pytest.mark.integration
@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_a_feature_defined_in_a_test_file_trains_through_the_trainer(tmp_path, dataset, ranks):
    rows = _run(tmp_path, dataset, ranks)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    # the schedule: before_step saw each step's position in the 4-step run
    assert [row["toy/weight"] for row in rows] == [EARLY_WEIGHT] * 2 + [0.0] * 2
    # one term per micro-batch (2 per rank), summed over the ranks by the hook's reduction
    assert [row["toy/terms"] for row in rows] == [2.0 * ranks] * 4
    # the term was backpropagated: its gradient (norm 80) dominates while its weight is 10
    norms = [row["grad_norm"] for row in rows]
    assert min(norms[:2]) > 60 and max(norms[2:]) < 30, norms
    # the edit after each update reached the weights the next forward used, on every rank
    assert rows[0]["toy/gain_max"] == rows[0]["toy/gain_min"] == 1.0  # RMSNorm's initial gains
    for row in rows[1:]:
        assert row["toy/gain_max"] == row["toy/gain_min"] == EDITED_GAIN
    assert all(row["toy/edited"] == 1.0 for row in rows)


def _main() -> None:
    """The trainer's command with the toy feature registered (what `python -m trainer` runs)."""
    register_hook_factory("toy_feature", toy_feature)
    from trainer.__main__ import before_hydra, main

    before_hydra(sys.argv)  # may add the run directory to the arguments Hydra reads
    main()


if __name__ == "__main__":
    _main()
