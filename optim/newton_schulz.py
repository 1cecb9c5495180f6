"""Orthogonalization by the Newton-Schulz iteration: G = U S V^T -> approximately U V^T.

Each step maps X -> a X + b (X X^T) X + c (X X^T)^2 X, applied to the singular values as
p(s) = a s + b s^3 + c s^5. The quintic (3.4445, -4.7750, 2.0315) of Keller Jordan's Muon pushes
every singular value of a Frobenius-normalized matrix into roughly [0.68, 1.13] in 5 steps (it
trades exact convergence for speed). A schedule gives each step its own triple (Polar Express).

Shapes: (..., m, n), batched over leading dims (experts); computed on the wide side (m <= n,
transposing tall matrices) so the Gram matrix X X^T is the smaller one; in bf16 where the device
multiplies bf16 natively, else in fp32 (`iteration_dtype`); the result is bf16 either way.
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

QUINTIC = (3.4445, -4.7750, 2.0315)
# Polar Express (Amsel et al., 2025): per-step minimax-optimal quintics for an initial singular
# value range [1e-3, 1]; each divided by a 1.01 safety factor (a/1.01, b/1.01^3, c/1.01^5) so
# bf16 rounding cannot push values past the range the next step expects
_POLAR_EXPRESS_RAW = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
)
POLAR_EXPRESS = tuple((a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in _POLAR_EXPRESS_RAW)
SCHEDULES = {"quintic": None, "polar_express": POLAR_EXPRESS}


def coefficient_schedule(name: str, steps: int) -> list[tuple[float, float, float]]:
    """Per-step (a, b, c): the quintic repeated, or a published schedule (its last triple
    repeated when more steps are asked for)."""
    table = SCHEDULES[name]
    if table is None:
        return [QUINTIC] * steps
    return [table[min(i, len(table) - 1)] for i in range(steps)]


def iteration_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA and on CPUs with bf16 instructions; fp32 on other CPUs, where bf16 matmuls
    fall back to scalar code (78x slower than fp32 on an AVX2 AMD EPYC). The same CPU test as
    parallel.precision.cpu_has_bf16 (optim imports nothing of ours)."""
    if device.type != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if _cpu_has_bf16() else torch.float32


@functools.cache
def _cpu_has_bf16() -> bool:
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    if machine in ("aarch64", "arm64") and Path("/proc/cpuinfo").exists():
        return "bf16" in Path("/proc/cpuinfo").read_text().split()
    return False


def orthogonalize(
    g: Tensor, coefficients: Sequence[tuple[float, float, float]], eps: float = 1e-7
) -> Tensor:
    """(..., m, n) -> bf16 (..., m, n) with singular values pushed towards 1 (same U and V),
    iterated in `iteration_dtype` from g rounded to bf16 (as on GPUs, and as sharded Muon
    gathers it: the same input on every machine and path)."""
    x = g.bfloat16().to(iteration_dtype(g.device))
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    lead = x.shape[:-2]
    x = x.reshape(-1, *x.shape[-2:])  # (batch, m, n), m <= n
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm <= 1
    for a, b, c in coefficients:
        gram = x @ x.mT  # (batch, m, m)
        update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2
        x = torch.baddbmm(x, update, x, beta=a)  # a X + (b G + c G^2) X
    x = x.reshape(*lead, *x.shape[-2:]).bfloat16()
    return x.mT if tall else x


# at most this many elements (128 MiB in bf16) of same-shaped matrices go through one batched
# iteration: enough to fill the GEMMs of small models, bounded for large ones
BATCH_ELEMENTS = 1 << 26


@dataclass(frozen=True)
class WholeMatrix:
    """Newton-Schulz of a whole matrix, or of each matrix of a stack (..., m, n). Updates with
    equal WholeMatrix and matrix shape may be stacked into one batch (orthogonalize_many)."""

    coefficients: tuple[tuple[float, float, float], ...]

    def __call__(self, g: Tensor) -> Tensor:
        return orthogonalize(g, self.coefficients)


def orthogonalize_many(updates: list[Tensor], ns: list[Callable[[Tensor], Tensor]]) -> list[Tensor]:
    """ns[i](updates[i]) for each i. Updates whose ns is the same WholeMatrix and whose
    matrices have the same (m, n) are stacked (expert stacks contribute each expert) and
    orthogonalized in batches of up to BATCH_ELEMENTS: one batched matmul per iteration step
    instead of one per matrix. Each matrix's result is the one it gets alone (bitwise on CPU)."""
    out: list[Tensor | None] = [None] * len(updates)
    same: dict[tuple, list[int]] = {}
    for i, (u, f) in enumerate(zip(updates, ns)):
        if isinstance(f, WholeMatrix) and u.ndim >= 2:
            same.setdefault((f, tuple(u.shape[-2:]), u.device), []).append(i)
        else:
            out[i] = f(u)
    for (f, (m, n), _), indices in same.items():
        for chunk in _batches(indices, [updates[i].numel() for i in indices]):
            pieces = [updates[i].bfloat16().reshape(-1, m, n) for i in chunk]
            stacked = pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # no copy of one
            results = f(stacked).split([updates[i].numel() // (m * n) for i in chunk])
            for i, result in zip(chunk, results):
                out[i] = result.reshape(updates[i].shape)
    return out  # type: ignore[return-value]


def _batches(indices: list[int], sizes: list[int]) -> list[list[int]]:
    """Consecutive runs of indices whose sizes add up to at most BATCH_ELEMENTS (a larger
    single update is a batch of its own)."""
    batches: list[list[int]] = []
    total = 0
    for i, size in zip(indices, sizes):
        if not batches or total + size > BATCH_ELEMENTS:
            batches.append([])
            total = 0
        batches[-1].append(i)
        total += size
    return batches
