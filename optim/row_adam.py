"""Row-wise (lazy) Adam for lookup tables read a few rows per step: Engram's n-gram tables
(role `memory`, optim/roles.py).

Only the rows a step's gradient touches are updated, with their moments; untouched rows and their
moments stay as they are (torch.optim.SparseAdam's rule, TensorFlow's LazyAdam). For a row r with
gradient g_r at the optimizer's t-th step (t counts steps of the whole table, as SparseAdam does):
    m_r <- b1 m_r + (1 - b1) g_r      v_r <- b2 v_r + (1 - b2) g_r^2
    w_r <- w_r - lr (m_r / (1 - b1^t)) / (sqrt(v_r) / sqrt(1 - b2^t) + eps)      (no weight decay)
This is torch.optim.Adam's update on the touched rows. A step costs O(rows read x width), not
O(table), when the gradient is sparse (one process: model/engram/layer.py); a dense gradient (FSDP2
reduces dense ones) gives the same update, its touched rows found by a scan.

`RowwiseTables` adds this to an optimizer class: its groups with `algorithm: "row_adam"` are
updated here, every other group by the class's own step.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

ALGORITHM = "row_adam"


def _local(t: Tensor) -> Tensor:
    """A DTensor's local shard (FSDP2 shards tables by rows: the update is row-local)."""
    return t.to_local() if hasattr(t, "to_local") else t


def touched_rows(grad: Tensor) -> tuple[Tensor, Tensor]:
    """(row indices (R,), their summed gradients (R, D)) of a sparse or dense (N, D) gradient.
    Rows whose gradient is exactly zero (read only where every target was ignored) count as
    untouched either way, so the sparse and the dense form give the same update."""
    if grad.is_sparse:
        rows, values = _summed_rows(grad)
        keep = values.ne(0).any(dim=1)
        return rows[keep], values[keep]
    rows = grad.ne(0).any(dim=1).nonzero()[:, 0]
    return rows, grad.index_select(0, rows)


def _summed_rows(grad: Tensor) -> tuple[Tensor, Tensor]:
    """A sparse (N, D) gradient's distinct rows, ascending, and each one's summed values: what
    `grad.coalesce()` gives, 2-3x faster on CPU (65k reads of a 1e7-row table: 4.7 against 11.6
    ms; torch's coalesce works on linearized indices). On other devices torch's coalesce, whose
    sums do not depend on atomics' order."""
    if grad.device.type != "cpu" or grad.is_coalesced():
        grad = grad.coalesce()
        return grad.indices()[0], grad.values()
    indices, values = grad._indices()[0], grad._values()
    rows, slot = torch.unique(indices, sorted=True, return_inverse=True)
    return rows, values.new_zeros(rows.numel(), *values.shape[1:]).index_add_(0, slot, values)


def adam_step_count(state: dict, param: Tensor) -> int:
    """Adam's state of `param` (created at the first step: step, exp_avg, exp_avg_sq, the
    layout torch.optim.AdamW uses), its step counter advanced; returns the new count."""
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(param)
        state["exp_avg_sq"] = torch.zeros_like(param)
    state["step"] += 1
    return int(state["step"].item())


@torch.no_grad()
def row_adam_step(
    param: Tensor, grad: Tensor, state: dict, lr: float, betas: tuple[float, float], eps: float
) -> None:
    """One lazy Adam step of `param` (N, D) on the rows `grad` touches (see the module docstring)."""
    weight, grad = _local(param), _local(grad)
    step = adam_step_count(state, param)
    m_all, v_all = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
    rows, g = touched_rows(grad)
    g = g.to(m_all.dtype)
    beta1, beta2 = betas
    m = m_all.index_select(0, rows).lerp_(g, 1 - beta1)
    v = v_all.index_select(0, rows).mul_(beta2).addcmul_(g, g, value=1 - beta2)
    m_all.index_copy_(0, rows, m)
    v_all.index_copy_(0, rows, v)
    denom = (v.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    update = (m / denom).mul_(-lr / (1 - beta1**step))
    weight.index_add_(0, rows, update.to(weight.dtype))


class RowwiseTables:
    """Optimizer mixin (listed before the optimizer class): `row_adam` groups are stepped here,
    the others by the optimizer's own step (their gradients are hidden from it meanwhile)."""

    param_groups: list[dict]
    state: dict

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        hidden = []
        for group in self.param_groups:
            if group.get("algorithm") != ALGORITHM:
                continue
            if group.get("weight_decay", 0.0):
                raise ValueError(f"group {group.get('name')!r}: row-wise Adam has no weight decay")
            for param in group["params"]:
                if param.grad is None:
                    continue
                row_adam_step(
                    param, param.grad, self.state[param], group["lr"], group["betas"], group["eps"]
                )
                hidden.append((param, param.grad))
                param.grad = None
        try:
            return super().step(closure)  # type: ignore[misc]
        finally:
            for param, grad in hidden:
                param.grad = grad


class AdamWWithTables(RowwiseTables, torch.optim.AdamW):
    """torch.optim.AdamW, with row-wise Adam for the `row_adam` groups."""
