"""The training-engine interface is all the loop needs: a third engine, written only against
`parallel.engine.TrainingEngine`, trains, evaluates, samples, checkpoints and resumes exactly."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from model.transformer import build_model
from parallel.engine import (
    ENGINES,
    Edit,
    EngineRequest,
    ModuleState,
    Objective,
    TrainingEngine,
)
from tests.trainer.helpers import metric_rows, small_config
from trainer.app import build_training
from trainer.runtime import Ranks

ONE = Ranks(rank=0, world_size=1, local_rank=0)


class RecordingEngine(TrainingEngine):
    """Plain fp32 module, torch's own clipping; counts every call the loop makes."""

    def __init__(self, request: EngineRequest) -> None:
        self.model = build_model(request.model_cfg, device=request.device, seed=request.seed)
        self.optimizer = request.make_optimizer(self.model)
        self.calls: Counter[str] = Counter()

    @property
    def state_module(self) -> nn.Module:
        return self.model

    def autocast(self) -> AbstractContextManager:
        self.calls["autocast"] += 1
        return nullcontext()

    def forward_backward(
        self,
        inputs: Tensor,
        targets: Tensor,
        doc_ids: Tensor | None,
        divide_by: int,
        last: bool,
        objective: Objective,
    ) -> Tensor:
        self.calls["forward_backward"] += 1
        self.calls["last"] += last
        loss = self.model(inputs, targets, doc_ids=doc_ids)
        (objective(loss) / divide_by).backward()  # the features' terms (MoE balance, ...)
        return loss.detach()

    def clip_gradients(self, max_norm: float) -> Tensor:
        self.calls["clip_gradients"] += 1
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def step(self, edit: Edit | None = None) -> None:
        self.calls["step"] += 1
        self.optimizer.step()
        if edit is not None:
            edit(self.updated_weights())

    def zero_grad(self) -> None:
        self.calls["zero_grad"] += 1
        self.optimizer.zero_grad(set_to_none=True)

    @contextmanager
    def full_weights(self) -> Iterator[nn.Module]:
        self.calls["full_weights"] += 1
        yield self.model

    def state_dict(self) -> dict[str, Any]:
        self.calls["state_dict"] += 1
        return ModuleState(self.model, self.optimizer).state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls["load_state_dict"] += 1
        ModuleState(self.model, self.optimizer).load_state_dict(state)


def recording(request: EngineRequest) -> RecordingEngine:
    return RecordingEngine(request)


def config(dataset, tmp_path, steps: int, engine: str):
    cfg = small_config(dataset, max_steps=steps, eval_every=2, micro_batch_size=2)
    cfg.trainer.precision = "fp32"
    cfg.parallel.engine = engine
    cfg.checkpoint.every = 2
    return cfg


def test_a_third_engine_runs_the_whole_loop_and_resumes_exactly(dataset, tmp_path):
    ENGINES.register("recording")(recording)
    try:
        training = build_training(config(dataset, tmp_path, 4, "recording"), tmp_path / "a", ONE)
        engine = training.engine
        assert isinstance(engine, RecordingEngine)
        assert training.run() == 0
        calls = engine.calls
        # 4 steps of 2 micro-batches (batch 4, micro-batch 2), the last of each flagged
        assert calls["forward_backward"] == 8 and calls["last"] == 4
        assert calls["clip_gradients"] == calls["step"] == calls["zero_grad"] == 4
        assert calls["full_weights"] == 3  # a sample at steps 0, 2 and 4
        # every evaluation forward uses the engine's precision: 3 evaluations of the sample batches
        per_eval = training.loader.val_batches + training.loader.train_sample.batches
        assert per_eval >= 2 and calls["autocast"] == 3 * per_eval
        assert calls["state_dict"] == 2  # checkpoints at steps 2 and 4
        rows = metric_rows(tmp_path / "a")
        val = [r["val_loss"] for r in rows if "val_loss" in r]
        assert len(val) == 3 and val[-1] < val[0]

        # the same run interrupted after step 2 and resumed gives the same losses, bitwise
        short = build_training(config(dataset, tmp_path, 2, "recording"), tmp_path / "b", ONE)
        assert short.run() == 0
        resumed = build_training(config(dataset, tmp_path, 4, "recording"), tmp_path / "b", ONE)
        assert resumed.engine.calls["load_state_dict"] == 1 and resumed.step == 2
        assert resumed.run() == 0
        losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
        again = {r["step"]: r["loss"] for r in metric_rows(tmp_path / "b") if "loss" in r}
        assert again == losses
    finally:
        ENGINES.remove("recording")


def test_the_fake_engine_matches_the_built_in_one(dataset, tmp_path):
    """Both engines step a plain fp32 model alike: the loop adds nothing engine-specific."""
    ENGINES.register("recording")(recording)
    try:
        runs = {}
        for name in ("recording", "fsdp2"):
            training = build_training(config(dataset, tmp_path, 3, name), tmp_path / name, ONE)
            assert training.run() == 0
            runs[name] = [r["loss"] for r in metric_rows(tmp_path / name) if "loss" in r]
        torch.testing.assert_close(runs["recording"], runs["fsdp2"], rtol=1e-5, atol=1e-6)
    finally:
        ENGINES.remove("recording")
