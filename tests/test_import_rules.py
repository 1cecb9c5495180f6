"""The dependency arrows between the packages (README.md, "Layout"), checked on the source (every import, even nested)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "model": {"torch.distributed", "hydra", "omegaconf", "data", "optim", "parallel", "trainer"},
    "data": {"model", "optim", "parallel", "trainer"},
    "optim": {"data", "parallel", "trainer"},
    "parallel": {"trainer", "data", "optim"},
}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def _violations(package: str) -> list[str]:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in imported_modules(path):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[package]):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    return bad


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_respects_the_dependency_arrows(package):
    assert _violations(package) == []


def test_the_checker_catches_a_forbidden_import(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    import torch.distributed as dist\n    from trainer import x\n")
    assert {"torch.distributed", "trainer"} <= imported_modules(sample)
