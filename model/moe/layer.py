"""The MoE FFN: router -> sort token slots by expert -> dispatch to experts -> weighted combine,
plus the always-active shared experts.

Shapes: B batch, T time, N = B T tokens, C d_model, E routed experts, k top_k, M = N k token slots
(fewer when capacity dropping removes some). Slot s is token s // k's (s % k)-th choice.

    x (B, T, C) -> flat (N, C) -> routing: topk_idx, topk_weight (N, k)
    order     = stable argsort of topk_idx.flatten()      slots grouped by expert, tokens in order
    counts    = bincount over all E experts               (E,) int64
    y_sorted  = dispatch(flat[order // k], counts, experts)   (M, C)
    out[t]    = sum_j weight[t, j] y[slot t k + j]  + shared(flat)[t]   (x sigmoid(w_s . x_t)
                                                        with moe.shared_expert_gate, Qwen3-Next)

`dispatch` is the only place routed tokens meet the experts: the default runs the local experts;
expert parallelism replaces `moe.dispatch` with an all-to-all version (same signature, global
expert ids). The output dtype is that of a dense FFN: the autocast dtype under autocast, else x's.

Statistics (only in forwards with grad enabled, never in activation-checkpoint recomputation):
tokens_per_expert and dropped_tokens accumulate until `model.moe.reset_moe_stats`; the configured
balance losses (coefficient-weighted, in the autograd graph) are kept for `model.moe.pop_aux_loss`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from model import roles
from model.config import ModelConfig
from model.init import InitStds, init_linear
from model.moe.buffers import Fp32Buffers
from model.moe.experts import GroupedExperts
from model.moe.losses import router_z_loss, sequence_balance_loss, switch_balance_loss
from model.moe.router import Router, Routing
from model.registry import FFNS

Dispatch = Callable[[Tensor, Tensor, GroupedExperts], Tensor]
# balance losses by config name (aux_loss_coef, ...): (routing, batch size) -> unweighted scalar
LOSSES: dict[str, Callable[[Routing, int], Tensor]] = {
    "aux_loss": lambda r, batch: switch_balance_loss(r.scores, r.topk_idx),
    "seq_aux_loss": lambda r, batch: sequence_balance_loss(r.scores, r.topk_idx, batch),
    "z_loss": lambda r, batch: router_z_loss(r.logits),
}


def local_dispatch(x_sorted: Tensor, counts: Tensor, experts: GroupedExperts) -> Tensor:
    """x_sorted (M, C) grouped by expert, counts (E,) -> (M, C): every expert is local."""
    return experts(x_sorted, counts)


def in_recompute() -> bool:
    """True while autograd runs a backward pass, i.e. when a forward is a checkpoint recompute."""
    return torch._C._current_graph_task_id() != -1


def _inverse(order: Tensor, n_slots: int) -> Tensor:
    """(N k,) the sorted row that holds each slot, or M (one past the rows) for a dropped slot."""
    M = order.numel()
    inverse = torch.full((n_slots,), M, dtype=order.dtype, device=order.device)
    inverse[order] = torch.arange(M, device=order.device)
    return inverse


def _rows_or_zero(t: Tensor, index: Tensor) -> Tensor:
    """t[index] where index == len(t) reads a zero row."""
    if index.numel() > t.shape[0]:  # more slots than rows: some slots were dropped
        t = torch.cat([t, t.new_zeros(1, t.shape[1])])
    return t.index_select(0, index)


class _SortTokens(torch.autograd.Function):
    """flat (N, C) -> its rows in sorted slot order (M, C). Backward: each slot's row gradient is
    gathered back to slot order and summed over the token's k slots (no scatter-add: faster on
    CPU and deterministic on GPU)."""

    @staticmethod
    def forward(ctx, flat: Tensor, order: Tensor, inverse: Tensor, k: int) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(inverse)
        ctx.k = k
        return flat.index_select(0, order // k)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        (inverse,) = ctx.saved_tensors
        per_slot = _rows_or_zero(grad.contiguous(), inverse)  # (N k, C)
        return per_slot.view(-1, ctx.k, grad.shape[1]).sum(dim=1), None, None, None


class _Combine(torch.autograd.Function):
    """y_sorted (M, C) -> (N, C): each token's k slot rows summed (dropped slots add nothing).
    Forward gathers the rows back to slot order; backward gathers each row's token gradient."""

    @staticmethod
    def forward(ctx, y_sorted: Tensor, order: Tensor, inverse: Tensor, k: int) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(order)
        ctx.k = k
        slots = _rows_or_zero(y_sorted, inverse)  # (N k, C)
        return slots.view(-1, k, y_sorted.shape[1]).sum(dim=1)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        (order,) = ctx.saved_tensors
        return grad.index_select(0, order // ctx.k), None, None, None


class MoE(Fp32Buffers):
    fp32_buffers = ("tokens_per_expert", "dropped_tokens")

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        moe = cfg.moe
        self.cfg = moe
        self.layer_id = layer_id
        self.n_experts, self.top_k = moe.n_routed_experts, moe.top_k
        self.router = Router(cfg.d_model, moe)
        activation = FFNS.get(cfg.ffn.kind).activation
        self.experts = GroupedExperts(self.n_experts, cfg.d_model, cfg.expert_hidden, activation)
        self.shared = (
            FFNS.get(cfg.ffn.kind)(cfg.d_model, cfg.shared_hidden) if moe.n_shared_experts else None
        )
        gated = self.shared is not None and moe.shared_expert_gate
        self.shared_gate = nn.Linear(cfg.d_model, 1, bias=False) if gated else None
        self.dispatch: Dispatch = local_dispatch
        self.register_buffer(
            "tokens_per_expert", torch.zeros(self.n_experts, dtype=torch.float32), persistent=False
        )
        self.register_buffer(
            "dropped_tokens", torch.zeros((), dtype=torch.float32), persistent=False
        )
        self._aux_losses: list[Tensor] = []  # weighted balance losses since the last pop
        self.last_losses: dict[str, Tensor] = {}  # detached, from the last training forward

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        device = x.device.type
        out_dtype = (
            torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        )
        flat = x.reshape(B * T, C)
        routing = self.router(flat)
        N, k = routing.topk_idx.shape
        slot_expert = routing.topk_idx.flatten()  # (N k,)
        order = torch.argsort(slot_expert, stable=True)  # (M,) slots by expert, then by token
        counts = torch.bincount(slot_expert, minlength=self.n_experts)  # (E,)
        dropped = counts.new_zeros(())
        if self.cfg.capacity_factor > 0:
            order, counts, dropped = self._drop_over_capacity(slot_expert, order, counts, N)
        inverse = _inverse(order, N * k)  # (N k,) sorted row of each slot; M for dropped slots
        x_sorted = _SortTokens.apply(flat, order, inverse, k)  # (M, C)
        y_sorted = self.dispatch(x_sorted, counts, self.experts)  # (M, C)
        weights = routing.topk_weight.flatten().index_select(0, order)  # (M,) fp32
        y_sorted = y_sorted * weights.to(y_sorted.dtype)[:, None]
        out = _Combine.apply(y_sorted, order, inverse, k)  # (N, C)
        if self.shared is not None:
            shared = self.shared(flat)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(self.shared_gate(flat))
            out = out + shared
        self._account(routing, counts, dropped, B)
        return out.view(B, T, C).to(out_dtype)

    def _drop_over_capacity(
        self, slot_expert: Tensor, order: Tensor, counts: Tensor, N: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Keep each expert's first ceil(cf N k / E) slots (earlier tokens win); drop the rest."""
        capacity = math.ceil(self.cfg.capacity_factor * N * self.top_k / self.n_experts)
        starts = counts.cumsum(0) - counts  # (E,) first sorted position of each expert
        sorted_expert = slot_expert.index_select(0, order)
        rank = torch.arange(order.numel(), device=order.device) - starts[sorted_expert]
        kept = counts.clamp(max=capacity)
        return order[rank < capacity], kept, counts.sum() - kept.sum()

    def _account(self, routing: Routing, counts: Tensor, dropped: Tensor, batch: int) -> None:
        """Accumulate load statistics and keep the balance losses (training forwards only)."""
        if not torch.is_grad_enabled():
            return
        coefs = {
            "aux_loss": self.cfg.aux_loss_coef,
            "seq_aux_loss": self.cfg.seq_aux_loss_coef,
            "z_loss": self.cfg.z_loss_coef,
        }
        # the same autograd ops in a forward and in its checkpoint recompute (saved tensors match)
        values = {name: LOSSES[name](routing, batch) for name, coef in coefs.items() if coef > 0}
        if in_recompute():
            return
        total = None
        if values:
            total = torch.stack([coefs[name] * value for name, value in values.items()]).sum()
            self._aux_losses.append(total)
        with torch.no_grad():
            self.tokens_per_expert += counts
            self.dropped_tokens += dropped
            logged = {
                name: (values[name] if name in values else LOSSES[name](routing, batch)).detach()
                for name in coefs
            }
            logged["weighted"] = (
                total.detach() if total is not None else torch.zeros_like(logged["z_loss"])
            )
            self.last_losses = logged

    def external_parameters(self) -> list[nn.Parameter]:
        """Weights used inside this layer by a module that is not called (the router reads its
        gate's weight in fp32) and returns no tensor (its Routing): engines that gather weights
        around each module's forward and backward (DeepSpeed's ZeRO-3) fetch them with this
        layer's."""
        return [self.router.gate.weight]

    def param_roles(self) -> dict[str, str]:
        # a (1, C) gate: AdamW, never Muon (an orthogonalized single row is just its sign pattern)
        return {"shared_gate.weight": roles.MIXING} if self.shared_gate is not None else {}

    def pop_aux_losses(self) -> list[Tensor]:
        """The weighted balance losses kept since the last pop (one per training forward)."""
        losses, self._aux_losses = self._aux_losses, []
        return losses

    # ---- accounting hooks (model/accounting.py) -------------------------------------------------

    def _expert_params(self) -> int:
        e = self.experts
        return sum(w.numel() for w in (e.w_gate, e.w_up, e.w_down)) // self.n_experts

    def active_matmul_params(self) -> int:
        """Weights one token multiplies: router, shared experts and its top_k routed experts."""
        shared = 0
        if self.shared is not None:
            shared = sum(
                m.weight.numel() for m in self.shared.modules() if isinstance(m, nn.Linear)
            )
        if self.shared_gate is not None:
            shared += self.shared_gate.weight.numel()
        return self.router.gate.weight.numel() + shared + self.top_k * self._expert_params()

    def inactive_params_per_token(self) -> int:
        return (self.n_experts - self.top_k) * self._expert_params()

    def init_weights(self, stds: InitStds) -> None:
        self.router.init_weights(stds.inner)
        self.experts.init_weights(stds)
        if self.shared is not None:
            self.shared.init_weights(stds)
        if self.shared_gate is not None:
            init_linear(self.shared_gate, stds.inner)
        nn.init.zeros_(self.tokens_per_expert)
        nn.init.zeros_(self.dropped_tokens)
        self._aux_losses = []
        self.last_losses = {}
