"""Rank functions of the planner tests (tests/model/test_planner.py), imported by the forked gloo
ranks: what a rank of a tensor-parallel (+ FSDP2) model really holds, and what one process's
forward keeps for backward."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

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


def _split_model(cfg: Any, tp: int, fsdp: bool) -> Transformer:
    """The seeded fp32 model over every rank: tensor parallelism over tp consecutive ranks,
    then (fsdp) FSDP2 over the world / tp data ranks (as tests/parallel/tp_workers.py's
    tp_fsdp_train, and the trainer, build it)."""
    from torch.distributed.device_mesh import init_device_mesh

    from parallel.fsdp import FP32, apply_fsdp
    from parallel.init import init_like_single_process
    from parallel.mesh import Meshes, ParallelDims
    from parallel.tensor_parallel import apply_tensor_parallel

    world = dist.get_world_size()
    dp = world // tp
    with torch.device("meta"):
        model = Transformer(cfg)
    root = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp_shard", "tp"))
    apply_tensor_parallel(model, root["tp"])
    if fsdp:
        dims = ParallelDims(dp_replicate=1, dp_shard=dp, ep=1, world_size=world)
        apply_fsdp(
            model, Meshes(dims=dims, dense=root["dp_shard"], experts=None, ep=None), FP32, True
        )
    model.to_empty(device="cpu")
    init_like_single_process(model, torch.device("cpu"), seed=0)
    return model


def measured_rank(rank: int, preset: str, overrides: dict[str, Any], tp: int) -> dict[str, int]:
    """One fp32 AdamW step on a micro-batch of 2 x 64 tokens: the bytes of this rank's weight,
    gradient and AdamW moment shards; with tp alone (world = tp) also the bytes its forward
    keeps for backward (measured without FSDP2, whose gathered weights would count)."""
    cfg = load_preset(preset, overrides)
    g = torch.Generator().manual_seed(rank // tp)  # the tp ranks of a data rank share a batch
    tokens = torch.randint(0, cfg.vocab_size, (2, 65), generator=g)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    out: dict[str, int] = {}
    if dist.get_world_size() == tp:
        plain = _split_model(cfg, tp, fsdp=False)
        out["activations"] = saved_bytes(plain, lambda: plain(inputs, targets))
    model = _split_model(cfg, tp, fsdp=True)
    params = list(model.parameters())
    out["weights"] = local_bytes(params)
    model(inputs, targets).backward()
    out["grads"] = local_bytes([p.grad for p in params])
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    optimizer.step()
    moments = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    out["optimizer"] = local_bytes(moments)
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
