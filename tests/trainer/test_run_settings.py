"""Settings resolved once at start-up (trainer/run_settings.py, trainer.app.build_training): the
batch arithmetic in one BatchPlan, each cross-field rule evaluated once, the root config never
changed, and the loop's settings taken from it."""

from __future__ import annotations

import copy

import pytest

import trainer.app as app
import trainer.build as build
from model.errors import ConfigError
from tests.trainer.helpers import small_config
from trainer.run_settings import BatchPlan, plan_batches
from trainer.runtime import Ranks

ONE = Ranks(rank=0, world_size=1, local_rank=0)


def test_the_batch_plan_splits_the_global_batch_over_ranks_and_micro_batches():
    assert plan_batches(16, 2, 4) == BatchPlan(16, 4, 4, 2, 2)
    assert plan_batches(8, 0, 2) == BatchPlan(8, 2, 4, 4, 1)  # 0: the whole local batch


@pytest.mark.parametrize(
    ("batch", "micro", "ranks", "message"),
    [
        (6, 0, 4, "trainer.batch_size=6 is not divisible by the 4 data-parallel ranks"),
        (8, 3, 2, "trainer.batch_size=8 is not divisible by trainer.micro_batch_size=3 x 2"),
    ],
)
def test_the_batch_plan_names_the_sizes_that_do_not_divide(batch, micro, ranks, message):
    with pytest.raises(ConfigError, match=message):
        plan_batches(batch, micro, ranks)


def test_build_training_resolves_each_setting_once_and_leaves_the_config_alone(
    dataset, tmp_path, monkeypatch
):
    calls = {"check_context": 0, "check_expert_count": 0, "check_expert_layout": 0}
    for name in calls:  # the start-up rules live in trainer.build (check_start)
        original = getattr(build, name)

        def counted(*args, _name=name, _original=original):
            calls[_name] += 1
            return _original(*args)

        monkeypatch.setattr(build, name, counted)
    cfg = small_config(dataset, max_steps=3, micro_batch_size=2, precision="auto")
    before = copy.deepcopy(cfg)
    training = app.build_training(cfg, tmp_path, ONE)
    assert calls == {"check_context": 1, "check_expert_count": 1, "check_expert_layout": 1}
    assert cfg == before  # trainer.precision stays auto: the resolved value is passed on
    assert "precision: auto" not in training.config_yaml  # checkpoints record what ran
    assert training.settings.micro_batches == 2
    assert training.loop.tokens_per_step == 4 * 32 and training.loop.max_steps == 3
    assert not hasattr(training, "cfg")
