"""The dependency arrows between the packages and between the layers inside model/, parallel/ and
trainer/ (docs/architecture.md), checked on the source (every import, even nested)."""

from __future__ import annotations

import ast
import subprocess
import sys
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


# Inside model/: the layers of docs/architecture.md. The base (config, registry, roles, init, norms,
# loss, training_hooks) is below the components (mixers/, residual/, moe/, engram/), which are
# below the assembly (block, transformer) and what uses the assembled model (mtp/, generate,
# accounting, inspect, presets, hf/). kernels/ needs nothing of the model at all.
ASSEMBLED = {
    "model.block",
    "model.transformer",
    "model.generate",
    "model.accounting",
    "model.inspect",
    "model.planner",
    "model.planner_activations",
    "model.presets",
    "model.hf",
    "model.mtp",
}
LAYERS = {
    "model/mixers": ASSEMBLED | {"model.residual", "model.engram", "model.moe", "model.ffn"},
    "model/residual": ASSEMBLED | {"model.mixers", "model.engram", "model.moe", "model.ffn"},
    "model/moe": ASSEMBLED | {"model.mixers", "model.residual", "model.engram", "model.ffn"},
    "model/engram": ASSEMBLED | {"model.moe", "model.ffn"},
    "model/mtp": {"model.hf", "model.inspect", "model.presets"},
}


def imported_names(path: Path) -> set[str]:
    """imported_modules plus `pkg.name` for every `from pkg import name` (a module imported so)."""
    names = imported_modules(path)
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _matches(name: str, prefixes: set[str]) -> bool:
    return any(name == f or name.startswith(f + ".") for f in prefixes)


def _layer_violations(folder: str, forbidden: set[str]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / folder).rglob("*.py"))
        for name in sorted(imported_names(path))
        if _matches(name, forbidden)
    ]


@pytest.mark.parametrize("folder", sorted(LAYERS))
def test_model_layers_import_only_downwards(folder):
    assert _layer_violations(folder, LAYERS[folder]) == []


def _outside(folder: str, own: str, allowed: set[str]) -> list[str]:
    """Imports of `own`'s package (model, trainer, ...) from `folder` that are neither `own` nor
    in `allowed`."""
    package = own.split(".")[0]
    return [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / folder).rglob("*.py"))
        for name in sorted(imported_names(path))
        if _matches(name, {package}) and not _matches(name, {own} | allowed) and name != package
    ]


def test_the_kernels_need_nothing_else_of_the_model():
    assert _outside("model/kernels", "model.kernels", set()) == []


def test_checkpoints_sit_below_the_loop_and_the_app():
    """trainer/checkpoint/ knows the process group helpers, not the loop, step, app or export."""
    assert _outside("trainer/checkpoint", "trainer.checkpoint", {"trainer.distributed"}) == []


def test_parallel_reaches_deepspeed_only_through_its_registration():
    """parallel/__init__.py imports the DeepSpeed engine to register it; nothing else in
    parallel/ outside parallel/deepspeed/ does (the engine is chosen from ENGINES)."""
    found = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / "parallel").rglob("*.py"))
        if "deepspeed" not in path.relative_to(ROOT / "parallel").parts[:-1]
        and path != ROOT / "parallel" / "__init__.py"
        for name in sorted(imported_names(path))
        if _matches(name, {"parallel.deepspeed", "deepspeed"})
    ]
    assert found == []


def test_importing_parallel_leaves_deepspeed_unimported():
    code = "import sys, parallel\nprint('deepspeed' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_layer_checks_catch_what_they_forbid(tmp_path):
    sample = tmp_path / "model" / "mixers" / "sample.py"
    sample.parent.mkdir(parents=True)
    sample.write_text("from model import transformer\nfrom model.moe.layer import MoE\n")
    assert {"model.transformer", "model.moe.layer"} <= imported_names(sample)
    assert _matches("model.moe.layer", LAYERS["model/mixers"])
    assert _matches("model.transformer", LAYERS["model/mixers"])
    assert not _matches("model.mixers.mixer", LAYERS["model/mixers"])
    assert not _matches("model.mtp_extra", {"model.mtp"})


ARCHITECTURE = ROOT / "docs" / "architecture.md"


def test_the_architecture_page_lists_every_model_file_and_subpackage():
    """A new file at model/'s top or a new subpackage anywhere must be placed on the page."""
    page = ARCHITECTURE.read_text()
    flat = [p.name for p in sorted((ROOT / "model").glob("*.py")) if p.name != "__init__.py"]
    subpackages = [
        f"{init.parent.relative_to(ROOT)}/"
        for package in ("model", "data", "optim", "parallel", "trainer", "launch")
        for init in sorted((ROOT / package).glob("*/__init__.py"))
    ]
    assert [name for name in flat + subpackages if name not in page] == []
