"""Expert parallelism under DeepSpeed (`parallel.ep > 1`, `parallel.engine=deepspeed`, ZeRO 1-2).

The tokens travel as under FSDP2: each rank routes its own, and the MoE layers' all-to-all
dispatch (parallel.expert_parallel.AllToAllDispatch) runs over DeepSpeed's expert-parallel
group. DeepSpeed builds that group and the expert-data-parallel one with the same ranks as the
FSDP2 layout (`ep` consecutive ranks share tokens, ep innermost; rank r keeps experts
[(r mod ep) E/ep, (r mod ep + 1) E/ep)):

    world 4, ep 2:   expert-parallel groups [0, 1], [2, 3]   expert-data groups [0, 2], [1, 3]

Each expert weight is a plain tensor of this rank's experts, tagged the way DeepSpeed marks its
own experts (`allreduce = False`, `group_name = "ep_size_<ep>"`), in optimizer groups of their
own (`moe: True`, `name`: the expert group), so ZeRO partitions and reduces them over the
expert-data group only. Their gradients already sum every rank's tokens (the all-to-all's
backward); ZeRO divides every gradient by the whole data-parallel world before reducing, so the
expert gradients have the FSDP2 engine's scale (DeepSpeed #5618, fixed in #5681).

DeepSpeed turns this handling on only for its own MoE classes (`isinstance(module, MoE)` sets
`has_moe_layers` in `DeepSpeedEngine._configure_distributed_model`); `declared_expert_layers`
sets it around `deepspeed.initialize` for this framework's MoE layers instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallel.expert_parallel import AllToAllDispatch, expert_layers


def expert_group_name(ep: int) -> str:
    """DeepSpeed's name for the groups of an expert-parallel degree."""
    return f"ep_size_{ep}"


def expert_parallel_problems(zero_stage: int, offload_optimizer: str) -> list[str]:
    """Why DeepSpeed cannot run this framework's expert parallelism with these settings."""
    problems = []
    if zero_stage not in (1, 2):
        problems.append(
            f"parallel.ep > 1 with parallel.deepspeed.zero_stage={zero_stage}: DeepSpeed runs "
            "expert parallelism with ZeRO 1-2 (stage 3 only for its AutoEP layers; stage 0 writes "
            "expert weights only for its own MoE class): use zero_stage 1 or 2, or "
            "parallel.engine=fsdp2"
        )
    if offload_optimizer != "none":
        problems.append(
            "parallel.ep > 1 with parallel.deepspeed.offload_optimizer: not supported yet "
            "(DeepSpeed's CPU Adam regroups the parameters itself): set offload_optimizer=none"
        )
    return problems


def localize_experts(model: nn.Module, ep: int) -> str:
    """Keep this rank's experts of every MoE layer (the whole model was built on every rank),
    tag them as DeepSpeed's expert parameters and install the all-to-all over DeepSpeed's
    expert-parallel group, created here (collective). Returns the expert group's name."""
    from deepspeed.utils import groups

    name = expert_group_name(ep)
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep)
    group = groups._get_expert_parallel_group(name)
    rank = dist.get_rank(group)
    for moe in expert_layers(model):
        local = moe.n_experts // ep
        for param in moe.experts.parameters(recurse=False):
            param.data = param.data[rank * local : (rank + 1) * local].clone()
            param.allreduce = False  # DeepSpeed's mark of an expert weight
            param.group_name = name
        moe.dispatch = AllToAllDispatch(group)
    return name


def local_expert_weights(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """`state` (whole weights by name) with each expert weight cut to this rank's experts (the
    shapes of the localized model's parameters)."""
    local = dict(state)
    for name, param in model.named_parameters():
        if getattr(param, "allreduce", True) is False and state[name].shape != param.shape:
            rows = param.shape[0]
            rank = dist.get_rank(_expert_group(param.group_name))
            local[name] = state[name][rank * rows : (rank + 1) * rows]
    return local


def _expert_group(name: str):
    from deepspeed.utils import groups

    return groups._get_expert_parallel_group(name)


def split_expert_groups(optimizer: torch.optim.Optimizer) -> None:
    """Move the expert weights of each optimizer group into a group of their own with the same
    settings, marked as DeepSpeed wants it (`moe: True`, `name`: the expert group's name); groups
    left empty are dropped. In place, before DeepSpeed wraps the optimizer (no state yet)."""
    groups: list[dict] = []
    experts: list[dict] = []
    for group in optimizer.param_groups:
        expert = [p for p in group["params"] if getattr(p, "allreduce", True) is False]
        dense = [p for p in group["params"] if getattr(p, "allreduce", True) is not False]
        settings = {key: value for key, value in group.items() if key != "params"}
        if dense:
            groups.append(settings | {"params": dense})
        by_name: dict[str, list] = {}
        for param in expert:
            by_name.setdefault(param.group_name, []).append(param)
        for name, params in by_name.items():
            experts.append(settings | {"params": params, "moe": True, "name": name})
    optimizer.param_groups[:] = groups + experts


@contextmanager
def declared_expert_layers(num_experts: list[int]) -> Iterator[None]:
    """DeepSpeed engines built inside see expert layers (`has_moe_layers`, `num_experts`: the
    routed experts of each MoE layer), as its own MoE class would declare them."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine._configure_distributed_model

    def configure(self, model):
        original(self, model)
        self.has_moe_layers = True
        self.num_experts = list(num_experts)

    DeepSpeedEngine._configure_distributed_model = configure
    try:
        yield
    finally:
        DeepSpeedEngine._configure_distributed_model = original
