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


# The training step and loop know no model feature: features take part through training hooks
# (model.training_hooks). From model/ and optim/ they import only these modules.
STEP_AND_LOOP = ("trainer/step.py", "trainer/loop.py")
FEATURE_FREE = {"model.training_hooks", "model.config", "optim.schedules"}


def _feature_imports(path: Path) -> set[str]:
    project = {n for n in imported_modules(path) if n.split(".")[0] in ("model", "optim")}
    return project - FEATURE_FREE


def _probes(path: Path) -> list[str]:
    """getattr/hasattr calls: how code that should not know a feature finds one anyway."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        f"{path.name}:{node.lineno} {node.func.id}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr")
    ]


@pytest.mark.parametrize("name", STEP_AND_LOOP)
def test_the_step_and_the_loop_know_no_model_feature(name):
    path = ROOT / name
    assert _feature_imports(path) == set()
    assert _probes(path) == []


def _model_classes_in_isinstance(path: Path) -> list[str]:
    """isinstance checks against a class imported from model/ (parallel decides by role)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    from_model = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "model"
        for alias in node.names
    }
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance"):
            continue
        kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
        found += [
            f"{path.name}:{node.lineno} {k.id}" for k in kinds if getattr(k, "id", "") in from_model
        ]
    return found


def test_parallel_code_never_asks_for_a_model_class():
    found = [
        hit
        for path in sorted((ROOT / "parallel").rglob("*.py"))
        for hit in _model_classes_in_isinstance(path)
    ]
    assert found == []


def test_the_feature_checks_catch_what_they_forbid(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from model.moe import MoE\nfrom model.training_hooks import TrainingHook\n"
        "def f(m):\n    return isinstance(m, (int, MoE)) or getattr(m, 'mtp', None)\n"
    )
    assert _feature_imports(sample) == {"model.moe"}
    assert _probes(sample) == ["sample.py:4 getattr"]
    assert _model_classes_in_isinstance(sample) == ["sample.py:4 MoE"]
