"""Our stacked expert weights over a checkpoint's per-expert matrices, built on demand.

Checkpoints store one (out, in) matrix per expert (`experts.{j}.up_proj.weight`); our MoE layer
holds one (E, in, out) stack. Stacking a layer's experts copies all of them; under expert
parallelism and FSDP each rank keeps a few experts (and rows), so a streamed import hands the
consumer an `ExpertStack` instead: indexing it with slices stacks only the experts (and the rows
of them) asked for, and of a memory-mapped checkpoint only those are read. `parallel.init`
cuts every source with slices, so a stack and a tensor are alike to it; `materialize` gives the
whole tensor where one is needed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.config import ConfigError


class ExpertStack:
    """(E, in, out): expert j is `matrices[j].T`."""

    def __init__(self, matrices: list[Tensor], where: str = "") -> None:
        self.matrices = matrices
        out_features, in_features = matrices[0].shape
        self.shape = torch.Size((len(matrices), in_features, out_features))
        self.dtype = matrices[0].dtype
        for j, matrix in enumerate(matrices):  # (metadata only: every rank refuses alike)
            if matrix.shape != matrices[0].shape or matrix.dtype != self.dtype:
                raise ConfigError(
                    f"{where}expert {j} holds {tuple(matrix.shape)} {matrix.dtype}, expert 0 "
                    f"{tuple(matrices[0].shape)} {self.dtype}"
                )

    def __getitem__(self, index: tuple[slice | Tensor, ...]) -> Tensor:
        """The stack's piece at `index` (a slice per leading dim; the first may also be the
        experts' indices), stacked from its experts."""
        first, *rest = index
        if isinstance(first, slice):
            experts = range(len(self.matrices))[first]
        else:
            experts = [int(j) for j in first]
        if len(experts) == 0:  # a rank with no expert of this layer (more shards than experts)
            shape = torch.empty(self.shape[1:], device="meta")[tuple(rest)].shape
            return torch.empty((0, *shape), dtype=self.dtype)
        return torch.stack([self.matrices[j].T[tuple(rest)] for j in experts])

    def detach(self) -> ExpertStack:
        return self

    def materialize(self) -> Tensor:
        return self[(slice(None),)]


def materialize(tensor: Tensor | ExpertStack) -> Tensor:
    return tensor.materialize() if isinstance(tensor, ExpertStack) else tensor
