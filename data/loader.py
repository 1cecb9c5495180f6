"""The training loader: one seeded global order of windows, sliced per data-parallel rank, resumable.

Global sample g (0, 1, 2, ...) is window `perm_e(g mod n)` of the training split, where n is the
number of windows, e = g // n the epoch and perm_e a seeded permutation for that epoch. A step
consumes one global batch of G samples [p, p + G); data-parallel rank r of W takes
[p + r*G/W, p + (r+1)*G/W). The loader's whole state is p, the position in that global order,
so `load_state_dict` resumes exactly, also with another number of ranks (or another G): the
global stream continues with no sample repeated or skipped.

Batches are assembled ahead of time by DataLoader worker processes (`num_workers`, `prefetch`);
a batch counts as consumed only when it is handed to the trainer, so prefetching never shifts
the state.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from data.config import LoaderConfig
from data.errors import DataError
from data.eval_sample import EvalSample
from data.manifest import Manifest
from data.permutation import IndexPermutation
from data.reader import SplitReader
from data.tokenizer import Tokenizer, TokenizerIdentity, load_verified_tokenizer

STATE_VERSION = 1
log = logging.getLogger("data.loader")


class Batch(NamedTuple):
    inputs: torch.Tensor  # (B, T) int64
    targets: torch.Tensor  # (B, T) int64, inputs shifted by one
    doc_ids: torch.Tensor  # (B, T) int32, runs of equal ids are one document (from 0 per row)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(*(t.to(device, non_blocking=non_blocking) for t in self))

    def pin_memory(self) -> Batch:  # called by DataLoader(pin_memory=True)
        return Batch(*(t.pin_memory() for t in self))


def stack_windows(reader: SplitReader, windows: np.ndarray, seq_len: int) -> Batch:
    tokens = np.empty((len(windows), seq_len + 1), dtype=np.int64)
    doc_ids = np.empty((len(windows), seq_len), dtype=np.int32)
    for row, w in enumerate(windows):
        tokens[row], doc_ids[row] = reader.window(int(w), seq_len)
    t = torch.from_numpy(tokens)
    return Batch(t[:, :-1].contiguous(), t[:, 1:].contiguous(), torch.from_numpy(doc_ids))


class _RankSlices(Dataset):
    """Key: the global position p of a batch's first sample -> this rank's Batch."""

    def __init__(self, reader: SplitReader, seq_len: int, local: int, rank: int, order: _Order):
        self.reader, self.seq_len, self.local, self.rank, self.order = (
            reader,
            seq_len,
            local,
            rank,
            order,
        )

    def __getitem__(self, position: int) -> Batch:
        samples = position + self.rank * self.local + np.arange(self.local, dtype=np.int64)
        return stack_windows(self.reader, self.order(samples), self.seq_len)


class _Order:
    """Global sample index -> window index (a fresh seeded permutation per epoch)."""

    def __init__(self, windows: int, seed: int, shuffle: bool):
        self.windows, self.seed, self.shuffle = windows, seed, shuffle
        self._perms: dict[int, IndexPermutation] = {}

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        epochs, within = np.divmod(samples, self.windows)
        if not self.shuffle:
            return within
        out = np.empty_like(within)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = self._perm(int(epoch))(within[sel])
        return out

    def _perm(self, epoch: int) -> IndexPermutation:
        if epoch not in self._perms:
            self._perms = {epoch: IndexPermutation(self.windows, self.seed, epoch)}
        return self._perms[epoch]


class _Positions(Sampler):
    """start, start + G, start + 2G, ... forever."""

    def __init__(self, start: int, step: int):
        self.start, self.step = start, step

    def __iter__(self) -> Iterator[int]:
        return itertools.count(self.start, self.step)


def _as_is(batch: Batch) -> Batch:
    return batch


class TokenLoader:
    """Iterate to get this rank's batch of each step; `state_dict()` between steps."""

    def __init__(
        self,
        cfg: LoaderConfig,
        *,
        global_batch: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        expected_tokenizer: TokenizerIdentity | None = None,
        pin_memory: bool = False,
    ):
        if global_batch < 1 or global_batch % dp_size:
            raise DataError(
                f"global batch {global_batch} must be a positive multiple of the {dp_size} "
                f"data-parallel ranks"
            )
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank={dp_rank} is outside [0, {dp_size})")
        self.cfg, self.seed, self.pin_memory = cfg, seed, pin_memory
        self.global_batch, self.dp_rank, self.dp_size = global_batch, dp_rank, dp_size
        self.local_batch = global_batch // dp_size
        self.manifest = Manifest.load(cfg.path)
        self.manifest.check_tokenizer(expected_tokenizer)
        self.train = SplitReader(self.manifest, "train", cfg.verify)
        self.windows = self.train.num_windows(cfg.seq_len)
        if self.windows == 0:
            raise DataError(
                f"the training split of {cfg.path} has {self.train.tokens} tokens, fewer than "
                f"one window of data.seq_len + 1 = {cfg.seq_len + 1}; lower data.seq_len"
            )
        self.order = _Order(self.windows, seed, cfg.shuffle)
        self.position = 0  # global sample index of the next batch
        self._tokenizer: Tokenizer | None = None
        self.val = SplitReader(self.manifest, "val", cfg.verify)
        self.val_sample = EvalSample.build(
            self.val, cfg.seq_len, cfg.val_batches, global_batch, seed
        )
        self.train_sample = EvalSample.build(
            self.train, cfg.seq_len, cfg.train_eval_batches, global_batch, seed
        )
        self.val_batches = self.val_sample.batches
        available = self.val.num_windows(cfg.seq_len) // global_batch
        if 0 < available < cfg.val_batches:
            log.warning(
                "data.val_batches=%d, but the validation split of %s holds only %d batches of %d "
                "windows: evaluating all of them (%d); prepare with a larger val_fraction for a "
                "larger validation set",
                cfg.val_batches,
                cfg.path,
                available,
                global_batch,
                available,
            )
        if self.val_batches == 0 and cfg.val_batches:
            raise DataError(
                f"the validation split of {cfg.path} has {self.val.num_windows(cfg.seq_len)} "
                f"windows of seq_len={cfg.seq_len}, fewer than one global batch ({global_batch}); "
                f"prepare with a larger val_fraction, lower trainer.batch_size or data.seq_len, "
                f"or set data.val_batches=0 to train without validation"
            )

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = load_verified_tokenizer(
                self.manifest.root / "tokenizer", self.manifest.tokenizer, f"{self.manifest.root}"
            )
        return self._tokenizer

    @property
    def epoch(self) -> float:
        """Passes over the training windows so far (fractional)."""
        return self.position / self.windows

    def __iter__(self) -> Iterator[Batch]:
        dataset = _RankSlices(
            self.train, self.cfg.seq_len, self.local_batch, self.dp_rank, self.order
        )
        workers = self.cfg.num_workers
        loader = DataLoader(
            dataset,
            batch_size=None,
            sampler=_Positions(self.position, self.global_batch),
            num_workers=workers,
            prefetch_factor=self.cfg.prefetch if workers else None,
            collate_fn=_as_is,
            pin_memory=self.pin_memory,
        )
        try:
            for batch in loader:
                self.position += self.global_batch
                yield batch
        except DataError as err:  # from a worker: keep the message, drop the worker traceback
            raise DataError(_last_line(str(err))) from None

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "position": self.position,
            "seq_len": self.cfg.seq_len,
            "windows": self.windows,
            "seed": self.seed,
            "shuffle": self.cfg.shuffle,
            "dataset": self.manifest.digest,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved global order; refuse a state from another dataset or order."""
        mine = self.state_dict()
        for key in ("seq_len", "windows", "seed", "shuffle", "dataset"):
            if state.get(key) != mine[key]:
                raise DataError(
                    f"the saved loader state has {key}={state.get(key)!r} but this loader has "
                    f"{key}={mine[key]!r}: resuming would not continue the same sample order. "
                    f"Use the run's original data.path, data.seq_len, data.shuffle and seed"
                )
        self.position = int(state["position"])

    def validation(self) -> Iterator[Batch]:
        """This rank's slices of the validation sample: the same windows every time, spread over
        the whole held-out split (data.eval_sample)."""
        return self._sample_batches(self.val_sample)

    def train_eval(self) -> Iterator[Batch]:
        """This rank's slices of the fixed sample of training windows (`train_eval_loss`)."""
        return self._sample_batches(self.train_sample)

    def _sample_batches(self, sample: EvalSample) -> Iterator[Batch]:
        for windows in sample.rank_windows(self.dp_rank, self.dp_size):
            yield stack_windows(sample.reader, windows, self.cfg.seq_len)


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    last = lines[-1] if lines else text
    return last.split("DataError: ", 1)[-1]
