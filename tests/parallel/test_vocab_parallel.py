"""The vocab-parallel cross-entropy (parallel/vocab_parallel.py) on 2 and 4 gloo ranks equals
model/loss.py's chunked cross-entropy with the whole head on one process: the loss (fp32, 1e-6
relative) on every rank, the full grad_h on every rank, each rank's grad_w rows, and the target
log-probs; with ignored targets, chunks smaller than N (with a remainder), chunk 0 (all at once),
vocabularies that tp does not divide (a shorter last shard, and an empty one), under bf16
autocast; forward makes one all_gather and one all_reduce per chunk and backward none."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from model.loss import IGNORE_INDEX, chunked_cross_entropy, target_log_probs
from parallel.vocab_parallel import (
    vocab_parallel_cross_entropy,
    vocab_parallel_target_log_probs,
    vocab_shard,
)
from tests.parallel.ranks import run_ranks

B, T, C = 2, 13, 16  # N = 26 tokens
CHUNKS = (5, 26, 0)  # smaller than N with a remainder, N, all at once
FP32 = {"rtol": 1e-5, "atol": 1e-7}  # gradients (entries of about 1e-3 .. 1e-2)


def case_data(vocab: int, seed: int, ignore_all: bool = False) -> tuple[torch.Tensor, ...]:
    """h (B, T, C), the whole head W (V, C), targets (B, T) with a quarter ignored and the
    shards' edge ids present."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, C, generator=gen)
    w = torch.randn(vocab, C, generator=gen) / C**0.5
    targets = torch.randint(0, vocab, (B, T), generator=gen)
    targets.view(-1)[:4] = torch.tensor([0, vocab - 1, vocab // 2, vocab // 2 - 1])
    targets[torch.rand(B, T, generator=gen) < 0.25] = IGNORE_INDEX
    if ignore_all:
        targets[:] = IGNORE_INDEX
    return h, w, targets


def reference(h, w, targets, chunk: int, bf16: bool = False) -> dict[str, torch.Tensor]:
    """One process, the whole head: model/loss.py."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        loss = chunked_cross_entropy(h, w, targets, chunk)
        log_probs = target_log_probs(h, w, targets, chunk)
    loss.backward()
    return {"loss": loss.detach(), "grad_h": h.grad, "grad_w": w.grad, "log_probs": log_probs}


class Counted:
    """Counts the calls of the collectives the loss uses (patched on torch.distributed)."""

    NAMES = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "all_gather", "broadcast")

    def __init__(self) -> None:
        self.calls: dict[str, int] = dict.fromkeys(self.NAMES, 0)
        self.saved = {name: getattr(dist, name) for name in self.NAMES if hasattr(dist, name)}

    def __enter__(self) -> Counted:
        for name, fn in self.saved.items():
            setattr(dist, name, self._counting(name, fn))
        return self

    def _counting(self, name: str, fn):
        def call(*args, **kwargs):
            self.calls[name.replace("_single", "_into_tensor")] += 1  # torch 2.13's name
            return fn(*args, **kwargs)

        return call

    def __exit__(self, *exc) -> None:
        for name, fn in self.saved.items():
            setattr(dist, name, fn)

    def take(self) -> dict[str, int]:
        calls = {k: v for k, v in self.calls.items() if v}
        self.calls = dict.fromkeys(self.NAMES, 0)
        return calls


def one_case(
    rank: int, mesh, vocab: int, seed: int, chunk: int, bf16: bool, ignore_all: bool
) -> dict[str, Any]:
    """This rank's results for one case, its head rows taken as DTensor's Shard(0) gives them."""
    h, w, targets = case_data(vocab, seed, ignore_all)
    tp, group = mesh.size(), mesh.get_group()
    w_local = distribute_tensor(w, mesh, [Shard(0)]).to_local().clone()
    start, end = vocab_shard(vocab, rank, tp)
    assert torch.equal(w_local, w[start:end]), (rank, start, end, w_local.shape)
    h, w_local = h.clone().requires_grad_(), w_local.requires_grad_()
    with Counted() as counted, torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        loss = vocab_parallel_cross_entropy(h, w_local, targets, chunk, start, group)
        forward = counted.take()
        loss.backward()
        backward = counted.take()
        log_probs = vocab_parallel_target_log_probs(h, w_local, targets, chunk, start, group)
        with torch.no_grad():
            eval_loss = vocab_parallel_cross_entropy(h, w_local, targets, chunk, start, group)
        evaluation = counted.take()
    return {
        "loss": loss.detach(),
        "eval_loss": eval_loss,
        "grad_h": h.grad,
        "grad_w_local": w_local.grad,
        "rows": (start, end),
        "log_probs": log_probs,
        "collectives": {"forward": forward, "backward": backward, "evaluation": evaluation},
    }


def run_cases(rank: int, cases: list[tuple]) -> list[dict[str, Any]]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    return [one_case(rank, mesh, *case) for case in cases]


def check(results: list[dict[str, Any]], vocab: int, seed: int, chunk: int, bf16: bool, **kw):
    h, w, targets = case_data(vocab, seed, kw.get("ignore_all", False))
    want = reference(h, w, targets, chunk, bf16)
    loss_tol = {"rtol": 1e-6, "atol": 0} if not bf16 else {"rtol": 1e-3, "atol": 0}
    grad_tol = FP32 if not bf16 else {"rtol": 2e-2, "atol": 2e-4}
    covered = 0
    for got in results:
        torch.testing.assert_close(got["loss"], want["loss"], **loss_tol)
        torch.testing.assert_close(got["eval_loss"], got["loss"], rtol=0, atol=0)
        torch.testing.assert_close(got["grad_h"], want["grad_h"], **grad_tol)
        start, end = got["rows"]
        assert start == covered
        covered = end
        torch.testing.assert_close(got["grad_w_local"], want["grad_w"][start:end], **grad_tol)
        torch.testing.assert_close(got["log_probs"], want["log_probs"], **loss_tol)
        assert got["grad_w_local"].dtype == torch.float32 and got["log_probs"].shape == (B, T)
    assert covered == vocab
    # every rank returns the same loss and grad_h bit for bit (they are all-reduced, not recomputed)
    for got in results[1:]:
        assert torch.equal(got["loss"], results[0]["loss"])
        assert torch.equal(got["grad_h"], results[0]["grad_h"])


def chunks(rows: int, chunk: int) -> int:
    """How many chunks `rows` rows make (chunk 0: all at once)."""
    return -(-rows // chunk) if 0 < chunk < rows else min(rows, 1)


TWO_RANKS = [(vocab, 7, chunk, False, False) for vocab in (128, 127) for chunk in CHUNKS]
TWO_RANKS += [(128, 8, 5, True, False), (127, 9, 5, False, True)]  # bf16 autocast; all ignored
FOUR_RANKS = [(130, 3, 5, False, False), (130, 3, 0, False, False), (9, 4, 5, False, False)]


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "cases"), [(2, TWO_RANKS), (4, FOUR_RANKS)], ids=["tp2", "tp4"])
def test_vocab_parallel_loss_equals_one_process_with_the_whole_head(world, cases):
    per_rank = run_ranks(world, run_cases, cases)
    for i, (vocab, seed, chunk, bf16, ignore_all) in enumerate(cases):
        results = [per_rank[r][i] for r in range(world)]
        check(results, vocab, seed, chunk, bf16, ignore_all=ignore_all)
        n = chunks(B * T, chunk)
        targets = case_data(vocab, seed, ignore_all)[2]
        scored = chunks(int((targets != IGNORE_INDEX).sum()), chunk)  # log-probs: rows with one
        for got in results:
            assert got["collectives"]["forward"] == {"all_gather_into_tensor": n, "all_reduce": n}
            assert got["collectives"]["backward"] == {}
            # target log-probs over the rows with a target, then the loss alone
            gathers = scored + n
            assert got["collectives"]["evaluation"] == {"all_gather_into_tensor": gathers}


def test_one_process_without_a_group_is_model_loss():
    h, w, targets = case_data(50, 11)
    want = reference(h, w, targets, 7)
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(h, w, targets, 7, 0)
    loss.backward()
    torch.testing.assert_close(loss.detach(), want["loss"], rtol=1e-6, atol=0)
    torch.testing.assert_close(h.grad, want["grad_h"], **FP32)
    torch.testing.assert_close(w.grad, want["grad_w"], **FP32)
    log_probs = vocab_parallel_target_log_probs(h, w, targets, 7, 0)
    torch.testing.assert_close(log_probs, want["log_probs"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("vocab", "tp"), [(128, 2), (127, 2), (130, 4), (9, 4), (3, 4)])
def test_vocab_shard_splits_as_torch_chunk(vocab, tp):
    chunks = [len(c) for c in torch.arange(vocab).chunk(tp)]
    chunks += [0] * (tp - len(chunks))  # torch.chunk leaves out empty trailing shards
    shards = [vocab_shard(vocab, r, tp) for r in range(tp)]
    assert [end - start for start, end in shards] == chunks
    assert [s for s, _ in shards[1:]] == [e for _, e in shards[:-1]] and shards[-1][1] == vocab
