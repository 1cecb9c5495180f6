"""Context parallelism's edge cases (parallel/context_parallel.py, model level) on gloo ranks
against one process, fp32: documents starting exactly at chunk edges, chunks shorter than a
convolution's span, a length that does not split into 2 cp chunks (each rank then runs it
whole), every target of one rank ignored, activation checkpointing (selective keeps the gathers
instead of sending them again in backward) and compile. Validation forwards (the whole loss on
every rank) are checked end to end: tests/trainer/test_context_parallel_train.py."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.ranks import run_ranks

pytestmark = pytest.mark.distributed

TOL = {"rtol": 1e-5, "atol": 1e-6}
MODEL = {"vocab_size": 128, "max_seq_len": 64, "d_model": 64, "n_layers": 2}
MODEL |= {"attention.n_heads": 4, "attention.n_kv_heads": 2}
HYBRID = {"n_layers": 4, "gdn.head_dim": 16, "gdn.v_head_dim": 16}
ENGRAM = {"n_layers": 4, "engram.table_sizes": [500, 500]}


def docs_at_chunk_edges(B: int, T: int) -> torch.Tensor:
    """Row 0: documents start exactly at every cp=2 chunk edge (T/4, T/2, 3T/4); row 1 (if
    any): one document starting one position after the middle."""
    q = T // 4
    row0 = torch.arange(T) // q
    row1 = (torch.arange(T) > T // 2).long()
    return torch.stack([row0, row1][:B])


def step(rank, preset, overrides, B, T, docs, ignore, grad) -> dict:
    import torch.distributed as dist

    from model.presets import load_preset
    from model.transformer import build_model
    from parallel.context_parallel import apply_context_parallel

    model = build_model(load_preset(preset, MODEL | overrides), seed=0)
    if dist.is_initialized():
        apply_context_parallel(model, dist.group.WORLD)
    tokens = torch.randint(0, 128, (B, T + 1), generator=torch.Generator().manual_seed(3))
    targets = tokens[:, 1:].clone()
    for row, lo, hi in ignore:
        targets[row, lo:hi] = -100
    if not grad:
        with torch.no_grad():
            return {"loss": model(tokens[:, :-1], targets, doc_ids=docs)}
    loss = model(tokens[:, :-1], targets, doc_ids=docs)
    mtp = model.pop_mtp_objective()
    (loss if mtp is None else loss + mtp).backward()
    grads = {
        n: p.grad.to_dense() if p.grad.is_sparse else p.grad
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    return {"loss": loss.detach(), "grads": grads}


def compare(cp, preset, overrides, B, T, docs, ignore=()):
    whole = step(0, preset, overrides, B, T, docs, ignore, True)
    ranks = run_ranks(cp, step, preset, overrides, B, T, docs, ignore, True)
    torch.testing.assert_close(sum(r["loss"] for r in ranks) / len(ranks), whole["loss"], **TOL)
    for name, grad in whole["grads"].items():
        got = sum(r["grads"][name] for r in ranks) / len(ranks)
        torch.testing.assert_close(got, grad, **TOL, msg=name)


@pytest.mark.parametrize(
    ("cp", "preset", "overrides", "B", "T"),
    [
        (2, "tiny_hybrid", HYBRID, 1, 32),  # B = 1: funcol's view path of the gather
        (2, "tiny_hybrid", HYBRID, 2, 32),  # documents starting exactly at chunk edges
        (2, "tiny", {"mtp.depth": 2}, 2, 32),
        (4, "tiny_hybrid", HYBRID, 2, 8),  # chunks of 1 < the conv's span of 3
        (2, "tiny_engram", ENGRAM, 2, 8),  # chunks of 2 < Engram's dilated span
        (2, "tiny", {"mtp.depth": 1}, 2, 30),  # 30 positions: not split, whole on each rank
    ],
    ids=["hybrid_b1", "hybrid_edges", "mtp_edges", "hybrid_t8_cp4", "engram_t8", "unsplit_t30"],
)
def test_edges(cp, preset, overrides, B, T):
    compare(cp, preset, overrides, B, T, docs_at_chunk_edges(B, T))


def test_ignored_targets_all_on_one_rank():
    """cp=2, T=32: rank 1 holds positions 8..23; ignore all of them in both rows."""
    ignore = [(0, 8, 24), (1, 8, 24)]
    compare(2, "tiny", {}, 2, 32, docs_at_chunk_edges(2, 32), ignore)


def step_ac(rank, preset, overrides, mode, compiled) -> dict:
    """A training step with activation checkpointing `mode` (and compiled blocks), counting
    the all-gathers each rank issues during backward."""
    import torch.distributed as dist

    from model.presets import load_preset
    from model.transformer import build_model
    from parallel.activation import apply_activation_checkpointing, compile_model
    from parallel.context_parallel import apply_context_parallel

    model = build_model(load_preset(preset, MODEL | overrides), seed=0)
    if dist.is_initialized():
        apply_context_parallel(model, dist.group.WORLD)
    apply_activation_checkpointing(model, mode)
    if compiled:
        compile_model(model, "cpu", backend="eager")
    B, T = 2, 32
    docs = docs_at_chunk_edges(B, T)
    tokens = torch.randint(0, 128, (B, T + 1), generator=torch.Generator().manual_seed(3))
    loss = model(tokens[:, :-1], tokens[:, 1:], doc_ids=docs)
    gathers = {"n": 0}
    op = torch.ops._c10d_functional.all_gather_into_tensor.default

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is op:
                gathers["n"] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.detach(), "grads": grads, "backward_gathers": gathers["n"]}


@pytest.mark.parametrize(
    ("preset", "overrides", "mode", "compiled"),
    [
        ("tiny_hybrid", HYBRID, "full", False),
        # (the gathers ran inside funcol's autograd function, without grad, where the policy
        # kept nothing: they were sent again in backward)
        ("tiny_hybrid", HYBRID, "selective", False),
        ("tiny_hybrid", HYBRID, "selective", True),
    ],
    ids=["full", "selective", "selective_compiled"],
)
def test_checkpointing_and_compile(preset, overrides, mode, compiled):
    whole = step_ac(0, preset, overrides, "none", False)
    ranks = run_ranks(2, step_ac, preset, overrides, mode, compiled)
    torch.testing.assert_close(sum(r["loss"] for r in ranks) / len(ranks), whole["loss"], **TOL)
    for name, grad in whole["grads"].items():
        got = sum(r["grads"][name] for r in ranks) / len(ranks)
        torch.testing.assert_close(got, grad, **TOL, msg=name)
    if mode == "selective":  # the gathered K/V and halos kept, not re-communicated
        assert all(r["backward_gathers"] == 0 for r in ranks), [
            r["backward_gathers"] for r in ranks
        ]


def test_compiled_blocks_under_context_parallelism_leave_cpp_wrapper_out(monkeypatch):
    """Inductor's cpp_wrapper rejects funcol's autograd all-gather ("arg type Any is not yet
    supported by custom_op_wrapper", torch 2.13), so blocks of a split model compile with its
    Python caller (the trainer's compiled cp=2 run then matched one eager process: checked by
    hand, 4 steps of tiny_hybrid within 1e-7; an Inductor test of it would cost minutes here)."""
    from model.presets import load_preset
    from model.transformer import build_model
    from parallel.activation import compile_model

    seen = []
    monkeypatch.setattr(
        torch.nn.Module, "compile", lambda self, **kw: seen.append(kw.get("options") or {})
    )
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    for split in (None, object()):
        model = build_model(load_preset("tiny_hybrid", MODEL | HYBRID), device="meta")
        model.context_split = split
        seen.clear()
        compile_model(model, "cpu")
        assert seen and all(("cpp_wrapper" in o) == (split is None) for o in seen), seen


def saved_activation_bytes(rank: int, T: int) -> int:
    """The bytes one fp32 training forward of a (1, T) packed row keeps for backward on this rank
    (distinct storages autograd saves, weights apart), split over every rank when there are
    several; the backward runs too (the split's collectives must pair up)."""
    import torch.distributed as dist

    from model.presets import load_preset
    from model.transformer import build_model
    from parallel.context_parallel import apply_context_parallel

    overrides = MODEL | HYBRID | {"n_layers": 2, "layer_pattern": ["gdn", "gqa"], "max_seq_len": T}
    model = build_model(load_preset("tiny_hybrid", overrides), seed=0)
    if dist.is_initialized():
        apply_context_parallel(model, dist.group.WORLD)
    tokens = torch.randint(0, 128, (1, T + 1), generator=torch.Generator().manual_seed(0))
    docs = (torch.arange(T) * 5 // T)[None]  # 5 packed documents, crossing the chunks
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens[:, :-1], tokens[:, 1:], doc_ids=docs)
    loss.backward()
    return sum(storages.values())


def test_a_long_sequence_on_four_ranks_keeps_a_quarter_of_the_activations():
    """T = 4096 on cp = 4 (Gated DeltaNet and softmax attention, packed documents): each rank
    keeps at most 0.3 of one process's activations (measured 47.5 of 179.5 MiB, 0.26 on the
    2-core AMD EPYC: 1/4 of the per-token ones, plus every rank's keys and values of the
    attention layer and the (T / 4, T) mask of SDPA's path); bench/context_parallel_memory.py
    measures more layers and cp sizes."""
    whole = saved_activation_bytes(0, 4096)
    per_rank = run_ranks(4, saved_activation_bytes, 4096)
    assert max(per_rank) < 0.3 * whole, (per_rank, whole)
