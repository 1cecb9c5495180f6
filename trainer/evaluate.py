"""Evaluation on the fixed validation batches, and a short sample from the model."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from data.loader import Batch, TokenLoader
from data.tokenizer import Tokenizer
from model.generate import NonFiniteOutput, generate
from parallel.collective import several_ranks
from parallel.engine import TrainingEngine

log = logging.getLogger("trainer")


BatchLoss = Callable[[Tensor, Tensor, Tensor | None], Tensor]  # (inputs, targets, doc_ids)


@torch.no_grad()
def validation_loss(
    loss_of: BatchLoss,
    batches: Iterable[Batch],
    device: torch.device,
    doc_mask: bool,
    stop: Callable[[], bool],
) -> float | None:
    """Mean loss over evaluation batches (all ranks; equal-sized batches, so the mean over
    their windows); None when stopped part-way. `loss_of`: one batch's mean loss without
    gradients (TrainingEngine.evaluation_loss)."""
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of losses, batches)
    for batch in batches:
        if stop():
            return None
        batch = batch.to(device, non_blocking=True)
        loss = loss_of(batch.inputs, batch.targets, batch.doc_ids if doc_mask else None)
        total += torch.stack([loss.double(), torch.ones((), dtype=torch.float64, device=device)])
    if several_ranks():
        dist.all_reduce(total)
    return float(total[0] / total[1]) if total[1] > 0 else float("nan")


MIN_VAL_DOCUMENTS = 10  # fewer: the validation loss measures a handful of texts


def describe_evaluation(loader: TokenLoader) -> dict[str, int]:
    """Log what every evaluation measures, warn about a validation split too small to trust;
    returns the keys that evaluation rows of metrics.jsonl carry."""
    if not loader.val_batches:
        return {}
    val = loader.val_sample.describe()
    log.info(
        "validation: %d windows (%s tokens) spread over the whole split, touching %d of its %d "
        "documents (%.1f%% of its %d windows); training sample: %d windows",
        val["windows"],
        f"{val['tokens']:,}",
        val["documents"],
        val["split_documents"],
        100 * val["windows"] / max(val["split_windows"], 1),
        val["split_windows"],
        len(loader.train_sample.windows),
    )
    if val["split_documents"] < MIN_VAL_DOCUMENTS:
        log.warning(
            "the validation split holds only %d documents: its loss measures those few texts. "
            "Prepare the data with a larger val_fraction (or more data) for a number to trust",
            val["split_documents"],
        )
    return {f"val_{k}": val[k] for k in ("windows", "tokens", "documents")}


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def data_prompt(loader: TokenLoader, tokens: int = 12) -> str:
    """A sample's prompt from the data itself: the first `tokens` tokens of the first document
    that starts in one of the validation sample's windows (the training sample's without a
    validation split; a window's own start if none does), so prose gets a prose prompt and code
    a code one; "" without either sample."""
    sample = loader.val_sample if loader.val_batches else loader.train_sample
    if not len(sample.windows):
        return ""
    for index in sample.windows[:64]:
        window, doc_ids = sample.reader.window(int(index), sample.seq_len)
        starts = np.flatnonzero(np.diff(doc_ids)) + 1  # where documents begin in the window
        if starts.size:
            break
    else:
        window, doc_ids = sample.reader.window(int(sample.windows[0]), sample.seq_len)
        starts = np.zeros(1, dtype=np.int64)
    end = int(starts[1]) if starts.size > 1 else len(doc_ids)
    ids = [int(t) for t in window[int(starts[0]) : min(end, int(starts[0]) + tokens)]]
    text = loader.tokenizer.decode([t for t in ids if t < loader.tokenizer.vocab_size])
    return text.strip("\ufffd")  # a character cut by the window's edges


@torch.no_grad()
def sample_text(
    engine: TrainingEngine,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    device: torch.device,
    seed: int,
) -> str | None:
    """Temperature-0.8, top-50 continuation of `prompt`, from a private generator (the training
    RNG streams are left untouched, so sampling never changes the run); None when the model's
    outputs are not finite. With several ranks every rank must call it (the forwards are
    collective); all ranks draw the same tokens, and agree on a failure."""
    ids = tokenizer.encode_ordinary(prompt) or [tokenizer.eot_id]
    prompt_ids = torch.tensor([ids], device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with engine.full_weights() as model:  # sampling calls methods, not forward: whole weights
        try:
            out = generate(
                model,
                prompt_ids,
                max_new_tokens,
                temperature=0.8,
                top_k=50,
                # several ranks: no early stop, which each rank would decide from its own logits
                eos_id=None if several_ranks() else tokenizer.eot_id,
                generator=gen,
            )
        except NonFiniteOutput:  # every rank sees the same logits: they all stop here
            return None
    new = out[0, len(ids) :].tolist()
    if tokenizer.eot_id in new:  # the sample ends at the end of its document
        new = new[: new.index(tokenizer.eot_id)]
    return prompt + tokenizer.decode([t for t in new if t < tokenizer.vocab_size])
