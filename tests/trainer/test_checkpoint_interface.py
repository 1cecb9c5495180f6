"""What checkpoints save and load is declared (parallel.checkpoint_format): an object without the
checkpoint methods is a programming error, refused before any file is touched, never taken for a
damaged checkpoint (which resume=auto would set aside)."""

from __future__ import annotations

import pytest
import torch

from parallel.engine import ModuleState
from trainer.checkpoint.load import resume
from trainer.checkpoint.save import Checkpointer


class StateOnly:
    """The old protocol: state_dict() and load_state_dict() only."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        return None


def test_an_object_without_the_checkpoint_methods_is_refused_before_any_file(tmp_path):
    root = tmp_path / "checkpoints"
    model = torch.nn.Linear(2, 2)
    Checkpointer(root, 0, keep=2).save(
        1, ModuleState(model, torch.optim.SGD(model.parameters())), {"step": 1}
    )
    before = sorted(p.name for p in root.iterdir())
    with pytest.raises(TypeError, match="CheckpointFormat"):
        Checkpointer(root, 0, keep=2).save(2, StateOnly(), {"step": 2})
    with pytest.raises(TypeError, match="CheckpointFormat"):
        resume("auto", root, StateOnly(), 0)
    assert sorted(p.name for p in root.iterdir()) == before  # nothing written, nothing set aside
    assert not (tmp_path / "unloadable-1").exists()
