"""Which matrices Muon orthogonalizes: a stored weight may hold several logical matrices.

A fused projection (MLA's kv_a = [latent | rope key], kv_b = per head [k_nope | v]) is split
into its parts before Newton-Schulz, and with `optim.muon_split=heads` every attention head's
slice is its own matrix too. Attention modules describe their weights through the hook
`muon_matrix_blocks()`: weight name -> (dim, heads, parts), meaning dimension `dim` of the
weight (0: output rows, 1: input columns) is laid out as (heads, sum(parts)).

Modes (`optim.muon_split`): none (every weight whole), fused (split fused parts; heads stay
together), heads (every (head, part) slice alone). Each block gets the update scale of its own
shape, so split blocks keep the update RMS that the scaling rule promises.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from optim.errors import OptimConfigError
from optim.newton_schulz import orthogonalize

SPLIT_MODES = ("none", "fused", "heads")
SCALINGS = ("match_adamw", "spectral")  # Muon's update scale rules (update_scale)
Coefficients = list[tuple[float, float, float]]


def update_scale(fan_out: int, fan_in: int, scaling: str) -> float:
    """Muon's update multiplier: 0.2 sqrt(max fan) ("match_adamw", AdamW's update RMS) or
    sqrt(max(1, fan_out / fan_in)) ("spectral")."""
    if scaling == "match_adamw":
        return 0.2 * math.sqrt(max(fan_out, fan_in))
    return math.sqrt(max(1.0, fan_out / fan_in))


@dataclass(frozen=True)
class MatrixBlocks:
    dim: int  # 0: the blocks are groups of rows (output features); 1: of columns (inputs)
    heads: int  # `dim` is laid out as (heads, sum(parts))
    parts: tuple[int, ...]  # each head's logical parts, e.g. MLA's kv_b: (k_nope, v)
    per_head: bool  # True: every (head, part) alone; False: each part across all heads

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        if (
            len(shape) != 2
            or self.dim not in (0, 1)
            or self.heads * sum(self.parts) != shape[self.dim]
        ):
            raise OptimConfigError(
                f"{name}: muon_matrix_blocks says dim {self.dim} is {self.heads} heads x "
                f"{self.parts}, but the weight's shape is {tuple(shape)}"
            )


def matrix_blocks(model: nn.Module, mode: str) -> dict[str, MatrixBlocks]:
    """Parameter name -> its blocks, from the modules' `muon_matrix_blocks` hooks. Weights with
    one part per head are whole in "fused" mode and absent from the result."""
    if mode not in SPLIT_MODES:
        raise OptimConfigError(f"optim.muon_split={mode!r} is not one of {SPLIT_MODES}")
    if mode == "none":
        return {}
    params = dict(model.named_parameters())
    found: dict[str, MatrixBlocks] = {}
    for prefix, module in model.named_modules():
        hook = getattr(module, "muon_matrix_blocks", None)
        if hook is None:
            continue
        for local, (dim, heads, parts) in hook().items():
            if mode == "fused" and len(parts) == 1:
                continue
            name = f"{prefix}.{local}" if prefix else local
            blocks = MatrixBlocks(dim, heads, tuple(parts), per_head=mode == "heads")
            blocks.check(name, tuple(params[name].shape))
            found[name] = blocks
    return found


def orthogonalize_blocks(
    matrix: Tensor, coefficients: Coefficients, blocks: MatrixBlocks, scaling: str
) -> Tensor:
    """NS of each block of the (fan_out, fan_in) `matrix`, reassembled in its layout (bf16).
    A block whose update scale differs from the whole matrix's is multiplied by the ratio, so
    the caller applies the whole matrix's scale to every weight alike."""
    x = matrix if blocks.dim == 0 else matrix.mT  # (rows, cols); the split runs over rows
    rows, cols = x.shape
    whole = update_scale(*matrix.shape, scaling)
    grouped = x.reshape(blocks.heads, sum(blocks.parts), cols)
    outputs = []
    for part in grouped.split(list(blocks.parts), dim=1):  # (heads, p, cols)
        if blocks.per_head:
            ortho = orthogonalize(part, coefficients)  # batched: one matrix per head
            block_rows = part.shape[1]
        else:
            ortho = orthogonalize(part.reshape(-1, cols), coefficients).view(part.shape)
            block_rows = part.shape[0] * part.shape[1]
        shape = (block_rows, cols) if blocks.dim == 0 else (cols, block_rows)
        ratio = update_scale(*shape, scaling) / whole
        outputs.append(ortho if ratio == 1.0 else ortho * ratio)
    y = torch.cat(outputs, dim=1).reshape(rows, cols)
    return (y if blocks.dim == 0 else y.mT).contiguous()
