"""Muon for hidden matrices and AdamW for everything else, as one optimizer.

One `torch.optim.Optimizer` with two kinds of parameter groups (`group["algorithm"]`), so the
trainer, the schedule and DCP checkpoints see a single optimizer and a single state dict.

Muon step for a matrix W with gradient G (torch.optim.Muon's formulation, which it matches for
2-D weights): B <- mu B + (1 - mu) G; U = (1 - mu) G + mu B with Nesterov, else B;
O = NS(U) (Newton-Schulz orthogonalization, optim.newton_schulz); W <- W (1 - lr wd) - lr s O,
with s = 0.2 sqrt(max(fan_out, fan_in)) ("match_adamw": the update has AdamW's RMS, so AdamW
learning rates and weight decay transfer, as in Moonlight) or sqrt(max(1, fan_out / fan_in))
("spectral", the original). 3-D expert weights (E, in, out) are orthogonalized per expert.
Weights listed in `blocks` are split first (fused parts, or per head: optim.matrix_blocks).

AdamW step: the decoupled-weight-decay AdamW of torch.optim.AdamW. `row_adam` groups (Engram's
tables): optim.row_adam.

Sharded (FSDP2 DTensor) matrices are orthogonalized whole: see optim.distributed_muon.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import Tensor

from optim.distributed_muon import NS, orthogonalize_all
from optim.matrix_blocks import SCALINGS, MatrixBlocks, orthogonalize_blocks, update_scale
from optim.newton_schulz import WholeMatrix, coefficient_schedule
from optim.row_adam import ALGORITHM as ROW_ADAM
from optim.row_adam import adam_step_count, row_adam_step


def fan_out_in(param: Tensor, layout: str) -> tuple[int, int]:
    """(fan_out, fan_in) of a weight: nn.Linear's (out, in), or an expert stack's (E, in, out)."""
    if layout == "experts":
        return param.shape[-1], param.shape[-2]
    return param.shape[0], param.shape[1]


class Muon(torch.optim.Optimizer):
    """Param groups carry `algorithm` ("muon" or "adamw"). In Muon groups, 2-D weights are
    nn.Linear's (out, in) and 3-D ones expert stacks (E, in, out), for the update scale."""

    def __init__(
        self,
        groups: list[dict],
        *,
        lr: float,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_schedule: str = "quintic",
        scaling: str = "match_adamw",
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        blocks: dict[Tensor, MatrixBlocks] | None = None,
    ) -> None:
        if scaling not in SCALINGS:
            raise ValueError(f"scaling={scaling!r} is not one of {SCALINGS}")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            algorithm="adamw",
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_schedule=ns_schedule,
            scaling=scaling,
            betas=betas,
            eps=eps,
        )
        super().__init__(groups, defaults)
        # keyed by id: a tensor's __eq__ is elementwise; parameters live as long as the optimizer
        self.blocks = {id(param): b for param, b in (blocks or {}).items()}

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["algorithm"] == "muon":
                self._muon(group)
            elif group["algorithm"] == ROW_ADAM:
                self._rows(group)
            else:
                self._adamw(group)
        return loss

    def _muon(self, group: dict) -> None:
        mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        params, updates, kinds = [], [], []
        for param in group["params"]:
            layout = self._layout(param)
            if param.grad is None:
                continue
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param)
            buf = state["momentum_buffer"]
            buf.lerp_(param.grad, 1 - mu)
            updates.append(param.grad.lerp(buf, mu) if group["nesterov"] else buf)
            params.append(param)
            kinds.append(layout)
        ns = [self._newton_schulz(param, group) for param in params]
        for param, layout, ortho in zip(params, kinds, orthogonalize_all(updates, ns)):
            param.mul_(1 - lr * wd)
            scale = update_scale(*fan_out_in(param, layout), group["scaling"])
            param.add_(ortho.to(param.dtype), alpha=-lr * scale)

    @staticmethod
    def _layout(param: Tensor) -> str:
        """Muon groups hold matrices (2-D) and expert stacks (3-D): optim.grouping checks each
        parameter's declared role against its shape."""
        if param.ndim not in (2, 3):
            raise ValueError(
                f"Muon takes matrices or expert stacks, got shape {tuple(param.shape)}"
            )
        return "experts" if param.ndim == 3 else "linear"

    def _newton_schulz(self, param: Tensor, group: dict) -> NS:
        coefficients = coefficient_schedule(group["ns_schedule"], group["ns_steps"])
        blocks = self.blocks.get(id(param))
        if blocks is None:
            return WholeMatrix(tuple(coefficients))  # batched with same-shaped matrices
        return partial(
            orthogonalize_blocks, coefficients=coefficients, blocks=blocks, scaling=group["scaling"]
        )

    def _rows(self, group: dict) -> None:
        for param in group["params"]:
            if param.grad is not None:
                state = self.state[param]
                row_adam_step(param, param.grad, state, group["lr"], group["betas"], group["eps"])

    def _adamw(self, group: dict) -> None:
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            step = adam_step_count(state, param)
            grad, m, v = param.grad, state["exp_avg"], state["exp_avg_sq"]
            param.mul_(1 - lr * wd)
            m.lerp_(grad, 1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (v.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
            param.addcdiv_(m, denom, value=-lr / (1 - beta1**step))
