"""Routed experts as stacked weights, each projection computed for all experts at once.

Shapes: M token slots sorted by expert, C d_model, F expert hidden, E experts (local ones under
expert parallelism: the weights are then DTensors sharded on dim 0 and `_local` takes this rank's
experts).

    w_gate, w_up (E, C, F);  w_down (E, F, C)
    y[rows of e] = (act(x W_gate[e]) * (x W_up[e])) W_down[e]

Three ways to compute the same thing (`impl`; "auto" chooses):
  grouped_mm  `torch._grouped_mm`, all experts in one call, where the device and dtype support it
              (probed once per device type and dtype) and rows are 16-byte aligned (C and F
              multiples of 16 / element size). The GPU path: no host sync.
  padded_bmm  each expert's rows padded with zeros to the largest count, then `torch.bmm` over
              (E, max count, C). On CPU, oneDNN's batched GEMM runs several times faster than
              per-group GEMMs (bench/moe_layer.py), so "auto" takes it there while the padding adds
              at most PAD_LIMIT x the real rows.
  loop        a Python loop of per-expert matmuls: the fallback.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor, nn

from model import roles
from model.init import InitStds, trunc_normal_

IMPLS = ("auto", "grouped_mm", "padded_bmm", "loop")
PAD_LIMIT = 2.0  # padded_bmm when E x max count <= PAD_LIMIT x M (CPU only)


def _local(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor (the local experts); a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def _dense_grad(grad: Tensor) -> Tensor:
    """The grouped GEMM's backward rejects expanded gradients (e.g. from `.sum()`, strides
    [0, 0]), even empty ones (which count as contiguous): give it a dense one."""
    if grad.numel() == 0:
        return torch.zeros_like(grad, memory_format=torch.contiguous_format)
    return grad.contiguous()


@functools.cache
@torch.compiler.disable
def grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs forward and backward here, including an empty group."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        with (
            torch.enable_grad(),
            torch.autocast(device_type, enabled=False),
            torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
        ):
            x = torch.ones(8, 16, device=device_type, dtype=dtype, requires_grad=True)
            w = torch.ones(3, 16, 16, device=device_type, dtype=dtype, requires_grad=True)
            offs = torch.tensor([3, 3, 8], device=device_type, dtype=torch.int32)
            y = torch._grouped_mm(x, w, offs=offs)
            gx, gw = torch.autograd.grad(y, (x, w), torch.ones_like(y))
        return bool(y[0, 0].item() == 16 and gw[1].abs().sum().item() == 0 and gx.shape == x.shape)
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _aligned(*tensors: Tensor) -> bool:
    return all(
        t.is_contiguous() and t.data_ptr() % 16 == 0 and t.shape[-1] * t.element_size() % 16 == 0
        for t in tensors
    )


def grouped_mm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """x (M, K) sorted by group, w (G, K, N), offsets (G,) int32 cumulative counts -> (M, N)."""
    y = torch._grouped_mm(x, w, offs=offsets)
    if y.requires_grad:  # a gradient hook, not an identity Function: the output is no view
        y.register_hook(_dense_grad)
    return y


def padded_rows(counts: Tensor, n_rows: int, capacity: int) -> Tensor:
    """(M,) the row of each sorted row in the zero-padded (E x capacity) layout."""
    E = counts.numel()
    starts = counts.cumsum(0) - counts
    expert = torch.repeat_interleave(
        torch.arange(E, device=counts.device), counts, output_size=n_rows
    )
    return expert * capacity + torch.arange(n_rows, device=counts.device) - starts[expert]


def looped_mm(x: Tensor, w: Tensor, counts: list[int]) -> Tensor:
    """The same as grouped_mm with a Python loop (unbind: one gradient stack, not E full-size adds)."""
    chunks = torch.split(x, counts)
    return torch.cat([chunk @ w_e for chunk, w_e in zip(chunks, w.unbind(0))])


class GroupedExperts(nn.Module):
    def __init__(
        self, n_experts: int, d_model: int, hidden: int, activation: Callable[[Tensor], Tensor]
    ) -> None:
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        self.w_up = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        self.w_down = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.activation = activation
        self.impl = "auto"  # auto | grouped_mm | padded_bmm | loop (tests and benchmarks force one)

    def param_roles(self) -> dict[str, str]:
        return dict.fromkeys(("w_gate", "w_up", "w_down"), roles.EXPERT_STACK)

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """x (M, C) grouped by expert in ascending order, counts (E_local,) int64 -> (M, C).

        Computes in the autocast dtype when autocast is on (grouped GEMMs are not autocast ops),
        else in x's dtype."""
        w_gate, w_up, w_down = (_local(w) for w in (self.w_gate, self.w_up, self.w_down))
        if len(counts) != w_gate.shape[0]:
            raise ValueError(f"{len(counts)} expert counts for {w_gate.shape[0]} local experts")
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        x = x.to(dtype).contiguous()
        w_gate, w_up, w_down = (w.to(dtype) for w in (w_gate, w_up, w_down))
        impl = self._choose(x, counts, w_gate, w_down)
        if impl == "padded_bmm":
            return self._padded_bmm(x, counts, w_gate, w_up, w_down)
        if impl == "grouped_mm":
            mm = functools.partial(grouped_mm, offsets=counts.cumsum(0).to(torch.int32))
        else:
            mm = functools.partial(looped_mm, counts=counts.tolist())
        h = self.activation(mm(x, w_gate)) * mm(x, w_up)  # (M, F)
        return mm(h, w_down)

    def _padded_bmm(
        self, x: Tensor, counts: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor
    ) -> Tensor:
        E, (M, C) = counts.numel(), x.shape
        capacity = int(counts.max()) if M else 0
        rows = padded_rows(counts, M, capacity)  # (M,)
        padded = x.new_zeros(E * capacity, C).index_copy_(0, rows, x).view(E, capacity, C)
        h = self.activation(torch.bmm(padded, w_gate)) * torch.bmm(padded, w_up)  # (E, cap, F)
        return torch.bmm(h, w_down).view(E * capacity, C).index_select(0, rows)

    def _choose(self, x: Tensor, counts: Tensor, w_in: Tensor, w_out: Tensor) -> str:
        if self.impl not in IMPLS:
            raise ValueError(
                f"GroupedExperts.impl={self.impl!r}; choose one of: {', '.join(IMPLS)}"
            )
        if self.impl != "auto":
            return self.impl
        if x.device.type == "cpu" and counts.numel() * int(counts.max()) <= PAD_LIMIT * x.shape[0]:
            return "padded_bmm"
        if grouped_mm_supported(x.device.type, x.dtype) and _aligned(x, w_in, w_out):
            return "grouped_mm"
        return "loop"

    def init_weights(self, stds: InitStds) -> None:
        trunc_normal_(self.w_gate, stds.value)
        trunc_normal_(self.w_up, stds.value)
        trunc_normal_(self.w_down, stds.out)
