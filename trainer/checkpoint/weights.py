"""The whole weights of a training checkpoint of either engine, read in one process: what
`python -m trainer.export` writes out, and what `init_from=<checkpoint>` starts a run from
(which is how a run moves between `parallel.engine=fsdp2` and `deepspeed`).

DCP checkpoints are read through the safe reader into a model built from the checkpoint's own
config, or, for export, a part at a time (`newest_weights`: one layer in memory); DeepSpeed's
are consolidated from every rank's fp32 ZeRO partitions (parallel.deepspeed.checkpoint) and
held whole in this process.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from model.config import ModelConfig, config_from_dict
from model.errors import ConfigError
from model.hf import our_part
from model.transformer import build_model
from optim.config import OptimConfig
from parallel.collective import all_true, from_main
from parallel.deepspeed.checkpoint import CHECKPOINT_FOLDER, consolidated_weights
from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.fingerprint import Fingerprint
from trainer.checkpoint.load import DCP, LOAD_ERRORS, format_of, read_checked, read_states
from trainer.checkpoint.save import complete_checkpoints

log = logging.getLogger("trainer.checkpoint")
WeightParts = Iterable[tuple[int | None, dict[str, Tensor]]]  # (part, its tensors); None: all


def candidates(path: Path) -> list[Path]:
    """A checkpoint directory itself, or a run directory's checkpoints, newest first."""
    if path.is_dir() and format_of(path) in (DCP, CHECKPOINT_FOLDER):
        return [path]
    for root in (path / "checkpoints", path):
        found = complete_checkpoints(root)
        if found:
            return found
    raise ConfigError(f"{path} is neither a checkpoint nor a run directory with one")


def _newest(path: Path, purpose: str, verb: str, open_one: Callable[[Path], tuple]) -> tuple:
    """(checkpoint, *open_one(checkpoint)) of the newest checkpoint under `path` that
    `open_one` takes; damaged ones are reported and skipped."""
    tried = []
    for ckpt in candidates(path):
        try:
            return (ckpt, *open_one(ckpt))
        except ConfigError:  # e.g. DeepSpeed missing: not this checkpoint's fault
            raise
        except LOAD_ERRORS as err:  # damaged, unsafe or incomplete: the one before it
            log.warning(
                "checkpoint %s cannot be %s (%s); trying the one before it", ckpt, purpose, err
            )
            tried.append(ckpt.name)
    raise CheckpointError(f"no checkpoint under {path} {verb} (tried {', '.join(tried)})")


def newest_model(path: Path, purpose: str) -> tuple[Path, dict[str, Any], nn.Module]:
    """(checkpoint, its trainer state, the model with its whole fp32 weights) of the newest
    checkpoint under `path` that verifies and loads; damaged ones are reported and skipped."""
    return _newest(path, purpose, "loads", whole_model)


def newest_weights(path: Path) -> tuple[Path, dict[str, Any], ModelConfig, WeightParts]:
    """(checkpoint, its trainer state, its model config, its weights part by part) of the newest
    checkpoint under `path` whose files verify. A DCP checkpoint is read one part at a time
    (model/hf/family.py: the embedding, norm and head, then each layer), so a process holds one
    part, never the whole model; a DeepSpeed one is consolidated whole (its fp32 partitions
    are flat, across every rank's file), as one part."""
    return _newest(path, "exported", "verifies", _weights_of)


def _weights_of(ckpt: Path) -> tuple[dict[str, Any], ModelConfig, WeightParts]:
    form = format_of(ckpt)
    if form is None:
        raise CheckpointError(f"{ckpt} is incomplete (neither .metadata nor an engine's)")
    extra, metadata = read_checked(ckpt, rank=0, form=form)
    cfg = config_from_dict(ModelConfig, extra["model_config"])
    if form != DCP:
        return extra, cfg, [(None, consolidated_weights(ckpt))]
    # read after every file's checksum verified: a failure midway is an error, not a fallback
    return extra, cfg, _dcp_parts(ckpt, metadata, cfg)


