"""Expert parallelism: experts split over the `ep` ranks, tokens exchanged with all-to-all.

Each rank routes its own tokens. The MoE layer sorts the (token, expert) pairs by global expert
id and hands them to `moe.dispatch`; here that is `AllToAllDispatch`:

1. exchange per-expert counts (all-to-all of E integers), so every rank knows how many rows it
   receives from each source for each of its local experts;
2. all-to-all the rows (autograd flows back through the collective), regroup them by local
   expert, run the local experts' grouped GEMM;
3. undo the regrouping and all-to-all the results back; the layer combines them with the
   routing weights.

Shapes: M (token, expert) pairs sent by this rank, R rows received, C d_model, E experts,
P = ep ranks, L = E / P local experts (rank r holds experts r*L ... r*L + L - 1).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from model.errors import ConfigError
from model.moe.slots import sort_slots
from model.roles import EXPERT_STACK, role_owners
from model.transformer import Transformer


class AllToAllDispatch:
    """The all-to-all over `group`, the `ep` ranks that share their tokens (rank i of the group
    holds experts i L ... i L + L - 1): the FSDP2 engine's ep mesh, or DeepSpeed's group."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.ranks = dist.get_world_size(group)

    @torch.compiler.disable  # data-dependent splits: run eagerly inside a compiled block
    def __call__(self, x_sorted: Tensor, counts: Tensor, experts: nn.Module) -> Tensor:
        """x_sorted (M, C) grouped by global expert, counts (E,) -> outputs (M, C), same order."""
        P = self.ranks
        L = counts.numel() // P
        send_counts = counts.view(P, L)  # rows for each (destination rank, its local expert)
        recv_counts = torch.empty_like(send_counts)  # rows from each (source, my local expert)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        # one device-to-host copy for both split lists and the received total
        splits = torch.cat([send_counts.sum(1), recv_counts.sum(1)]).tolist()
        send_splits, recv_splits = splits[:P], splits[P:]
        received = _all_to_all(x_sorted, recv_splits, send_splits, self.group)  # (R, C)
        # received is ordered (source, local expert); the grouped GEMM wants (local expert, ...)
        expert_of_row = torch.arange(L, device=counts.device).repeat(P)
        expert_of_row = expert_of_row.repeat_interleave(
            recv_counts.flatten(), output_size=sum(recv_splits)
        )
        order = sort_slots(expert_of_row, L)  # stable: (source, row) order within an expert
        out_grouped = experts(received[order], recv_counts.sum(0))
        out = torch.empty_like(out_grouped).index_copy(0, order, out_grouped)
        return _all_to_all(out, send_splits, recv_splits, self.group)


def _all_to_all(x: Tensor, output_splits: list[int], input_splits: list[int], group) -> Tensor:
    y = funcol.all_to_all_single_autograd(x.contiguous(), output_splits, input_splits, group)
    return funcol.wait_tensor(y) if isinstance(y, funcol.AsyncCollectiveTensor) else y


def expert_layers(model: nn.Module) -> list[nn.Module]:
    """The layers that route tokens to a stack of experts, in module order: those with a child
    holding parameters of role `expert_stack` (model.roles). Each declares `experts` (that
    child: (E, ...) weights, one matrix per expert), `n_experts` and `dispatch` (how routed
    tokens reach the experts: what expert parallelism replaces by an all-to-all)."""
    stacks = {id(module) for module in role_owners(model, EXPERT_STACK)}
    return [m for m in model.modules() if any(id(c) in stacks for c in m.children())]


def apply_expert_parallel(model: Transformer, mesh: DeviceMesh) -> None:
    """Shard every MoE layer's experts on dim 0 over `mesh` (ep) and install the all-to-all."""
    for moe in expert_layers(model):
        experts = moe.experts
        total = moe.n_experts
        if total % mesh.size():
            raise ConfigError(
                f"model.moe.n_routed_experts={total} is not divisible by parallel.ep={mesh.size()}"
            )
        shard_experts(experts, mesh)
        moe.dispatch = AllToAllDispatch(mesh.get_group())


def shard_experts(experts: nn.Module, mesh: DeviceMesh) -> None:
    """Replace each (E, ...) expert weight by a DTensor sharded on dim 0 over `mesh`: rank r
    keeps experts [r E/P, (r+1) E/P). No communication (each rank slices its own copy)."""
    for name, param in list(experts.named_parameters(recurse=False)):
        sharded = distribute_tensor(param.data, mesh, [Shard(0)], src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded, param.requires_grad))
