"""Sequence parallelism over the tp ranks (`parallel.sequence_parallel`, with parallel.tp > 1).

Between the sublayers, the residual stream is split along the sequence: each tp rank keeps
T / tp positions of it, so the norms, the residual additions and the stream's own state
(Attention Residuals' sources, mHC's n streams) take 1 / tp of the activation memory they take
under tensor parallelism alone. The sublayers that need every position on every tp rank (the
token mixers, the tensor-parallel FFNs and MoE layers, Engram: each block names them,
`Block.whole_sequence_sublayers`) get their input gathered and give back the rank's positions
of their output:

    stream.expand(h)        h (B, T, C) whole -> this rank's (B, T / tp, C)
    sublayer(x)             x gathered to (B, T, C); its output (B, T, C) reduce-scattered to
                            (B, T / tp, C) (or cut, when it is whole on every rank: Engram)
    stream.collapse(state)  -> gathered to (B, T, C) for the final norm, the head and MTP

A sublayer with tensor-parallel row-wise projections (every mixer's output projection, a dense
FFN's down projection, a MoE's shared experts') ends with them, so its output is the sum over
the tp ranks of their outputs: those projections leave their output as this rank's partial sum
(`partial_output`, parallel/tensor_parallel_styles.py RowwiseSummable) and one reduce-scatter
along the sequence both sums and splits it (Megatron's sequence parallelism): per sublayer an
all-gather and a reduce-scatter, the bytes of tensor parallelism's one all-reduce.

Gradients: every consumer of a gathered tensor returns the whole gradient of its input on every
tp rank (tensor-parallel projections all-reduce it; modules that run whole compute the same one),
so a gather's backward keeps the rank's positions and a cut's (or reduce-scatter's) backward
gathers them. The weights
used on the split stream (norm gains, the residual connections' and the stream's own) get a
gradient from the rank's positions only: the engine sums them over the tp ranks once per step
(`sum_partial_gradients`, as Megatron all-reduces its sequence-parallel norms' gradients).

A sublayer with `local_positions` (the MoE layer) is told, per forward, which positions this rank
keeps: its router still sees every token (statistics and balance losses of the whole sequence),
but its routed experts run for the kept tokens only, so the tp ranks share the expert work
instead of repeating it. Its router and experts then get their gradient from the kept tokens
(`position_local_parameters`): summed over the tp ranks like the norms'.

A forward whose length tp does not divide (decoding one token, odd scoring lengths) keeps the
stream whole on every rank, as without sequence parallelism: the same numbers either way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from model.transformer import Transformer


class _Layout:
    """What the current forward does: `full` the sequence length when the stream is split
    (0: whole on every rank)."""

    def __init__(self, tp: int, rank: int, group: dist.ProcessGroup) -> None:
        self.tp, self.rank, self.group, self.full = tp, rank, group, 0

    def split_here(self, x: Tensor) -> bool:
        """Whether `x` (B, T', ...) holds this rank's positions of a split stream."""
        return self.full > 0 and x.shape[1] * self.tp == self.full


class _Gather(torch.autograd.Function):
    """(B, T / tp, ...) -> (B, T, ...) in rank order; backward keeps this rank's positions."""

    @staticmethod
    def forward(ctx: object, x: Tensor, layout: _Layout) -> Tensor:
        ctx.layout = layout
        parts = [torch.empty_like(x) for _ in range(layout.tp)]
        dist.all_gather(parts, x.contiguous(), group=layout.group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> tuple[Tensor, None]:
        layout = ctx.layout
        return grad.chunk(layout.tp, dim=1)[layout.rank].contiguous(), None


class _ReduceScatter(torch.autograd.Function):
    """(B, T, ...) partial sums on each rank -> this rank's positions of their sum,
    (B, T / tp, ...); backward gathers the positions (the partial sums' gradient is whole)."""

    @staticmethod
    def forward(ctx: object, x: Tensor, layout: _Layout) -> Tensor:
        ctx.layout = layout
        stacked = torch.cat(x.chunk(layout.tp, dim=1))  # (tp B, T / tp, ...): rank r's at r B
        out = stacked.new_empty(stacked.shape[0] // layout.tp, *stacked.shape[1:])
        dist.reduce_scatter_tensor(out, stacked, group=layout.group)
        return out

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> tuple[Tensor, None]:
        return _Gather.apply(grad, ctx.layout), None


class _Cut(torch.autograd.Function):
    """(B, T, ...) -> this rank's (B, T / tp, ...); backward gathers the positions."""

    @staticmethod
    def forward(ctx: object, x: Tensor, layout: _Layout) -> Tensor:
        ctx.layout = layout
        return x.chunk(layout.tp, dim=1)[layout.rank].contiguous()

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> tuple[Tensor, None]:
        return _Gather.apply(grad, ctx.layout), None


def apply_sequence_parallel(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Split the residual stream of `model` (already tensor-parallel over `tp_mesh`) along the
    sequence between its sublayers (module docstring)."""
    layout = _Layout(tp_mesh.size(), tp_mesh.get_local_rank(), tp_mesh.get_group())
    stream = model.stream
    expand, collapse = stream.expand, stream.collapse

    def split_expand(h: Tensor) -> object:
        layout.full = h.shape[1] if h.shape[1] % layout.tp == 0 else 0
        return expand(_Cut.apply(h, layout) if layout.full else h)

    def gather_collapse(state: object) -> Tensor:
        h = collapse(state)
        return _Gather.apply(h, layout) if layout.split_here(h) else h

    stream.expand, stream.collapse = split_expand, gather_collapse
    split_region = [("stream", stream)]  # what acts on the rank's positions only
    names: list[str] = []  # weights whose gradient comes from the rank's positions only
    for index, block in model.layers.items():  # (MTP's blocks run after the gather: whole)
        whole = block.whole_sequence_sublayers()
        for name in whole:
            sublayer = getattr(block, name)
            _whole_sequence(sublayer, layout)
            if hasattr(sublayer, "local_positions"):  # computes only the kept positions
                local = sublayer.position_local_parameters()
                names += [f"layers.{index}.{name}.{p}" for p in local]
        split_region += [
            (f"layers.{index}.{n}", m) for n, m in block.named_children() if n not in whole
        ]
    names += [f"{prefix}.{n}" for prefix, m in split_region for n, _ in m.named_parameters()]
    mark_partial_gradients(model, names, layout.group)


def mark_partial_gradients(model: nn.Module, names: list[str], group: dist.ProcessGroup) -> None:
    """Record that the gradients of parameters `names` are partial sums over `group` (each rank
    saw its own positions): `sum_partial_gradients` completes them before clipping. Names, not
    tensors: FSDP2 replaces the parameters afterwards."""
    model.partial_gradients = [*getattr(model, "partial_gradients", []), (names, group)]


@torch.no_grad()
def sum_partial_gradients(model: nn.Module) -> None:
    """All-reduce the gradients `mark_partial_gradients` recorded (this rank's FSDP2 shard of
    each: the other ranks of the group hold the same rows), once per step: the sum is linear,
    so after accumulation and FSDP2's reduction over the data ranks is as good as before."""
    for names, group in getattr(model, "partial_gradients", []):
        grads = [model.get_parameter(n).grad for n in names]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads if g is not None]
        if local:
            flat = torch.cat([g.reshape(-1) for g in local])
            dist.all_reduce(flat, group=group)
            for g, part in zip(local, flat.split([g.numel() for g in local]), strict=True):
                g.copy_(part.view_as(g))


def _whole_sequence(module: nn.Module, layout: _Layout) -> None:
    """`module` (its first argument the stream's (B, T', ...) tensor) sees every position and
    returns this rank's positions of its output, when the stream is split."""
    forward = module.forward

    def gathered_forward(x: Tensor, *args: object, **kwargs: object) -> Tensor:
        if not layout.split_here(x):
            return forward(x, *args, **kwargs)
        keeps_positions = hasattr(module, "local_positions")
        if keeps_positions:  # (a MoE layer runs its routed experts for the kept tokens only)
            share = layout.full // layout.tp
            module.local_positions = (layout.rank * share, (layout.rank + 1) * share)
        set_partial(module, closing, layout.group)
        try:
            out = forward(_Gather.apply(x, layout), *args, **kwargs)
        finally:
            set_partial(module, closing, None)
            if keeps_positions:
                module.local_positions = None
        return _ReduceScatter.apply(out, layout) if closing else _Cut.apply(out, layout)

    # its row-wise projections (whose outputs, with a MoE layer's routed output for the kept
    # positions, sum to the sublayer's output): left as partial sums, reduce-scattered at once
    closing = [m for m in module.modules() if hasattr(m, "partial_output")]
    module.forward = gathered_forward  # (an instance attribute: nn.Module calls it)


def set_partial(
    module: nn.Module, projections: list[nn.Module], group: dist.ProcessGroup | None
) -> None:
    """Row-wise `projections` inside `module` leave their output as the rank's partial sum
    (group given) or sum it themselves (None); a module that computes with such a sum (a MoE
    layer's shared experts' gate: `sum_partial`) is told how to complete it."""
    for projection in projections:
        projection.partial_output = group is not None
    if projections and hasattr(module, "sum_partial"):
        module.sum_partial = None if group is None else _summed_over(group)


def _summed_over(group: dist.ProcessGroup):
    def sum_partial(t: Tensor) -> Tensor:
        dist.all_reduce(t, group=group)
        return t

    return sum_partial
