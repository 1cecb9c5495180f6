"""The validation set measures the model (issue 22): a fixed, seeded sample of windows spread
over the whole validation split gives the mean loss of all its windows within its statistical
error, and covers every document, on a corpus whose validation documents differ strongly in
difficulty; the same windows are evaluated after a resume and on any number of ranks."""

from __future__ import annotations

import logging
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from data.config import LoaderConfig
from data.eval_sample import spread_sample
from data.loader import TokenLoader, stack_windows
from data.prepare import prepare
from model.presets import load_preset
from model.transformer import build_model
from tests.data.helpers import make_text, prepare_config
from trainer.evaluate import validation_loss

SEQ, BATCH = 16, 8


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, tokenizer_dir) -> Path:
    """Easy (one sentence repeated) documents first, then hard (random words) ones: the first
    windows of the validation split are much easier than the split as a whole."""
    root = tmp_path_factory.mktemp("mixed")
    corpus = root / "corpus"
    corpus.mkdir()
    rng = random.Random(0)
    for i in range(60):
        text = "the cat sat on the mat. " * rng.randint(60, 120) if i < 30 else make_text(rng, 400)
        (corpus / f"doc_{i:03d}.txt").write_text(text, encoding="utf-8")
    prepare(prepare_config(corpus, root / "dataset", tokenizer_dir, val_fraction=0.5))
    return root / "dataset"


def open_loader(path: Path, val_batches: int, rank: int = 0, size: int = 1, seed: int = 0):
    cfg = LoaderConfig(path=str(path), seq_len=SEQ, num_workers=0, val_batches=val_batches)
    return TokenLoader(cfg, global_batch=BATCH, dp_rank=rank, dp_size=size, seed=seed)


def trained_model(loader: TokenLoader) -> torch.nn.Module:
    """A small model after a few steps: repetitive text is then far easier than random text."""
    overrides = {"d_model": 64, "n_layers": 2, "attention.n_heads": 4, "attention.n_kv_heads": 2}
    cfg = load_preset("tiny", overrides | {"vocab_size": 512, "max_seq_len": 64})
    model = build_model(cfg, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for batch, _ in zip(loader, range(60)):
        model(batch.inputs, batch.targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


@torch.no_grad()
def window_losses(model, loader: TokenLoader) -> np.ndarray:
    """The loss of every window of the validation split, one at a time."""
    total = loader.val.num_windows(SEQ)
    out = []
    for start in range(0, total, 64):
        batch = stack_windows(loader.val, np.arange(start, min(start + 64, total)), SEQ)
        logits = model(batch.inputs)
        loss = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2).float(), batch.targets, reduction="none"
        )
        out.append(loss.mean(dim=1).numpy())
    return np.concatenate(out)


def test_the_sample_gives_the_mean_over_all_windows_and_covers_every_document(mixed):
    loader = open_loader(mixed, val_batches=60)
    model = trained_model(loader)
    every = window_losses(model, loader)
    n, total = len(loader.val_sample.windows), len(every)
    assert 0.1 < n / total < 0.5  # a real sample, not the whole split
    reported = validation_loss(
        lambda x, y, doc_ids: model(x, y, doc_ids=doc_ids),
        loader.validation(),
        torch.device("cpu"),
        False,
        lambda: False,
    )
    # the standard error of a sample of n of the N windows (finite-population corrected)
    error = every.std() / math.sqrt(n) * math.sqrt(1 - n / total)
    assert abs(reported - every.mean()) < 3 * error, (reported, every.mean(), error)
    first = every[:n].mean()  # what the first n consecutive windows (the old set) would say
    assert abs(first - every.mean()) > 6 * error  # the corpus does tell the two apart
    described = loader.val_sample.describe()
    assert described["documents"] == described["split_documents"] == loader.val.documents


def test_a_split_smaller_than_the_request_is_evaluated_whole(mixed, caplog):
    caplog.set_level(logging.WARNING)
    loader = open_loader(mixed, val_batches=10_000)
    windows = loader.val_sample.windows
    total = loader.val.num_windows(SEQ)
    assert len(windows) == total // BATCH * BATCH  # whole batches: at most BATCH - 1 left out
    assert len(set(windows.tolist())) == len(windows) and windows.max() < total
    assert "evaluating all of them" in caplog.text


def test_resume_and_another_number_of_ranks_evaluate_the_same_windows(mixed):
    one = open_loader(mixed, val_batches=4)
    reference = [b.inputs for b in one.validation()]
    resumed = open_loader(mixed, val_batches=4)
    resumed.load_state_dict(one.state_dict() | {"position": 4 * BATCH * 7})
    assert all(torch.equal(a.inputs, b) for a, b in zip(resumed.validation(), reference))
    for size in (2, 4):
        parts = [list(open_loader(mixed, 4, rank=r, size=size).validation()) for r in range(size)]
        for b, whole in enumerate(reference):
            assert torch.equal(torch.cat([p[b].inputs for p in parts]), whole)
    assert not np.array_equal(
        open_loader(mixed, 4, seed=1).val_sample.windows, one.val_sample.windows
    )


def test_the_spread_sample_is_uniform_and_stratified():
    draws = np.concatenate([spread_sample(1000, 50, seed, salt=1) for seed in range(400)])
    counts = np.bincount(draws, minlength=1000)
    assert counts.min() > 0 and counts.std() < 6  # every window drawn, each about as often
    one = spread_sample(1000, 50, 0, 1)
    assert np.all(np.diff(one) > 0) and np.all(one // 20 == np.arange(50))  # one per stratum
    assert list(spread_sample(7, 10, 0, 1)) == list(range(7))
