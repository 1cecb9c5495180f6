"""`prepare.json`: the settings (and source files) a dataset directory was begun with, and the
tokenizer identity it was made with.

Once a shard exists, a later run into the same directory must match the settings; before that,
a run with other settings simply starts over. The tokenizer identity is recorded as soon as the
tokenizer is saved, so a repair can tell a swapped `tokenizer/` folder even after the manifest
of a damaged dataset was dropped.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from data.atomic import atomic_write_json
from data.config import PrepareConfig
from data.errors import DataError
from data.manifest import MANIFEST, SPLITS, Manifest
from data.sources import Source
from data.tokenizer import TokenizerIdentity

SETTINGS_FILE = "prepare.json"
# settings that older prepare.json files lack: such a directory is finished or repaired the way
# it was begun (piece_chars: documents were never cut into pieces then)
LEGACY_SETTINGS = ("piece_chars",)


def claim(out: Path, cfg: PrepareConfig, source: Source) -> set[str]:
    """Record the settings (and the source's file list) before the first shard; once a shard
    exists, a later run into the same directory must match them. Before that, a run with other
    settings (say, after fixing a bad text_column) simply starts over. Returns the settings
    that the directory's prepare.json predates (they must keep their old behaviour)."""
    path = out / SETTINGS_FILE
    wanted = cfg.fingerprint() | {"source_files": source.files_digest()}
    try:
        had = read_settings(out) if path.is_file() else None
    except DataError:
        if has_shards(out):
            raise
        had = None  # nothing was written under it yet: start over
    if had is not None:
        if had.get("source_files") == source.files_digest(legacy=True):
            had["source_files"] = wanted["source_files"]  # recorded before paths were resolved
        if had.get("source") == cfg.source:
            had["source"] = wanted["source"]
        legacy = {key for key in LEGACY_SETTINGS if key not in had}
        for key in legacy:  # added since: compared as equal, and prepared as they were then
            had[key] = wanted[key]
        diff = {k: (had.get(k), v) for k, v in wanted.items() if had.get(k) != v}
        if diff and has_shards(out):
            if set(diff) == {"source_files"}:
                raise DataError(
                    f"the files of source={cfg.source} changed since out={out} got its first "
                    f"shards (names or sizes differ); finishing would mix two corpora. Restore "
                    f"them, or choose another out= (or delete it) to start over"
                )
            changes = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())
            raise DataError(
                f"out={out} was prepared with other settings ({changes}); choose another out= "
                f"or delete the directory to start over"
            )
        if not diff:
            return legacy
        shutil.rmtree(out / "tokenizer", ignore_errors=True)  # made under the old settings
    atomic_write_json(path, wanted)
    return set()


def read_settings(out: Path) -> dict:
    """prepare.json as a dict ({} when absent); a damaged one is named with the way out."""
    path = out / SETTINGS_FILE
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        raw = None
    if not isinstance(raw, dict):
        raise DataError(
            f"{path} is damaged (not the JSON data.prepare writes), so the settings of the shards "
            f"in {out} are unknown; restore it, or delete {out} and prepare again"
        )
    return raw


def has_shards(out: Path) -> bool:
    """A shard has been committed: the settings are then fixed for this directory."""
    return any(True for split in SPLITS for _ in (out / split).glob("*.json"))


def recorded_tokenizer(out: Path) -> TokenizerIdentity | None:
    """The identity of the tokenizer this dataset was made with (prepare.json, or the
    manifest of a finished dataset)."""
    settings = read_settings(out)
    if "tokenizer_identity" in settings:
        return TokenizerIdentity.from_dict(settings["tokenizer_identity"])
    if (out / MANIFEST).is_file():
        return Manifest.load(out).tokenizer
    return None


def remember_tokenizer(out: Path, identity: TokenizerIdentity) -> None:
    atomic_write_json(
        out / SETTINGS_FILE, read_settings(out) | {"tokenizer_identity": identity.to_dict()}
    )
