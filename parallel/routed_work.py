"""MoE layers under tensor parallelism on the whole sequence (without sequence parallelism, and
MTP's with it): the tp ranks share the routed work instead of repeating it.

Every tp rank holds the whole sequence (B, T, C). Each MoE layer (a module with
`local_positions`, model/moe/layer.py) still routes every token on every rank (the router's
statistics, balance losses and aux-loss-free bias updates stay the whole sequence's), but runs
its routed experts for its own positions only, [r T / tp, (r + 1) T / tp) on rank r, leaving
zeros elsewhere; its shared experts' row-wise projection leaves its output as the rank's partial
sum (`partial_output`: parallel/tensor_parallel_styles.py RowwiseSummable; their gate, if any,
sums its gradient over the ranks: model/moe/layer.py GatedPartialSum). So the layer's
output is a sum over the tp ranks, and one all-reduce of (B, T, C) completes it: with shared
experts it replaces their all-reduce (no extra bytes), without them it is one more. Expert
matmuls and expert-parallel all-to-alls drop to 1 / tp per rank.

Gradients: the output's gradient is whole on every rank. The input's gradient is complete at
the rank's own positions (its routed experts ran there; the shared experts and the router give
whole ones everywhere), so backward keeps those positions, zeroes the rest and all-reduces:
(B, T, C) once more. The router's gate and the routed experts get their gradient from the
rank's tokens only (`position_local_parameters`): summed over the tp ranks once per step, as
sequence parallelism's are (parallel/sequence_parallel.py sum_partial_gradients).

A layer that drops tokens over capacity (`model.moe.capacity_factor > 0`) keeps the repeated
work: its drops would depend on the split. In a forward shorter than tp some ranks route
no token.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from parallel.sequence_parallel import mark_partial_gradients, set_partial


def share_routed_work(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> list[str]:
    """Wrap each MoE layer of `model` (already tensor-parallel over `tp_mesh`) as the module
    docstring says; returns the wrapped layers' names. With sequence parallelism the stack's
    layers share their work through it (parallel/sequence_parallel.py): only MTP's, which run
    on the gathered sequence, are wrapped here."""
    group, rank, tp = tp_mesh.get_group(), tp_mesh.get_local_rank(), tp_mesh.size()
    wrapped, names = [], []
    for name, module in model.named_modules():
        if not hasattr(module, "local_positions") or module.cfg.capacity_factor > 0:
            continue
        if sequence_parallel and name.startswith("layers."):
            continue
        _share(module, group, rank, tp)
        wrapped.append(name)
        names += [f"{name}.{p}" for p in module.position_local_parameters()]
    if names:
        mark_partial_gradients(model, names, group)
    return wrapped


def _share(moe: nn.Module, group: dist.ProcessGroup, rank: int, tp: int) -> None:
    forward = moe.forward
    closing = [m for m in moe.modules() if hasattr(m, "partial_output")]

    def shared_forward(x: Tensor) -> Tensor:
        length = x.shape[1]  # (fewer positions than ranks: some ranks route none)
        start, stop = rank * length // tp, (rank + 1) * length // tp
        moe.local_positions = (start, stop)
        set_partial(moe, closing, group)
        try:
            out = forward(_OwnPositionsGrad.apply(x, start, stop, group))
        finally:
            moe.local_positions = None
            set_partial(moe, closing, None)
        return _SumOutput.apply(out, group)

    moe.forward = shared_forward  # (an instance attribute: nn.Module calls it)


class _OwnPositionsGrad(torch.autograd.Function):
    """Identity forward on x (B, T, C); backward keeps the gradient at positions [start, stop)
    (complete on this rank), zeroes the rest and sums over the group."""

    @staticmethod
    def forward(ctx: object, x: Tensor, start: int, stop: int, group: object) -> Tensor:
        ctx.start, ctx.stop, ctx.group = start, stop, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> tuple[Tensor, None, None, None]:
        own = torch.zeros_like(grad)
        own[:, ctx.start : ctx.stop] = grad[:, ctx.start : ctx.stop]
        dist.all_reduce(own, group=ctx.group)
        return own, None, None, None


class _SumOutput(torch.autograd.Function):
    """All-reduce (sum) of the ranks' partial outputs; backward passes the whole gradient."""

    @staticmethod
    def forward(ctx: object, x: Tensor, group: object) -> Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None
