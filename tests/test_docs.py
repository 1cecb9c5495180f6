"""The documentation cannot drift from the code: every command in README.md and docs/ is composed
and validated (the trainer's, prepare's and export's settings through Hydra as the command would;
torchrun's options by torchrun's own parser; scripts' flags against their --help) or run
(`model.inspect`, the launcher's dry run, Python blocks); every link and anchor resolves; the
configuration reference is the one the code generates; defaults quoted in prose are the code's.
tests/test_docs_recipes.py runs README.md's recipes for real, in order, as a newcomer would.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from model.transformer import build_model
from tests.commands import OFFLINE, ROOT
from tests.docs_pages import (
    Block,
    Command,
    all_blocks,
    all_commands,
    anchors,
    blocks,
    links,
    pages,
)
from trainer import config_reference
from trainer.build import check_start
from trainer.config import CONF_DIR, RootConfig
from trainer.hf_init import is_hf
from trainer.settings import check_settings, hydra_args, is_sweep

COMMANDS = all_commands()
README_MAX_LINES = 260  # "at most about 250"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_configuration_reference_is_what_the_code_generates():
    page = ROOT / "docs" / "config-reference.md"
    assert page.read_text(encoding="utf-8") == config_reference.render(), (
        "docs/config-reference.md is stale: python -m trainer.config_reference "
        "docs/config-reference.md"
    )


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move detail to docs/"


def test_the_documentation_shows_commands():
    assert len(COMMANDS) >= 60 and len(pages()) >= 12


LANGUAGES = {"bash", "python", "python skip", "text", "yaml", "json", "toml"}


def test_every_code_block_says_what_it_holds():
    """Commands are checked only in `bash` blocks and Python only in `python` ones: a block
    labelled otherwise (console, sh, none) would escape the checks."""
    odd = [
        f"{page.relative_to(ROOT)}:{block.line} {block.language!r}"
        for page in pages()
        for block in blocks(page)
        if block.language not in LANGUAGES
    ]
    assert not odd, f"label these blocks with one of {sorted(LANGUAGES)}: {odd}"


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_anchor_resolves(page: Path):
    broken = []
    for line, target in links(page):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"line {line}: {target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"line {line}: {target} (no heading #{anchor} in {file.name})")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_page_is_reachable_from_the_readme():
    reached, todo = set(), [ROOT / "README.md"]
    while todo:
        page = todo.pop()
        if page in reached:
            continue
        reached.add(page)
        for _, target in links(page):
            path = target.partition("#")[0]
            if path.endswith(".md") and not re.match(r"^[a-z]+:", path):
                todo.append((page.parent / path).resolve())
    orphans = [str(p.relative_to(ROOT)) for p in pages() if p.resolve() not in reached]
    assert not orphans, f"pages no link reaches from README.md: {orphans}"


# ------------------------------------------------------------------ commands


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("home")


def expand(argv: tuple[str, ...], home: Path) -> list[str]:
    """`$HOME` and a leading `~` as the shell would expand them."""
    return [a.replace("$HOME", str(home)).replace("=~/", f"={home}/") for a in argv]


def compose_group(config_name: str, overrides: list[str]) -> object:
    """A command's typed config, composed by Hydra as its `hydra.main` would."""
    import data.prepare  # noqa: F401  (registers prepare's schema)
    import trainer.eval  # (registers its schema)
    import trainer.export  # noqa: F401

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        composed = compose(config_name=config_name, overrides=overrides)
    GlobalHydra.instance().clear()
    return OmegaConf.to_object(composed)


def first_of_each_sweep(overrides: list[str]) -> list[str]:
    """A sweep's overrides (`optim.lr=1e-3,3e-3`) with the first value of each: one job of it."""
    chosen = []
    for override in overrides:
        key, _, value = override.partition("=")
        if "," in value and not value.startswith(("[", "'", '"')) and not key.startswith("hydra"):
            value = value.split(",")[0]
        chosen.append(f"{key}={value}" if _ else override)
    return chosen


def check_trainer(overrides: list[str], world_size: int | None = 1) -> None:
    """Composed and validated as `python -m trainer` does; with the command's number of ranks
    (None: not known from the command), also the start-up rules of the layout, the batch plan
    and the model's shape, and the model built on the meta device."""
    args = hydra_args(overrides)
    chosen = [o for o in args.overrides if not o.lstrip("+").startswith("hydra/")]
    if is_sweep(args):
        chosen = first_of_each_sweep(chosen)
    for group in (o for o in args.overrides if o.startswith("hydra/")):
        name, _, value = group.partition("=")
        assert (CONF_DIR / name / f"{value}.yaml").exists(), f"no Hydra preset {group}"
    cfg = check_settings(chosen, args.config_name)
    assert isinstance(cfg, RootConfig)
    if world_size is not None:
        check_start(cfg, world_size)
    if not is_hf(cfg.init_from):  # else the model is the checkpoint's
        vocab = cfg.model.vocab_size or 8192  # 0: the tokenizer's, known once data is read
        build_model(dataclasses.replace(cfg.model, vocab_size=vocab), device="meta")


