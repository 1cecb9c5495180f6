"""README.md and docs/ read as data: fenced blocks, the commands in them, links and anchors.

tests/test_docs.py checks every command (run, or composed and validated), every link and every
anchor; the rules for writing them are in docs/testing.md ("Documentation").
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from tests.commands import ROOT

DOCS = ROOT / "docs"
SHELL_LANGUAGES = {"bash", "sh", "shell"}


def pages() -> list[Path]:
    """README.md and every page under docs/."""
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str  # "bash", "python", "python skip", "text", "" ...
    text: str


@dataclass(frozen=True)
class Command:
    page: Path
    line: int
    argv: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.argv)}"


FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a page, in order."""
    found: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, info = opening.groups()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        found.append(Block(page, i + 1, info.strip(), "\n".join(body)))
        i = j + 1
    return found


def commands(block: Block) -> list[Command]:
    """The shell commands of a block: continuations joined, comments and blank lines dropped."""
    if block.language not in SHELL_LANGUAGES:
        return []
    found: list[Command] = []
    logical, start = "", 0
    for offset, line in enumerate(block.text.splitlines(), start=1):
        if not logical:
            start = offset
        comment = line.lstrip().startswith("#")  # its trailing backslash continues nothing
        if line.rstrip().endswith("\\") and not comment:
            logical += line.rstrip()[:-1] + " "
            continue
        argv = shlex.split(logical + line, comments=True)
        logical = ""
        for segment in _segments(argv):  # `cd x && python -m ...`: each command on its own
            found.append(Command(block.page, block.line + start, tuple(segment)))
    return found


SEPARATORS = {"&&", "||", ";", "|"}


def _segments(argv: list[str]) -> list[list[str]]:
    """The commands of one shell line, split at `&&`, `||`, `;` and `|`."""
    segments: list[list[str]] = [[]]
    for token in argv:
        if token in SEPARATORS:
            segments.append([])
        else:
            segments[-1].append(token)
    return [segment for segment in segments if segment]


COMMAND_STARTS = ("python ", "torchrun ", "sbatch ", "pip ", "make ", "lm_eval ")


def table_commands(page: Path) -> list[Command]:
    """Commands written as code spans in table rows (README's recipes), outside fenced blocks."""
    found: list[Command] = []
    in_fence = False
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
        if FENCE.match(line):
            in_fence = not in_fence
        if in_fence or not line.lstrip().startswith("|"):
            continue
        for span in re.findall(r"`([^`]+)`", line):
            if span.startswith(COMMAND_STARTS):
                found.append(Command(page, number, tuple(shlex.split(span))))
    return found


def all_commands() -> list[Command]:
    fenced = [c for page in pages() for block in blocks(page) for c in commands(block)]
    return fenced + table_commands(ROOT / "README.md")  # its recipe table


def all_blocks(language: str) -> list[Block]:
    return [b for page in pages() for b in blocks(page) if b.language == language]


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")  # text may wrap


def links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of every inline link and image outside code blocks and code spans, also
    where the link's text wraps onto the next line."""
    prose: list[str] = []
    in_fence = False
    for line in page.read_text(encoding="utf-8").splitlines():
        fence = FENCE.match(line)
        if fence:
            in_fence = not in_fence
        prose.append("" if in_fence or fence else re.sub(r"`[^`]*`", "", line))
    text = "\n".join(prose)
    found: list[tuple[int, str]] = []
    for match in LINK.finditer(text):
        found.append((text.count("\n", 0, match.start()) + 1, match[1] or match[2]))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, markup and punctuation dropped, spaces -> -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a page (repeats get -1, -2 ... as on GitHub)."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    in_fence = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if in_fence or not heading:
            continue
        base = slug(heading[1])
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found