def _dcp_parts(ckpt: Path, metadata: Any, cfg: ModelConfig) -> WeightParts:
    """The model's weights in a DCP checkpoint, whole tensors read a part at a time."""
    like = build_model(cfg, device="meta").state_dict()
    names: dict[int, list[str]] = {}
    for name in like:
        names.setdefault(our_part(name, cfg.n_layers), []).append(name)
    for part in sorted(names):
        state = {n: torch.empty(like[n].shape, dtype=like[n].dtype) for n in names[part]}
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
                read_states({"model": state}, ckpt, metadata, no_dist=True)
        except LOAD_ERRORS as err:
            raise CheckpointError(f"{ckpt} cannot be read: {err}") from err
        yield part, state
        del state  # before the next part is read


def whole_model(ckpt: Path) -> tuple[dict[str, Any], nn.Module]:
    """(trainer state, the model built once on the CPU from the checkpoint's config, holding
    its weights) of one checkpoint, after its checksums are verified."""
    form = format_of(ckpt)
    if form is None:
        raise CheckpointError(
            f"{ckpt} is incomplete (neither DCP's .metadata nor an engine's folder)"
        )
    extra, metadata = read_checked(ckpt, rank=0, form=form)
    model = build_model(config_from_dict(ModelConfig, extra["model_config"]), device="cpu")
    if form != DCP:
        model.load_state_dict(consolidated_weights(ckpt))
        return extra, model
    state = {"model": model.state_dict()}  # DCP reads into the model's own tensors
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        read_states(state, ckpt, metadata, no_dist=True)  # one process, whatever the run
    return extra, model


def model_differences(extra: dict[str, Any], model_cfg: ModelConfig) -> list[str]:
    """How the checkpoint's model differs from `model_cfg` (empty: its weights fit), ignoring
    the optimizer (a run started from weights builds its own)."""
    mine = Fingerprint.of(model_cfg, OptimConfig())
    return [d for d in mine.differences(extra) if d.startswith("model.")]


def resumes_its_own(resume: str, run_dir: Path) -> bool:
    """Whether this run will load a checkpoint of its own (or the one `resume` names)."""
    return resume != "none" and (
        resume != "auto" or bool(complete_checkpoints(run_dir / "checkpoints"))
    )


def init_weights_reader(
    init_from: str, model_cfg: ModelConfig
) -> Callable[[], list[dict[str, Tensor]]] | None:
    """init_from=<checkpoint>: a reader of the whole weights (as parallel.init.load_weights'
    one part) of the newest checkpoint there that verifies and loads (None without init_from).
    Called on every rank when the engine is built; the ranks agree on the outcome, and a
    problem is one ConfigError on all of them."""
    if not init_from:
        return None
    source = Path(init_from).expanduser()

    def read() -> list[dict[str, Tensor]]:
        problem, state, chosen = "", {}, ""
        try:
            if not source.exists():
                raise ConfigError(f"init_from={init_from} does not exist")
            ckpt, extra, model = newest_model(source, "started from")
            state = model.state_dict()
            if differences := model_differences(extra, model_cfg):
                raise ConfigError(
                    f"init_from={ckpt} holds another model ({'; '.join(differences)}): set the "
                    f"model options it was trained with"
                )
            chosen = str(ckpt)
        except (ConfigError, CheckpointError) as err:
            problem = str(err)
        same = from_main(chosen) == chosen  # every rank must start from the same checkpoint
        if not all_true(not problem and same):
            raise ConfigError(
                problem
                or f"init_from={init_from}: the ranks could not all read the same checkpoint there"
            )
        log.info(
            "starting from the weights of %s (step %d, a fresh optimizer)", ckpt, extra["step"]
        )
        return [state]  # one part: the whole state dict

    return read