def check_torchrun(argv: list[str]) -> None:
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(argv[1:])
    assert args.module and args.training_script == "trainer", "torchrun runs `-m trainer` here"
    nodes = str(args.nnodes).split(":")[-1]  # "2" or "1:4" (elastic: the largest)
    nproc = str(args.nproc_per_node)
    world = int(nodes) * int(nproc) if nodes.isdigit() and nproc.isdigit() else None
    check_trainer(list(args.training_script_args), world)


def check_flags(source: Path, argv: list[str]) -> None:
    """Every `--flag` a command passes is one the script or module defines (read from its source
    and the bench/ helpers it imports: running `--help` would start torch once per script, and a
    script without argparse would run)."""
    assert source.is_file(), f"no {source.relative_to(ROOT)}"
    text = source.read_text(encoding="utf-8")
    for helper in re.findall(r"^from bench\.(\w+) import", text, re.M):
        text += (ROOT / "bench" / f"{helper}.py").read_text(encoding="utf-8")
    defined = set(re.findall(r"[\"'](--[\w-]+)[\"']", text))
    if "argparse" in text:
        defined.add("--help")
    flags = {a.split("=")[0] for a in argv if a.startswith("--")}
    missing = sorted(flags - defined)
    assert not missing, f"{source.relative_to(ROOT)} defines no {missing}"


def module_source(module: str) -> Path:
    path = ROOT / module.replace(".", "/")
    return path / "__main__.py" if path.is_dir() else path.with_suffix(".py")


