"""Engram's tables under DeepSpeed: kept out of ZeRO, held whole by every rank.

ZeRO flattens the weights it manages into partitions, on which the row-wise Adam of the tables
(optim/row_adam.py: the rows a step read, with their moments) cannot work, and ZeRO-3 partitions
every registered weight. So before `deepspeed.initialize` the engine takes the tables out of
DeepSpeed's sight (`HiddenTables`):

- each `EngramTable` stays its layer's attribute, which the forward reads as before, but is no
  longer a registered submodule: DeepSpeed neither partitions, casts, broadcasts, reduces,
  clips, optimizes nor saves it;
- every rank holds the tables whole (`model.engram.sharding=replicated`: FSDP2's replicated
  mode) and averages each step's sparse row gradients over the ranks (parallel/sparse_sync.py:
  traffic O(rows read), not O(table));
- the tables get the trainer's optimizer of their own (its row-wise Adam groups, role `memory`),
  stepped after DeepSpeed's; the loop's lr schedule reaches both (`AllGroups`);
- clipping keeps one global norm, as under FSDP2: the tables' gradient norm joins DeepSpeed's
  (its norm method wrapped, `include_in_norm`), and the tables' gradients take DeepSpeed's
  clipping factor;
- checkpoints: the tables' weights and row-wise Adam states in `<step dir>/deepspeed/` (written
  by rank 0, as every rank holds the same), read back by every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from model.roles import MEMORY, role_owners
from parallel.sparse_sync import average_sparse_gradients

TABLES = "lmforge_tables.pt"  # beside DeepSpeed's files in <step dir>/deepspeed/


def tables_only_optimizer(
    model: nn.Module, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
) -> torch.optim.Optimizer:
    """The trainer's optimizer built over the model with only the Engram tables trainable: its
    row-wise Adam groups (role `memory`), with the lrs and schedule keys of a whole-model one."""
    tables = {id(p) for m in role_owners(model, MEMORY) for p in m.parameters(recurse=False)}
    frozen = [p for p in model.parameters() if id(p) not in tables and p.requires_grad]
    for param in frozen:
        param.requires_grad_(False)
    try:
        return make_optimizer(model)
    finally:
        for param in frozen:
            param.requires_grad_(True)


class HiddenTables:
    """The Engram tables of `model`, detached from its module tree, with their own gradient
    averaging, clipping, row-wise Adam (`optimizer`: the trainer's optimizer over the tables
    alone, `tables_only_optimizer`) and checkpoint file (see the module docstring)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.modules: dict[str, nn.Module] = {}  # "layers.1.engram.table" -> its table
        owners = {id(table) for table in role_owners(model, MEMORY)}  # role `memory`: Engram's
        for path, module in list(model.named_modules()):
            for name, child in list(module._modules.items()):
                if id(child) in owners:
                    del module._modules[name]
                    object.__setattr__(module, name, child)  # module.<name> still finds it
                    self.modules[f"{path}.{name}" if path else name] = child
        weights = {id(t.weight) for t in self.modules.values()}
        if {id(p) for g in optimizer.param_groups for p in g["params"]} != weights:
            raise ValueError("the tables' optimizer does not hold exactly the Engram tables")
        self.optimizer = optimizer

    def named_weights(self) -> dict[str, nn.Parameter]:
        return {f"{path}.weight": table.weight for path, table in self.modules.items()}

    def average_gradients(self) -> None:
        """Each table's gradient averaged over the ranks (all hold the tables whole)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        weights = list(self.named_weights().values())
        sparse = [w for w in weights if w.grad is None or w.grad.is_sparse]
        average_sparse_gradients(sparse)  # (a rank whose tokens read no row sends none)
        for weight in weights:
            if weight.grad is not None and not weight.grad.is_sparse:  # sparse_grad=false
                dist.all_reduce(weight.grad)
                weight.grad /= dist.get_world_size()

    def square_norm(self) -> Tensor:
        """The sum of squares of the tables' (averaged, identical) gradients, fp32."""
        total = torch.zeros((), dtype=torch.float32)
        for weight in self.named_weights().values():
            if weight.grad is not None:
                grad = weight.grad.coalesce() if weight.grad.is_sparse else weight.grad
                weight.grad = grad
                values = grad.values() if grad.is_sparse else grad
                total = total + values.float().square().sum().cpu()
        return total

    @torch.no_grad()
    def clip(self, total_norm: float, max_norm: float) -> None:
        """DeepSpeed's clipping of its own gradients, applied to the tables': divided by
        (norm + 1e-6) / max_norm when that exceeds 1 (ZeRO 1-3's unscale_and_clip_grads)."""
        factor = (total_norm + 1e-6) / max_norm if max_norm > 0 else 1.0
        if factor > 1.0:
            for weight in self.named_weights().values():
                if weight.grad is not None:
                    weight.grad.mul_(1.0 / factor)

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        for weight in self.named_weights().values():
            weight.grad = None

    def write(self, folder: Path) -> None:
        """The tables' weights and row-wise Adam states (rank 0: every rank holds the same)."""
        state = {
            "weights": {name: w.detach().cpu() for name, w in self.named_weights().items()},
            "optimizer": self.optimizer.state_dict(),
        }
        torch.save(state, folder / TABLES)

    def read(self, folder: Path) -> None:
        path = folder / TABLES
        if not path.is_file():
            raise FileNotFoundError(f"{folder} has no {TABLES}: the Engram tables' state")
        state = torch.load(path, map_location="cpu", weights_only=True)
        with torch.no_grad():
            for name, weight in self.named_weights().items():
                weight.copy_(state["weights"][name])
        self.optimizer.load_state_dict(state["optimizer"])


def table_weights(folder: Path) -> dict[str, Tensor]:
    """The whole table weights a DeepSpeed checkpoint folder holds beside its own files ({}
    without Engram)."""
    path = folder / TABLES
    if not path.is_file():
        return {}
    return torch.load(path, map_location="cpu", weights_only=True)["weights"]


def include_in_norm(optimizer: Any, square: Callable[[], Tensor]) -> None:
    """DeepSpeed's ZeRO optimizer computes its global gradient norm, clips by it and reports it
    with the tables' norm (`square()`: their sum of squares) included: ZeRO-1/2's
    `scaled_global_norm` returns sqrt(its^2 + tables'), ZeRO-3's `_get_norm_groups` gets one
    more group. (Per instance; loss scaling is 1 in fp32 and bf16, the only precisions here.)"""
    if hasattr(optimizer, "scaled_global_norm"):
        own = optimizer.scaled_global_norm

        def scaled_global_norm(norm_type: int = 2) -> Tensor:
            norm = own(norm_type)
            return (norm.square() + square().to(norm.device, norm.dtype)).sqrt()

        optimizer.scaled_global_norm = scaled_global_norm
    elif hasattr(optimizer, "_get_norm_groups"):
        groups = optimizer._get_norm_groups

        def norm_groups() -> list:
            own = groups()
            device = next((n.device for n in own if torch.is_tensor(n)), None)
            return [*own, square().sqrt().to(device)]

        optimizer._get_norm_groups = norm_groups
    else:
        raise TypeError(f"{type(optimizer).__name__}: no gradient norm to add the tables' to")


class AllGroups:
    """The engine's `optimizer` for the loop (lr schedule, config on resume): the parameter
    groups of DeepSpeed's optimizer and of the tables' row-wise Adam, in that order."""

    def __init__(self, *optimizers: Any):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]
