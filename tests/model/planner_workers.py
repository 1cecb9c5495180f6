"""Rank functions of the planner tests (tests/model/test_planner.py), imported by the forked gloo
ranks: what a rank of a tensor-parallel (+ sequence-parallel, expert-parallel, FSDP2) model
really holds and sends, and what one process's forward keeps for backward."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from model.presets import load_preset
from model.transformer import Transformer


def local(t: Tensor) -> Tensor:
    """The tensor this rank holds: a DTensor's shard, a pending collective's result."""
    if isinstance(t, AsyncCollectiveTensor):  # (a tensor-parallel all-reduce's output)
        return t.trigger_wait()
    return t.to_local() if isinstance(t, DTensor) else t


def local_bytes(tensors: list[Tensor]) -> int:
    return sum(local(t).numel() * t.element_size() for t in tensors)


def saved_bytes(model: torch.nn.Module, run: Any) -> int:
    """Bytes of the tensors autograd keeps for backward while `run()` runs a forward: each
    storage once (views share theirs), the model's weights left out (those are not
    activations)."""
    weights = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[tuple[int, int], int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = local(t).untyped_storage()
        if storage.data_ptr() not in weights:
            storages[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(storages.values())


def _split_model(
    cfg: Any, tp: int, fsdp: bool, sequence_parallel: bool = False, ep: int = 1, ac: str = "none"
) -> Transformer:
    """The seeded fp32 model over every rank: (ep) expert parallelism, tensor parallelism over tp
    consecutive ranks, (sequence_parallel) the stream split along the sequence, (ac) activation
    checkpointing, then (fsdp) FSDP2 over the world / tp data ranks: the trainer's order
    (parallel/compose.py), on the meshes it builds."""
    from parallel.activation import apply_activation_checkpointing
    from parallel.fsdp import FP32, apply_fsdp
    from parallel.init import init_like_single_process
    from parallel.mesh import ParallelDims, build_meshes
    from parallel.tensor_parallel import split_over_tp

    world = dist.get_world_size()
    dims = ParallelDims(dp_replicate=1, dp_shard=world // tp, ep=ep, world_size=world, tp=tp)
    meshes = build_meshes(dims, "cpu")
    with torch.device("meta"):
        model = Transformer(cfg)
    if ep > 1:
        from parallel.expert_parallel import apply_expert_parallel

        apply_expert_parallel(model, meshes.ep)
    split_over_tp(model, meshes.tp, sequence_parallel)
    apply_activation_checkpointing(model, ac)
    if fsdp:
        apply_fsdp(model, meshes, FP32, True, recompute=ac != "none")
    model.to_empty(device="cpu")
    init_like_single_process(model, torch.device("cpu"), seed=0)
    return model


def measured_rank(
    rank: int, preset: str, overrides: dict[str, Any], tp: int, ep: int = 1
) -> dict[str, int]:
    """One fp32 AdamW step on a micro-batch of 2 x 64 tokens: the bytes of this rank's weight,
    gradient and AdamW moment shards; with tp alone (world = tp) also the bytes its forward
    keeps for backward (measured without FSDP2, whose gathered weights would count)."""
    cfg = load_preset(preset, overrides)
    inputs, targets = _batch(cfg, rank // tp)  # the tp ranks of a data rank share a batch
    out: dict[str, int] = {}
    if dist.get_world_size() == tp:
        plain = _split_model(cfg, tp, fsdp=False)
        out["activations"] = saved_bytes(plain, lambda: plain(inputs, targets))
    model = _split_model(cfg, tp, fsdp=True, ep=ep)
    params = list(model.parameters())
    out["weights"] = local_bytes(params)
    model(inputs, targets).backward()
    out["grads"] = local_bytes([p.grad for p in params])
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    optimizer.step()
    moments = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    out["optimizer"] = local_bytes(moments)
    return out


def _batch(cfg: Any, seed: int) -> tuple[Tensor, Tensor]:
    """A micro-batch of 2 x 64 tokens and its targets."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (2, 65), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def measured_split(
    rank: int, preset: str, overrides: dict[str, Any], sequence_parallel: bool
) -> dict[str, dict[str, Any]]:
    """On world = tp ranks (no FSDP2), without and with full activation checkpointing: the
    bytes a forward keeps for backward, and the bytes this rank sends in each phase of a step
    (forward, backward, the per-step sum of sequence parallelism's partial gradients), every
    collective being over the tp group."""
    from parallel.sequence_parallel import sum_partial_gradients

    cfg = load_preset(preset, overrides)
    tp = dist.get_world_size()
    inputs, targets = _batch(cfg, 0)
    out: dict[str, dict[str, Any]] = {}
    for ac in ("none", "full"):
        model = _split_model(cfg, tp, fsdp=False, sequence_parallel=sequence_parallel, ac=ac)
        kept = saved_bytes(model, lambda m=model: m(inputs, targets))
        with SentBytes() as sent:
            loss = model(inputs, targets)
            sent.phase = "backward"
            loss.backward()
            sent.phase = "step"
            sum_partial_gradients(model)
        out[ac] = {"activations": kept, "sent": dict(sent.sent), "ops": sent.ops}
    return out


