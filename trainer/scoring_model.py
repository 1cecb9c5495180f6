"""A trained model ready to score text, from whatever a user points at: a run directory (its
newest checkpoint that loads), a checkpoint directory (DCP or DeepSpeed) or a Hugging Face
directory (`python -m trainer.export`'s, or any of a family that model/hf knows). What the
lm-eval-harness model (trainer/lm_eval_model.py) and `python -m trainer.eval` score with.

The tokenizer is the one the model was trained with: a checkpoint's is the training data's
`tokenizer/` folder that its trainer state names, verified against the identity it records
(trainer/checkpoint/tokenizer.py); an export's is the `tokenizer/` folder written beside it,
else its Hugging Face `tokenizer.json`. The length scored at is the one the model was trained
at: the run's data.seq_len (recorded in the checkpoint), else the model's max_seq_len.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from data.errors import DataError
from data.tokenizer import Tokenizer, TokenizerIdentity, load_tokenizer
from model.errors import ConfigError
from model.hf import load_hf
from model.transformer import Transformer
from trainer.checkpoint.tokenizer import TokenizerGone, checkpoint_tokenizer
from trainer.checkpoint.weights import candidates, newest_model
from trainer.export_target import MARKER

log = logging.getLogger("trainer.scoring_model")
DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
WHAT = "a run directory, a checkpoint directory (step_<N>) or a Hugging Face directory"


@dataclass
class ScoringModel:
    """A model in eval mode and what scoring it needs."""

    model: Transformer
    tokenizer: Tokenizer
    max_seq_len: int  # the sequence length the model was trained at (what windows are cut to)
    source: str  # what was loaded: the checkpoint or Hugging Face directory
    step: int | None  # the training step of its weights (None when unknown)


def load_scoring_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    tokenizer: str | None = None,
) -> ScoringModel:
    """The model at `path` on `device` in `dtype` (None: as stored; fp32 for checkpoints).
    `tokenizer` replaces the one found (a moved dataset's `tokenizer/` folder or `hf:<dir>`);
    where the checkpoint records its tokenizer's identity, the replacement must match it."""
    where = Path(path).expanduser()
    if not where.exists():
        raise ConfigError(f"path={path} does not exist: pass {WHAT}")
    torch_dtype = parse_dtype(dtype)
    if (where / "config.json").is_file():
        scoring = _from_hf(where, device, torch_dtype, tokenizer)
    else:
        scoring = _from_checkpoint(where, tokenizer)
        scoring.model.to(device=device, dtype=torch_dtype)
    vocab = scoring.model.cfg.vocab_size
    if scoring.tokenizer.vocab_size > vocab:
        raise DataError(
            f"the tokenizer {scoring.tokenizer.identity.short()} has {scoring.tokenizer.vocab_size} "
            f"ids but the model of {scoring.source} has {vocab}: pass the model's own tokenizer"
        )
    scoring.model.eval().requires_grad_(False)
    return scoring


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """None, "auto" (as stored), a torch dtype or one of DTYPES' names."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).strip().lower().removeprefix("torch.")
    if name in ("", "auto"):
        return None
    if name not in DTYPES:
        raise ConfigError(f"dtype={dtype} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def _from_checkpoint(where: Path, tokenizer: str | None) -> ScoringModel:
    try:
        candidates(where)  # (the checkpoint code's own message names neither a fix nor HF)
    except ConfigError:
        raise ConfigError(
            f"path={where} is not {WHAT} (no checkpoints/, no step_<N> files, no config.json)"
        ) from None
    ckpt, extra, model = newest_model(where, "scored")
    return ScoringModel(
        model=model,
        tokenizer=_checkpoint_tokenizer(extra, tokenizer, ckpt),
        max_seq_len=trained_length(extra, model.cfg.max_seq_len),
        source=str(ckpt),
        step=int(extra["step"]) if "step" in extra else None,
    )


def _checkpoint_tokenizer(extra: dict[str, Any], spec: str | None, ckpt: Path) -> Tokenizer:
    if spec is None:
        try:
            return checkpoint_tokenizer(extra)
        except TokenizerGone as gone:
            raise DataError(
                f"{gone} ({ckpt}): restore the training data's tokenizer/ folder, or pass "
                f"tokenizer=<a copy of it>"
            ) from None
    chosen = load_tokenizer(spec)
    if "tokenizer" in extra:
        expected = TokenizerIdentity.from_dict(extra["tokenizer"])
        if chosen.identity.hash != expected.hash:
            raise DataError(
                f"tokenizer={spec} is {chosen.identity.short()}, but {ckpt} was trained with "
                f"{expected.short()}: pass that tokenizer"
            )
    return chosen


def trained_length(extra: dict[str, Any], model_max: int) -> int:
    """data.seq_len of the run config the checkpoint records, else the model's max_seq_len."""
    try:
        recorded = yaml.safe_load(extra.get("config") or "") or {}
        seq_len = recorded.get("data", {}).get("seq_len")
    except (yaml.YAMLError, AttributeError):  # an unreadable record: the model's own limit
        seq_len = None
    # (the trainer checked that the model covers it; rope scaling may take it past max_seq_len)
    return seq_len if isinstance(seq_len, int) and seq_len > 0 else model_max


def _from_hf(
    where: Path, device: str | torch.device, dtype: torch.dtype | None, spec: str | None
) -> ScoringModel:
    model = load_hf(where, device=device, dtype=dtype)
    return ScoringModel(
        model=model,
        tokenizer=load_tokenizer(spec) if spec is not None else _hf_tokenizer(where),
        max_seq_len=model.cfg.max_seq_len,
        source=str(where),
        step=_export_step(where),
    )


def _hf_tokenizer(where: Path) -> Tokenizer:
    """The `tokenizer/` folder trainer.export writes (the training tokenizer itself), else the
    directory's own Hugging Face tokenizer.json."""
    if (where / "tokenizer").is_dir():
        return load_tokenizer(where / "tokenizer")
    if (where / "tokenizer.json").is_file():
        return load_tokenizer(f"hf:{where}")
    raise DataError(
        f"{where} holds no tokenizer (neither tokenizer.json nor tokenizer/): pass "
        f"tokenizer=<the model's tokenizer folder or hf:<dir>>"
    )


def _export_step(where: Path) -> int | None:
    """The training step trainer.export recorded (None for other Hugging Face directories)."""
    try:
        step = json.loads((where / MARKER).read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None
