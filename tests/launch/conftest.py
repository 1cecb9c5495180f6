"""Fixtures of the launch tests: the trainer tests' small dataset, prepared once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.helpers import make_dataset


@pytest.fixture(scope="session")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("launch_data"))
