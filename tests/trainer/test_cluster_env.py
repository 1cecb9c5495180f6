"""Ranks from the launcher's environment: torchrun's variables checked, plain srun's mapped."""

from __future__ import annotations

import pytest

from trainer.cluster_env import (
    LaunchEnvError,
    check_ranks,
    map_srun_env,
    slurm_port,
    tasks_per_node,
)


def test_slurm_tasks_per_node_expands_repeats() -> None:
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]
    with pytest.raises(LaunchEnvError, match="not SLURM's format"):
        tasks_per_node("2x3")


def _srun(**extra: str) -> dict[str, str]:
    env = {
        "SLURM_JOB_ID": "1234",
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_TASKS_PER_NODE": "2(x2)",
        "MASTER_ADDR": "node0",
    }
    return env | extra


def test_plain_srun_tasks_get_torch_variables() -> None:
    env = _srun()
    map_srun_env(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("3", "4", "1")
    assert env["LOCAL_WORLD_SIZE"] == "2"  # unset by srun: derived from SLURM_TASKS_PER_NODE
    assert env["MASTER_PORT"] == str(slurm_port("1234")) == "21234"
    assert check_ranks(env) == (3, 4, 1)


def test_torchrun_variables_are_left_alone_and_one_process_needs_nothing() -> None:
    env = _srun(RANK="0", WORLD_SIZE="8", LOCAL_RANK="0")  # torchrun inside an srun task
    map_srun_env(env)
    assert env["WORLD_SIZE"] == "8" and "LOCAL_WORLD_SIZE" not in env
    single: dict[str, str] = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    map_srun_env(single)
    assert check_ranks(single) == (0, 1, 0)
    # the batch script of a 4-task job is not a rank: it has no SLURM_STEP_NUM_TASKS
    batch = {k: v for k, v in _srun().items() if k != "SLURM_STEP_NUM_TASKS"}
    map_srun_env(batch)
    assert "RANK" not in batch and check_ranks(batch) == (0, 1, 0)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (_srun(WORLD_SIZE="2"), "WORLD_SIZE=2 but SLURM_STEP_NUM_TASKS=4"),
        (_srun(SLURM_NODEID="5"), "SLURM_NODEID=5 but SLURM_TASKS_PER_NODE lists 2 nodes"),
    ],
)
def test_srun_variables_that_disagree_are_named(env: dict, message: str) -> None:
    with pytest.raises(LaunchEnvError, match=message):
        map_srun_env(env)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 but RANK is not set"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 is outside WORLD_SIZE=2"),
        ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "disagree"),
        ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "4"}, "disagree"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ],
)
def test_torch_variables_that_disagree_are_named(env: dict, message: str) -> None:
    with pytest.raises(LaunchEnvError, match=message):
        check_ranks(env)


def test_a_missing_master_address_without_scontrol_is_explained(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    env = _srun(SLURM_JOB_NODELIST="node[0-1]")
    del env["MASTER_ADDR"]
    with pytest.raises(LaunchEnvError, match="scontrol is not on PATH"):
        map_srun_env(env)


def test_the_trainer_refuses_contradictory_variables_before_starting(tmp_path) -> None:
    from tests.commands import run_module

    result = run_module("trainer", cwd=tmp_path, env={"WORLD_SIZE": "2", "RANK": "5"})
    assert result.returncode == 2
    assert "error: RANK=5 is outside WORLD_SIZE=2" in result.stderr
    assert not (tmp_path / "runs").exists()  # nothing was written


def test_the_trainer_refuses_a_run_directory_it_cannot_create(tmp_path) -> None:
    from tests.commands import run_module

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    result = run_module("trainer", f"hydra.run.dir={blocker}/run", cwd=tmp_path)
    assert result.returncode == 2
    assert f"run directory {blocker}/run cannot be created" in result.stderr
    assert "Traceback" not in result.stderr
