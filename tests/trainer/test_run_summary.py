"""The lines that end a run say what this launch did: a fresh run's steps, a resumed run's steps
from where it resumed, and a launch that had nothing left to train says how to train on."""

from __future__ import annotations

from pathlib import Path

from trainer.progress import RunClock, summary


def first_line(first_step: int, final_step: int) -> str:
    run_clock = RunClock(first_step=first_step)
    run_clock.add_window(2.0, 2048)
    return summary(final_step, run_clock, 0, 5.0, Path("runs/x"), None)[0]


def test_a_fresh_run_counts_its_steps():
    assert first_line(0, 20).startswith("done: 20 steps in ")


def test_a_resumed_run_names_where_it_resumed_and_what_it_trained():
    line = first_line(20, 40)
    assert line.startswith("done: step 40 (20 steps from step 20 in "), line
    assert "1,024 tokens/s of training" in line


def test_a_run_resumed_at_its_last_step_says_how_to_train_on():
    line = first_line(20, 20)
    assert line.startswith("nothing to train: the run is already at step 20,"), line
    assert "raise trainer.max_steps" in line
