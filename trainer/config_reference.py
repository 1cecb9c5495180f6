"""docs/config-reference.md, generated from the config dataclasses: every key, its default and the
comment the code gives it, so the documented defaults cannot drift from the code.

    python -m trainer.config_reference docs/config-reference.md   # rewrite the page
    python -m trainer.config_reference                            # print it

tests/test_docs.py fails when the page differs from what this writes.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path

from omegaconf import OmegaConf

import data.prepare  # noqa: F401  (registers prepare's schema)
from data.config import PrepareConfig
from trainer.config import CONF_DIR, RootConfig
from trainer.export import ExportConfig

REQUIRED = "(required)"
GROUPS = ("model", "data", "optim", "trainer", "checkpoint", "logging", "parallel", "eval")
HEADER = """# Configuration reference

Every setting of `python -m trainer`, `python -m data.prepare` and `python -m trainer.export`, with
its default and what it does. Generated from the config dataclasses by
`python -m trainer.config_reference docs/config-reference.md` (a test fails when this page and the
code differ); [training.md](training.md) explains how to set them. Override any key on the command
line (`trainer.max_steps=1000`), pick a group's preset (`model=qwen3_0_6b`, `optim=muon`), or print
the composed settings of a command with `python -m trainer --cfg job <overrides>`.

The defaults below are the dataclasses'. The `model` group's default preset is `tiny` (its values
are listed under [Presets](#presets)); every other group's default preset sets nothing.
"""


def _field_comments(cls: type) -> dict[str, str]:
    """{field name: its comment}: the comment lines right above the field and those on its own
    lines (a default that wraps keeps its comment inside the parentheses)."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments = {
        token.start[0]: token.string.lstrip("#").strip()
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    }
    lines = source.splitlines()
    (node,) = ast.parse(source).body
    found: dict[str, str] = {}
    for item in node.body:  # type: ignore[attr-defined]
        if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
            continue
        above, line = [], item.lineno - 1
        while line in comments and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        own = [comments[n] for n in range(item.lineno, item.end_lineno + 1) if n in comments]
        found[item.target.id] = " ".join(above + own)
    return found


def _dataclass_of(annotation: object) -> type | None:
    """The dataclass an annotation names (also inside `X | None`), else None."""
    if dataclasses.is_dataclass(annotation):
        return annotation  # type: ignore[return-value]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            return inner[0]
    return None


def _shown(value: object) -> str:
    if isinstance(value, str):
        return f'`"{value}"`' if value == "" else f"`{value}`"
    if isinstance(value, list | tuple):
        return "`[" + ",".join(str(v) for v in value) + "]`"
    return f"`{value}`"


def rows(cls: type, instance: object, prefix: str) -> list[tuple[str, str, str]]:
    """(key, default, comment) of every leaf setting of a dataclass, nested ones flattened."""
    hints = typing.get_type_hints(cls)
    comments = _field_comments(cls)
    found: list[tuple[str, str, str]] = []
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name)
        inner = _dataclass_of(hints[f.name])
        if inner is not None and value is not None:
            found += rows(inner, value, f"{prefix}{f.name}.")
            continue
        comment = comments.get(f.name, "").replace("|", "\\|")
        found.append((f"{prefix}{f.name}", _shown(value), comment))
    return found


def _table(entries: list[tuple[str, str, str]]) -> list[str]:
    lines = ["| key | default | meaning |", "|---|---|---|"]
    lines += [f"| `{key}` | {default} | {comment} |" for key, default, comment in entries]
    return lines


def _presets() -> list[str]:
    lines = ["## Presets", ""]
    lines.append(
        "What each shipped preset sets (`conf/<group>/<name>.yaml`); the rest is the default."
    )
    for group in GROUPS:
        for path in sorted((CONF_DIR / group).glob("*.yaml")):
            chosen = OmegaConf.to_container(OmegaConf.load(path))
            if not chosen:
                continue
            flat = _flatten(chosen, "")
            sets = ", ".join(f"`{k}={_plain(v)}`" for k, v in flat)
            lines += ["", f"- `{group}={path.stem}`: {sets}"]
    return lines


def _flatten(node: dict, prefix: str) -> list[tuple[str, object]]:
    found: list[tuple[str, object]] = []
    for key, value in node.items():
        if key == "defaults":
            continue
        if isinstance(value, dict):
            found += _flatten(value, f"{prefix}{key}.")
        else:
            found.append((f"{prefix}{key}", value))
    return found


def _plain(value: object) -> str:
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value)


def render() -> str:
    root = RootConfig()
    lines = [HEADER]
    for group in GROUPS:
        cls = typing.get_type_hints(RootConfig)[group]
        lines += [f"## {group}", "", *_table(rows(cls, getattr(root, group), f"{group}.")), ""]
    top = [r for r in rows(RootConfig, root, "") if r[0].split(".")[0] not in GROUPS]
    lines += ["## Run", "", "Top-level keys (`seed=1`, `resume=none`).", "", *_table(top), ""]
    lines += ["## data.prepare", "", "`python -m data.prepare <key=value ...>`.", ""]
    lines += [*_table(rows(PrepareConfig, PrepareConfig(), "")), ""]
    lines += ["## trainer.export", "", "`python -m trainer.export <key=value ...>`.", ""]
    lines += [*_table(rows(ExportConfig, ExportConfig(path=REQUIRED, out=REQUIRED), "")), ""]
    lines += [*_presets(), ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    text = render()
    if not argv:
        sys.stdout.write(text)
        return 0
    Path(argv[0]).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
