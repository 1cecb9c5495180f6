"""Rank functions of the tensor-parallel tests (imported by the forked gloo ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from model.presets import load_preset
from model.transformer import build_model

VOCAB, B, T = 128, 2, 16


def batch(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (B, T + 1), generator=g)
    targets = tokens[:, 1:].clone()
    targets[0, :4] = -100  # some ignored targets
    return tokens[:, :-1], targets


def whole(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.full_tensor() if isinstance(t, DTensor) else t


def tp_forward_backward(
    rank: int,
    preset: str,
    overrides: dict[str, Any],
    length: int = T,
    sequence_parallel: bool = False,
) -> dict[str, Any]:
    """One fp32 forward + backward of a seeded model, split over every rank as one tp group (or
    whole, without a process group): loss, whole gradients, scoring log-probs, logits. `length`:
    the first positions of the batch only."""
    from parallel.sequence_parallel import sum_partial_gradients
    from parallel.tensor_parallel import split_over_tp, tp_mesh_of

    cfg = load_preset(preset, {"vocab_size": VOCAB, "max_seq_len": 64} | overrides)
    model = build_model(cfg, seed=0)
    replicated: list[str] = []
    if dist.is_initialized():
        world = dist.get_world_size()
        replicated = split_over_tp(model, tp_mesh_of(world, world, "cpu"), sequence_parallel)
    inputs, targets = (t[:, :length] for t in batch())
    loss = model(inputs, targets)
    loss.backward()
    sum_partial_gradients(model)  # (a MoE layer's router and routed experts: each rank's tokens)
    grads = {n: whole(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        log_probs = model(inputs, targets, per_token=True)
        logits = model(inputs)
    return {
        "loss": loss.detach(),
        "grads": grads,
        "log_probs": log_probs,
        "logits": logits,
        "replicated": replicated,
        "sharded": sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor)),
    }


def assert_equal_one_process(got: dict, whole: dict) -> None:
    """tp_forward_backward's results on a rank against one process's (fp32: the tp ranks sum
    partial products in another order)."""
    torch.testing.assert_close(got["loss"], whole["loss"], rtol=1e-6, atol=1e-6)
    assert set(got["grads"]) == set(whole["grads"])
    for name, grad in whole["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(got["log_probs"], whole["log_probs"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["logits"], whole["logits"], rtol=1e-5, atol=1e-5)


def assert_same_training(got: dict, whole: dict) -> None:
    """tp_fsdp_train's losses, norms and final weights against one process's (SGD: the update
    is linear in the gradient, so the weights compare as tightly as the gradients)."""
    torch.testing.assert_close(got["losses"], whole["losses"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["norms"], whole["norms"], rtol=1e-5, atol=1e-6)
    for name, weight in whole["weights"].items():
        torch.testing.assert_close(
            got["weights"][name], weight, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


GLOBAL_BATCH, STEPS = 4, 3


def train_batches(seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, T + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def tp_fsdp_train(rank: int, preset: str, overrides: dict[str, Any], tp: int) -> dict[str, Any]:
    """STEPS SGD steps (clipped at 1.0) of a seeded fp32 model: FSDP2 over world / tp data
    ranks composed with tensor parallelism over tp (built on the meta device, then materialized
    and initialized as one process would be), or whole without a process group. Each data rank
    takes its rows of every global batch; the tp ranks of a group take the same rows."""
    from torch.distributed.device_mesh import init_device_mesh

    from model.transformer import Transformer
    from parallel.fsdp import FP32, apply_fsdp
    from parallel.grad_norm import clip_grad_norm
    from parallel.init import init_like_single_process
    from parallel.mesh import Meshes, ParallelDims
    from parallel.sequence_parallel import sum_partial_gradients
    from parallel.tensor_parallel import split_over_tp

    cfg = load_preset(preset, {"vocab_size": VOCAB, "max_seq_len": 64} | overrides)
    world = dist.get_world_size() if dist.is_initialized() else 1
    dp, dp_rank = world // tp, rank // tp
    with torch.device("meta"):
        model = Transformer(cfg)
    if world > 1:
        root = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp_shard", "tp"))
        split_over_tp(model, root["tp"], False)
        dims = ParallelDims(dp_replicate=1, dp_shard=dp, ep=1, world_size=world)
        apply_fsdp(
            model, Meshes(dims=dims, dense=root["dp_shard"], experts=None, ep=None), FP32, True
        )
    model.to_empty(device="cpu")
    init_like_single_process(model, torch.device("cpu"), seed=0)
    params = list(model.parameters())
    # SGD: the update is linear in the gradient, so the weights compare as tightly as they do
    optimizer = torch.optim.SGD(params, lr=0.5)
    losses, norms = [], []
    rows = slice(dp_rank * GLOBAL_BATCH // dp, (dp_rank + 1) * GLOBAL_BATCH // dp)
    for inputs, targets in train_batches():
        loss = model(inputs[rows], targets[rows])
        loss.backward()
        sum_partial_gradients(model)  # (as the engine does before clipping)
        norms.append(clip_grad_norm(params, 1.0, tp if world > 1 else 1))
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
            mean /= world  # every tp rank of a data rank holds the same loss
        losses.append(mean)
    weights = {n: whole(p.detach()) for n, p in model.named_parameters()}
    return {"losses": torch.stack(losses), "norms": torch.stack(norms), "weights": weights}
