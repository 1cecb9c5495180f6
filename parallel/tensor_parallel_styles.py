"""The parallel styles tensor-parallel plans name (parallel/tensor_parallel.py STYLES), beside
DTensor's column- and row-wise ones: weights kept whole on every tp rank whose gradient is partial
(each rank computes with its own heads, rows or positions of them) and is summed over the ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.nn.utils.stateless import _reparametrize_module


class Replicated(ParallelStyle):
    """A module every rank holds whole and runs on the same whole input, computing the same
    output (MLA's and KDA's low-rank down projections and their norms): exact, and its
    gradient is whole on every rank as long as whatever uses its output passes a whole
    gradient back (a column-wise projection sums its input's gradient over the ranks; a
    tensor that feeds each rank's own heads directly goes through "copy_to_heads" first).
    Nothing changes: the weights stay plain tensors, which FSDP2 shards over the data ranks."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return module


class CopyToHeads(ParallelStyle):
    """An identity module in front of a tensor that every rank holds whole but uses for its own
    heads only (MLA's rope key, shared by every head): forward unchanged, backward sums the
    gradient over the tp ranks (Megatron's copy to the tensor-parallel region)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        module.register_forward_pre_hook(
            lambda _, args: (_SumGrad.apply(args[0], group), *args[1:])
        )
        return module


class HeadShared(ParallelStyle):
    """Weights every rank holds whole and applies to its own share of the heads (QK-norm's and
    the gated output norms' gains, one per head dim): each rank's gradient is partial, so it is
    summed over the tp ranks. The weights become Replicate DTensors (FSDP2 then shards them over
    the data ranks); the module runs on their local tensors, whose gradient an all-reduce
    completes in backward. `params`: the dotted names of the parameters this applies to
    (default: the module's own)."""

    def __init__(self, params: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.params = params

    def rows(self, name: str, p: Tensor, rank: int, tp: int) -> list[tuple[int, int]] | None:
        """The rows of parameter `name` this rank computes with (None: all)."""
        return None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        names = self.params or tuple(n for n, _ in module.named_parameters(recurse=False))
        rank, tp, group = device_mesh.get_local_rank(), device_mesh.size(), device_mesh.get_group()
        rows = {}
        for name in names:
            owner, _, leaf = name.rpartition(".")
            holder = module.get_submodule(owner)
            p = getattr(holder, leaf)
            rows[name] = self.rows(name, p, rank, tp)
            whole = distribute_tensor(p.data, device_mesh, [Replicate()])
            holder.register_parameter(leaf, nn.Parameter(whole, requires_grad=p.requires_grad))
        forward = module.forward  # (another style may have wrapped it already)

        def local_forward(*args: object, **kwargs: object) -> object:
            local = {}
            for name in names:
                p = module.get_parameter(name)
                if isinstance(p, DTensor):
                    p = _SumGrad.apply(p.to_local(), group)
                local[name] = _take_rows(p, rows[name])
            with _reparametrize_module(module, local):
                return forward(*args, **kwargs)

        module.forward = local_forward  # (an instance attribute: nn.Module calls it)
        return module


class HeadRows(HeadShared):
    """Parameters whose rows belong to heads, used by the layer on its own heads' activations
    (the short convolutions' channels over [q | k | v], the per-head decays A_log and dt_bias):
    every rank holds them whole (they are small) and computes with its heads' rows; the other
    rows' gradients are zero on this rank, so the sum over the tp ranks is the whole gradient.
    `parts`: dim 0 as consecutive blocks of (heads, rows per head), each split by heads the way
    the column-wise projections split their outputs (see `head_rows`)."""

    def __init__(self, parts: tuple[tuple[int, int], ...], params: tuple[str, ...] = ()) -> None:
        super().__init__(params)
        self.parts = parts

    def rows(self, name: str, p: Tensor, rank: int, tp: int) -> list[tuple[int, int]]:
        width = sum(heads * per_head for heads, per_head in self.parts)
        if p.shape[0] != width:
            raise ValueError(
                f"{name}: {p.shape[0]} rows, but the plan's parts {self.parts} hold {width}"
            )
        return head_rows(self.parts, rank, tp)


class ColwiseReplicated(HeadShared):
    """A column-wise projection of `heads` heads, fewer than the tp ranks (key/value heads when
    tp exceeds them, as Megatron does): every rank holds it whole and computes the one head its
    share of the query heads uses (rank r: head r * heads // tp). The ranks sharing a head each
    pass back their own query heads' part of its gradient, so both the weights' gradient and
    the input's are summed over the tp ranks."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.heads = heads

    def rows(self, name: str, p: Tensor, rank: int, tp: int) -> list[tuple[int, int]]:
        if p.shape[0] % self.heads:
            raise ValueError(f"{name}: {p.shape[0]} rows do not split into {self.heads} heads")
        return head_rows(((self.heads, p.shape[0] // self.heads),), rank, tp)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        super()._apply(module, device_mesh)
        group = device_mesh.get_group()
        module.register_forward_pre_hook(
            lambda _, args: (_SumGrad.apply(args[0], group), *args[1:])
        )
        return module


class RowwiseSummable(RowwiseParallel):
    """DTensor's row-wise projection (input split on its last dim, output summed over the tp
    ranks), whose closing sum the caller may take over: while the module's `partial_output` is
    true, its output is this rank's partial sum (a plain tensor whose gradient is whole), so
    sequence parallelism reduce-scatters a sublayer's output along the sequence in one
    collective (Megatron's) instead of all-reducing it and cutting the rank's positions out."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.partial_output = False
        return super()._apply(module, device_mesh)

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if mod.partial_output:
            return outputs.to_local(grad_placements=[Replicate()])
        return RowwiseParallel._prepare_output_fn(
            output_layouts, use_local_output, mod, outputs, device_mesh
        )


class TableRows(ParallelStyle):
    """A lookup table's rows split over the tp ranks (Engram's hashed n-gram tables), as
    RowwiseParallel splits an embedding: the weight (rows, D) becomes a Shard(0) DTensor (uneven
    rows as torch.chunk cuts them; FSDP2 then shards each rank's rows over the data ranks), and
    the module's `lookup(index, sparse)` reads the rows this rank holds, zeros for the others,
    with an all-reduce summing the ranks' parts (DTensor's masked partial embedding). The
    output's gradient is whole on every rank, so each rank's rows get theirs without a
    collective. Gradients are dense (FSDP2 reduce-scatters dense tensors)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        w = module.weight
        rows = distribute_tensor(w.data, device_mesh, [Shard(0)])
        module.register_parameter("weight", nn.Parameter(rows, requires_grad=w.requires_grad))
        module.sparse_grad = False

        def lookup(index: Tensor, sparse: bool) -> Tensor:
            whole = DTensor.from_local(index, device_mesh, [Replicate()], run_check=False)
            part = F.embedding(whole, module.weight)  # masked partial over the tp ranks
            return part.redistribute(device_mesh, [Replicate()]).to_local()

        module.lookup = lookup  # (an instance attribute: the module's forward calls it)
        return module


def head_rows(parts: tuple[tuple[int, int], ...], rank: int, tp: int) -> list[tuple[int, int]]:
    """Rank `rank`'s (start, end) rows of a tensor whose dim 0 is blocks of (heads, rows per
    head): of each block, heads [r h / tp, (r + 1) h / tp) when tp divides h (as ColwiseParallel
    splits), else (tp a multiple of h) the one head r h // tp."""
    ranges, offset = [], 0
    for heads, per_head in parts:
        if heads % tp == 0:
            first, count = rank * heads // tp, heads // tp
        elif tp % heads == 0:
            first, count = rank * heads // tp, 1
        else:
            raise ValueError(f"tp={tp} neither divides nor is a multiple of {heads} heads")
        ranges.append((offset + first * per_head, offset + (first + count) * per_head))
        offset += heads * per_head
    return ranges


def _take_rows(p: Tensor, rows: list[tuple[int, int]] | None) -> Tensor:
    if rows is None:
        return p
    pieces = [p[start:end] for start, end in rows]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class _SumGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over `group` (every rank's share)."""

    @staticmethod
    def forward(ctx: object, x: Tensor, group: object) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


# what a plan may name: a style's name, or (name, *plain arguments)
STYLES: dict[str, type[ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseSummable,
    "replicated": Replicated,
    "copy_to_heads": CopyToHeads,
    "head_shared": HeadShared,
    "head_rows": HeadRows,
    "colwise_replicated": ColwiseReplicated,
    "table_rows": TableRows,
}
# the styles a plan may give a parameter (a dotted name under the planned module) rather than a
# child module: they wrap the planned module's forward, which reads that parameter
PARAMETER_STYLES = (HeadShared, HeadRows)