def run_in_process(argv: list[str], home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m model.inspect ...` and `python -m launch.torchrun ... --dry-run`, in this process."""
    from launch import torchrun
    from model import inspect

    monkeypatch.chdir(home)
    monkeypatch.setenv("HOME", str(home))
    for key in ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "TORCHELASTIC_SIGNALS_TO_HANDLE"):
        monkeypatch.setenv(key, os.environ.get(key, ""))  # the launcher sets them: restored after
    if argv[2] == "model.inspect":
        assert inspect.main(argv[3:]) == 0
    else:
        dry = [] if "--dry-run" in argv else ["--dry-run"]
        assert torchrun.main([*dry, *argv[3:]]) == 0  # before a `--`


def check_pytest(argv: list[str]) -> None:
    markers = {m.split(":")[0] for m in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]}
    args = argv[argv.index("pytest") + 1 :]
    for i, arg in enumerate(args):
        if arg == "-m":
            named = set(re.findall(r"[a-z_]+", args[i + 1])) - {"not", "and", "or"}
            assert named <= markers, f"unknown markers {named - markers}"
        elif arg.startswith("tests"):
            assert (ROOT / arg.split("::")[0]).exists(), f"no {arg}"


def check_lm_eval(argv: list[str]) -> None:
    """lm-eval's own parser reads the options (`run` is its default command)."""
    from lm_eval.__main__ import HarnessCLI

    args = HarnessCLI()._parser.parse_args(["run", *argv])
    assert args.model == "lmforge", "the lmforge command scores with --model lmforge"


def check_make(argv: list[str]) -> None:
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    assert set(argv[1:]) <= targets, f"no make target {set(argv[1:]) - targets}"


def check_pip(argv: list[str]) -> None:
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    for arg in argv:
        found = re.fullmatch(r"\.?\[([\w,-]+)\]", arg.strip("'\""))
        if found:
            assert set(found[1].split(",")) <= extras, f"no extra {found[1]} in pyproject.toml"


def check_sbatch(argv: list[str]) -> None:
    script = next(a for a in argv[1:] if not a.startswith("-"))
    assert (ROOT / script).is_file(), f"no {script}"
    check_trainer([a for a in argv[argv.index(script) + 1 :] if "=" in a], None)


def check_file(argv: list[str]) -> None:
    assert (ROOT / argv[1]).is_file(), f"no {argv[1]}"


ACCEPTED = {"git", "cd", "export", "wandb", "nvidia-smi", "sinfo", "squeue", "scancel", "ls", "cat"}
ACCEPTED |= {"tail", "du", "tree", "nproc", "lscpu"}
ACCEPTED |= {"lm_eval"}  # EleutherAI's harness on an exported checkpoint: not a dependency


def check_command(argv: list[str], home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Composes, validates or runs one documented command; fails on a kind it does not know."""
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):  # `CI=1 python -m pytest`
        argv = argv[1:]
    head = argv[:3]
    if head == ["python", "-m", "trainer"]:
        check_trainer(argv[3:])
    elif argv[0] == "torchrun":
        check_torchrun(argv)
    elif head == ["python", "-m", "trainer.export"]:
        compose_group("export", argv[3:])
    elif head == ["python", "-m", "trainer.eval"]:
        compose_group("eval", argv[3:])
    elif head == ["python", "-m", "trainer.lm_eval_model"]:
        check_lm_eval(argv[3:])
    elif head == ["python", "-m", "data.prepare"]:
        compose_group("prepare", argv[3:])
    elif head in (["python", "-m", "model.inspect"], ["python", "-m", "launch.torchrun"]):
        run_in_process(argv, home, monkeypatch)
    elif head[:2] == ["python", "-m"] and head[2] != "pytest":
        check_flags(module_source(argv[2]), argv)
    elif argv[0] == "python" and argv[1].startswith("bench/"):
        check_flags(ROOT / argv[1], argv)
    elif "pytest" in argv[:3]:
        check_pytest(argv)
    elif argv[0] == "make":
        check_make(argv)
    elif argv[0] == "pip":
        check_pip(argv)
    elif argv[0] == "sbatch":
        check_sbatch(argv)
    elif argv[0] == "bash":
        check_file(argv)
    else:
        assert argv[0] in ACCEPTED, (
            f"no rule checks `{argv[0]}` commands: add one to tests/test_docs.py or write the "
            "command differently (docs/testing.md, 'Documentation')"
        )


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.where)
def test_every_documented_command_composes_or_runs(
    command: Command, home: Path, monkeypatch: pytest.MonkeyPatch
):
    try:
        check_command(expand(command.argv, home), home, monkeypatch)
    except Exception as err:  # the command and where it is, not only the checker's traceback
        raise AssertionError(f"{command}\n  -> {type(err).__name__}: {err}") from err


# ------------------------------------------------------------------ Python blocks


def _block_id(block: Block) -> str:
    return f"{block.page.relative_to(ROOT)}:{block.line}"


@pytest.mark.parametrize("block", all_blocks("python"), ids=_block_id)
def test_every_python_block_runs(block: Block, tmp_path: Path):
    script = tmp_path / "block.py"
    script.write_text(block.text + "\n", encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env=os.environ | OFFLINE | {"HOME": str(tmp_path), "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, f"{_block_id(block)}:\n{done.stderr[-3000:]}"


def test_skipped_python_blocks_say_why():
    for block in all_blocks("python skip"):
        before = block.page.read_text(encoding="utf-8").splitlines()[: block.line - 1]
        assert any(line.strip() for line in before[-2:]), f"{_block_id(block)}: say why above it"


# ------------------------------------------------------------------ quoted defaults

DEFAULT = re.compile(
    r"`((?:model|data|optim|trainer|checkpoint|logging|parallel)\.[\w.]+)`"
    r"\s*\((?:the )?default:?\s*(`[^`]+`|[^`),;\s]+)[),;]"
)
KEY = r"`((?:model|data|optim|trainer|checkpoint|logging|parallel)\.[\w.]+)`"
VALUE_IN_PARENTHESES = re.compile(KEY + r"\s*\(([0-9][\w.+-]*)\)")  # `optim.ns_steps` (5)
VALUE_AFTER = re.compile(KEY + r"\s+([0-9][\w.+-]*?)[,;]")  # `optim.beta1` 0.9, ...
ASSIGNED_DEFAULT = re.compile(
    r"`((?:model|data|optim|trainer|checkpoint|logging|parallel)\.[\w.]+)=([^`\s]+)`"
    r"\s*\((?:the )?default\)"
)


def reference_defaults() -> dict[str, str]:
    root = RootConfig()
    found = {}
    for group in config_reference.GROUPS:
        cls = type(getattr(root, group))
        for key, shown, _ in config_reference.rows(cls, getattr(root, group), f"{group}."):
            found[key] = shown.strip("`").strip('"')
    return found


def test_defaults_quoted_in_the_docs_are_the_code_s():
    known = reference_defaults()
    wrong, checked = [], 0
    for page in pages():
        text = page.read_text(encoding="utf-8").replace("\n", " ")
        patterns = (DEFAULT, ASSIGNED_DEFAULT, VALUE_IN_PARENTHESES, VALUE_AFTER)
        for match in (m for pattern in patterns for m in pattern.finditer(text)):
            key, value = match[1], match[2].strip().strip("`")
            if key not in known:
                continue
            checked += 1
            if _normal(value) != _normal(known[key]):
                wrong.append(f"{page.relative_to(ROOT)}: {key} default {value}, code {known[key]}")
    assert not wrong, "; ".join(wrong)
    assert checked >= 15, "the patterns no longer find quoted defaults"


def _normal(value: str) -> str:
    value = value.strip().lower().strip("'\"")
    try:
        return repr(float(value))
    except ValueError:
        return value
