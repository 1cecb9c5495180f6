"""The MoE FFN: router -> sort token slots by expert -> dispatch to experts -> weighted combine,
plus the always-active shared experts.

Shapes: B batch, T time, N = B T tokens, C d_model, E routed experts, k top_k, M = N k token slots
(fewer when capacity dropping removes some). Slot s is token s // k's (s % k)-th choice.

    x (B, T, C) -> flat (N, C) -> routing: topk_idx, topk_weight (N, k)
    order     = stable argsort of topk_idx.flatten()      slots grouped by expert, tokens in order
                (sorted as uint8 ids: slots.sort_slots)
    counts    = slots per expert (a scatter-add)         (E,) int64
    y_sorted  = dispatch(flat[order // k], counts, experts)   (M, C), the rows gathered in the
                experts' compute dtype (bf16 under autocast)
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
from model.moe.padded import padded_route
from model.moe.router import Router, Routing
from model.moe.slots import SortTokens, combine_slots, expert_counts, slot_rows, sort_slots
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


def in_recompute(checkpointed: bool = True) -> bool:
    """True while autograd runs a backward pass, i.e. when a forward is a checkpoint recompute.
    `checkpointed` False (no activation checkpointing around the layer): inside a compiled block
    the answer is a constant False, so the block traces as one graph (autograd's task id is
    not traceable: a graph break in every MoE block)."""
    if not checkpointed and torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


class GatedPartialSum(torch.autograd.Function):
    """shared (N, C), one rank's partial sum of the shared experts' output, times the gate
    (N, 1) that every rank computes whole: the product is the rank's partial sum of the gated
    output, and the gate's gradient, sum_c dout s over the whole s, is the sum over the ranks of
    each rank's (`sum_partial`: N numbers)."""

    @staticmethod
    def forward(ctx: object, shared: Tensor, gate: Tensor, sum_partial: Callable) -> Tensor:
        ctx.save_for_backward(shared, gate)
        ctx.sum_partial = sum_partial
        return shared * gate

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        shared, gate = ctx.saved_tensors
        grad_gate = ctx.sum_partial((grad * shared).sum(-1, keepdim=True, dtype=torch.float32))
        return grad * gate, grad_gate.to(gate.dtype), None


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
        # set by activation checkpointing (parallel/activation.py): this layer's forward may run
        # again in backward, where it must not count its statistics twice (reset where the
        # checkpoint itself is compiled: the recompute then runs inside the compiled graph)
        self.checkpointed = False
        # set per forward by sequence parallelism (parallel/sequence_parallel.py): the positions
        # (start, stop) of the sequence whose output this rank keeps; the routed experts then
        # run only for those tokens (the router still sees every token: its statistics and
        # balance losses are the whole sequence's). None: every token
        self.local_positions: tuple[int, int] | None = None
        # set per forward by tensor parallelism while the shared experts' output is each tp
        # rank's partial sum (their row-wise projection's `partial_output`): sums a tensor over
        # the ranks, which the shared experts' gate needs for its gradient. None: whole outputs
        self.sum_partial: Callable[[Tensor], Tensor] | None = None
        self._aux_losses: list[Tensor] = []  # weighted balance losses since the last pop
        self.last_losses: dict[str, Tensor] = {}  # detached, from the last training forward

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        device = x.device.type
        out_dtype = (
            torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        )
        flat = x.reshape(B * T, C)
        mine = self._own_tokens(B, T, x.device)
        routing = self.router(flat, mine)
        if mine is None:
            out, counts, dropped = self._route(flat, routing.topk_idx, routing.topk_weight)
            return self._finish(out, flat, routing, counts, dropped, B, out_dtype)
        rows = self._own_rows(B, T, x.device)  # (B (stop - start),) only they meet the experts
        part, _, _ = self._route(flat[rows], routing.topk_idx[rows], routing.topk_weight[rows])
        out = part.new_zeros(B * T, C).index_copy(0, rows, part)  # the others: cut away after
        counts = expert_counts(routing.topk_idx.flatten(), self.n_experts)  # every token's
        return self._finish(out, flat, routing, counts, counts.new_zeros(()), B, out_dtype)

    def _own_tokens(self, B: int, T: int, device: torch.device) -> Tensor | None:
        """(B T,) bool of the tokens whose routed experts run here when `local_positions` is set
        (sequence parallelism keeps only this rank's positions of the output); None: all."""
        if self.local_positions is None:
            return None
        start, stop = self.local_positions
        mine = torch.zeros(B, T, dtype=torch.bool, device=device)
        mine[:, start:stop] = True
        return mine.flatten()

    def _own_rows(self, B: int, T: int, device: torch.device) -> Tensor:
        """(B (stop - start),) the flat rows of `local_positions` in ascending order, computed
        from the positions: `_own_tokens(...).nonzero()`'s answer without its host sync (and
        without the graph break that its data-dependent length makes in a compiled block)."""
        start, stop = self.local_positions
        batch = torch.arange(B, device=device)[:, None] * T  # (B, 1) first row of each sequence
        return (batch + torch.arange(start, stop, device=device)).flatten()

    def _route(
        self, flat: Tensor, topk_idx: Tensor, topk_weight: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The routed experts' weighted output (N, C) of tokens `flat` (N, C) and their slot
        counts per expert and dropped slots (after capacity dropping)."""
        N, k = topk_idx.shape
        slot_expert = topk_idx.flatten()  # (N k,)
        order = sort_slots(slot_expert, self.n_experts)  # (M,) slots by expert, then by token
        counts = expert_counts(slot_expert, self.n_experts)  # (E,)
        dropped = counts.new_zeros(())
        if self._drops():
            order, counts, dropped = self._drop_over_capacity(slot_expert, order, counts, N)
        if self._routes_padded(flat, order, counts):
            return padded_route(flat, order, counts, topk_weight, self.experts), counts, dropped
        inverse = slot_rows(order, N * k)  # (N k,) sorted row of each slot; M for dropped slots
        dtype = self.experts.compute_dtype(flat)  # N rows cast, then M gathered
        x_sorted = SortTokens.apply(flat, order, inverse, k, dtype)  # (M, C)
        y_sorted = self.dispatch(x_sorted, counts, self.experts)  # (M, C)
        kept = (inverse < order.numel()).view(N, k) if order.numel() < N * k else None
        slot_row = inverse.view(N, k) if kept is None else torch.where(kept, inverse.view(N, k), 0)
        out = combine_slots(y_sorted, slot_row, topk_weight, kept, order)  # (N, C)
        return out, counts, dropped

    def position_local_parameters(self) -> list[str]:
        """With `local_positions` set, the weights whose gradient comes from this rank's tokens
        only (the router's gate, the routed experts): a partial sum over the ranks sharing the
        sequence, completed by parallel/sequence_parallel.py."""
        return ["router.gate.weight", "experts.w_gate", "experts.w_up", "experts.w_down"]

    def _drops(self) -> bool:
        """Whether this forward drops slots over capacity: training forwards with a capacity
        factor only. Evaluation, scoring and generation drop nothing (as DeepSeek-V2 at
        inference), so a sequence's output never depends on which others share its batch."""
        return self.cfg.capacity_factor > 0 and self.training

    def _routes_padded(self, flat: Tensor, order: Tensor, counts: Tensor) -> bool:
        """Whether the direct padded route applies: every expert local (no expert-parallel
        dispatch), nothing dropped, and the experts would pad (model/moe/padded.py)."""
        if self.dispatch is not local_dispatch or self._drops():
            return False
        dtype = self.experts.compute_dtype(flat)
        impl = self.experts.choose(flat.device.type, dtype, order.numel(), counts)
        return impl == "padded_bmm"

    def _finish(
        self,
        out: Tensor,
        flat: Tensor,
        routing: Routing,
        counts: Tensor,
        dropped: Tensor,
        batch: int,
        out_dtype: torch.dtype,
    ) -> Tensor:
        """The routed output (N, C) plus the shared experts, as (B, T, C) in `out_dtype`."""
        if self.shared is not None:
            shared = self.shared(flat)
            if self.shared_gate is not None:
                gate = torch.sigmoid(self.shared_gate(flat))  # (N, 1)
                if self.sum_partial is None:
                    shared = shared * gate
                else:
                    shared = GatedPartialSum.apply(shared, gate, self.sum_partial)
            out = out + shared
        self._account(routing, counts, dropped, batch)
        return out.view(batch, -1, flat.shape[1]).to(out_dtype)

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
        if in_recompute(self.checkpointed):
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
