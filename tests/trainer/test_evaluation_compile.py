"""When a compiled run compiles its validation forwards (trainer.config.compiles_evaluation):
the count of evaluations a process runs, against the loop's schedule stepped through."""

from __future__ import annotations

import pytest

from model.errors import ConfigError
from trainer.config import (
    COMPILE_MIN_STEPS,
    EVAL_COMPILE_MIN_BATCHES,
    TrainerConfig,
    compiles,
    compiles_evaluation,
    evaluations_left,
)


def evaluations_by_stepping(max_steps: int, eval_every: int, start: int) -> int:
    """trainer/loop.py's schedule: step 0 of a fresh run, then after each step taken, when it is
    a multiple of eval_every or the last."""
    count = 1 if start == 0 and start < max_steps else 0
    for step in range(start + 1, max_steps + 1):
        if (eval_every and step % eval_every == 0) or step == max_steps:
            count += 1
    return count


@pytest.mark.parametrize("max_steps", [1, 3, 50, 99, 100, 101, 2450])
@pytest.mark.parametrize("eval_every", [0, 1, 7, 50, 100])
@pytest.mark.parametrize("start", [0, 1, 49, 50, 98, 100, 2400, 2450])
def test_evaluations_left_follows_the_loops_schedule(max_steps, eval_every, start):
    expected = evaluations_by_stepping(max_steps, eval_every, start)
    assert evaluations_left(max_steps, eval_every, start) == expected


@pytest.mark.parametrize(
    ("compile_", "compile_eval", "batches", "expected"),
    [
        ("true", "auto", EVAL_COMPILE_MIN_BATCHES - 1, False),
        ("true", "auto", EVAL_COMPILE_MIN_BATCHES, True),
        ("true", "true", 1, True),
        ("true", "false", 10**6, False),
        ("false", "true", 10**6, False),  # eager runs compile nothing
        ("auto", "auto", 10**6, False),  # a run shorter than COMPILE_MIN_STEPS stays eager
    ],
)
def test_compiles_evaluation(compile_, compile_eval, batches, expected):
    steps = COMPILE_MIN_STEPS - 1
    trainer = TrainerConfig(compile=compile_, compile_eval=compile_eval, max_steps=steps)
    assert compiles_evaluation(compiles(trainer), compile_eval, batches) is expected


def test_a_resumed_run_counts_only_its_own_evaluations():
    """2450 steps, eval_every 50, 10 batches each: 500 batches from the start (compiled); 10 for
    a process resumed at step 2400, which evaluates only at step 2450 (eager: the compile would
    not pay back in that process)."""
    assert compiles_evaluation(True, "auto", 10 * evaluations_left(2450, 50, 0))
    assert not compiles_evaluation(True, "auto", 10 * evaluations_left(2450, 50, 2400))


def test_compile_eval_takes_yaml_booleans_and_names_a_bad_value():
    assert TrainerConfig(compile_eval=True).compile_eval == "true"
    with pytest.raises(ConfigError, match="trainer.compile_eval='sometimes' is not one of"):
        TrainerConfig(compile_eval="sometimes")
