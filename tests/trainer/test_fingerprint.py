"""A checkpoint written before a model field existed still resumes (the field had its default);
a real difference is still refused by name."""

from __future__ import annotations

from model.presets import load_preset
from optim.config import OptimConfig
from trainer.checkpoint.fingerprint import Fingerprint


def _older(fingerprint: Fingerprint, *missing: str) -> dict:
    """The fingerprint as a checkpoint from before the `missing` model fields would hold it."""
    saved = fingerprint.to_dict()
    saved["model"] = {k: v for k, v in saved["model"].items() if k not in missing}
    return {"fingerprint": saved}


def test_fields_newer_than_the_checkpoint_compare_as_their_defaults():
    now = Fingerprint.of(load_preset("tiny"), OptimConfig())
    assert now.differences(_older(now, "layer_types", "layer_pattern")) == []


def test_a_new_field_set_away_from_its_default_is_a_difference():
    saved = _older(Fingerprint.of(load_preset("tiny"), OptimConfig()), "layer_pattern")
    mixed = Fingerprint.of(load_preset("tiny", {"layer_pattern": ["gqa", "mla"]}), OptimConfig())
    assert mixed.differences(saved) == [
        "model.layer_pattern=[] in the checkpoint, ['gqa', 'mla'] now"
    ]


def test_how_the_delta_rule_is_computed_may_change_on_resume():
    saved = {"fingerprint": Fingerprint.of(load_preset("tiny_hybrid"), OptimConfig()).to_dict()}
    other = {"gdn.chunk_size": 16, "gdn.kernel": "torch", "kda.kernel": "fla"}
    now = Fingerprint.of(load_preset("tiny_hybrid", other), OptimConfig())
    assert now.differences(saved) == []
    wider = Fingerprint.of(load_preset("tiny_hybrid", {"gdn.head_dim": 32}), OptimConfig())
    assert wider.differences(saved) == ["model.gdn.head_dim=64 in the checkpoint, 32 now"]