def _group_size(arg: Any) -> int | None:
    """The size of a collective's group from one of its arguments (a ProcessGroup script
    object for c10d's ops, a group name for the functional ones), None for other arguments."""
    if isinstance(arg, torch.ScriptObject):
        return dist.ProcessGroup.unbox(arg).size()
    if isinstance(arg, str) and arg:
        try:
            return dist.distributed_c10d._resolve_process_group(arg).size()
        except (KeyError, RuntimeError, ValueError):
            return None
    return None


def _nbytes(tensors: Any) -> int:
    if isinstance(tensors, Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


# collective -> (which argument holds the tensors it sizes by, the fraction of their bytes a rank
# sends in a ring over P ranks): an all-reduce sends 2 (P - 1) / P of the tensor, an all-gather
# (P - 1) / P of its output, a reduce-scatter and an all-to-all (P - 1) / P of their input
RING = {
    "_c10d_functional.all_reduce": (0, lambda p: 2 * (p - 1) / p),
    "_c10d_functional.all_reduce_coalesced": (0, lambda p: 2 * (p - 1) / p),
    "_c10d_functional.all_gather_into_tensor": (0, lambda p: p - 1),  # (its input)
    "_c10d_functional.reduce_scatter_tensor": (0, lambda p: (p - 1) / p),
    "_c10d_functional.all_to_all_single": (0, lambda p: (p - 1) / p),
    "_c10d_functional_autograd.all_to_all_single": (0, lambda p: (p - 1) / p),
    "c10d.allreduce_": (0, lambda p: 2 * (p - 1) / p),
    "c10d.allreduce_coalesced_": (0, lambda p: 2 * (p - 1) / p),
    "c10d._allgather_base_": (0, lambda p: (p - 1) / p),
    "c10d.allgather_": (1, lambda p: p - 1),  # (its inputs)
    "c10d.allgather_into_tensor_coalesced_": (0, lambda p: (p - 1) / p),
    "c10d._reduce_scatter_base_": (1, lambda p: (p - 1) / p),
    "c10d.reduce_scatter_tensor_coalesced_": (1, lambda p: (p - 1) / p),
    "c10d.alltoall_base_": (1, lambda p: (p - 1) / p),
    "c10d.send": (0, lambda p: 1),  # point to point (pipeline stages): all of it
}


class SentBytes(TorchDispatchMode):
    """Counts the bytes this rank sends in the collectives run under it, by `phase` (the
    caller sets it), in the ring model the planner uses; `ops`: (phase, op, bytes) in order.
    DTensor's operations pass through it first untouched and come back as the plain-tensor
    collectives they turn into (as torch's CommDebugMode does)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.sent: dict[str, float] = {}
        self.ops: list[tuple[str, str, float]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        name = f"{func.namespace}.{func.__name__.split('.')[0]}"
        if name in RING:
            index, share = RING[name]
            ranks = next(p for a in args if (p := _group_size(a)) is not None)
            nbytes = _nbytes(args[index]) * share(ranks)
            self.sent[self.phase] = self.sent.get(self.phase, 0.0) + nbytes
            self.ops.append((self.phase, name, nbytes))
        return out


def measured_process(preset: str, overrides: dict[str, Any], ac: str, B: int, T: int) -> int:
    """Bytes one process's fp32 forward keeps for backward (parallel/activation.py's `ac`)."""
    from model.transformer import build_model
    from parallel.activation import apply_activation_checkpointing

    cfg = load_preset(preset, overrides)
    model = build_model(cfg, seed=0)
    apply_activation_checkpointing(model, ac)
    tokens = torch.randint(
        0, cfg.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(0)
    )
    return saved_bytes(model, lambda: model(tokens[:, :-1], tokens[:, 1:]))


def measured_pipeline(
    rank: int, overrides: dict[str, Any], layout: dict[str, Any], micro_batches: int
) -> dict[str, float]:
    """Bytes this rank sends in one step of the trainer's pipeline engine (fp32, tests/parallel/
    workers.py's model and batches; overrides["preset"], default tiny), in the planner's ring
    model: "pp", the stages' point-to-point sends and the shared embedding's gradient
    all-reduce; "fsdp", FSDP2's all-gathers and reduce-scatters. Scalars (the schedule's warm-up
    votes, the gradient norm's all-reduce) are left out."""
    from parallel.engine import plain_loss
    from tests.parallel.workers import engine_for, global_batches, local_batch, small_model

    overrides = dict(overrides)
    cfg = small_model(overrides.pop("preset", "tiny"), **overrides)
    engine = engine_for(cfg, layout, micro_batches=micro_batches)
    batch = local_batch(global_batches(1, cfg.vocab_size)[0], 1, layout["pp"])
    with SentBytes() as sent:
        engine.forward_backward_step(batch.inputs, batch.targets, None, micro_batches, plain_loss)
        engine.clip_gradients(1.0)
    kinds = {"c10d.send": "pp", "c10d.allreduce_": "pp", "c10d._allgather_base_": "fsdp"}
    kinds["c10d._reduce_scatter_base_"] = "fsdp"
    out = {"pp": 0.0, "fsdp": 0.0}
    for _, name, nbytes in sent.ops:
        if nbytes > 8:
            out[kinds[name]] += nbytes
    return out
