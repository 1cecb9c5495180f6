"""Top-k router: expert scores from fp32 logits, optional group-limited selection, and a per-expert
selection bias for aux-loss-free balancing (DeepSeek-V3).

Shapes: N tokens, C d_model, E routed experts, k top_k, G expert groups.

    logits  = x W_gate^T                       (N, E), computed in fp32
    scores  = softmax(logits) | sigmoid(logits) (N, E)
    choice  = scores + expert_bias              selection only; the bias never enters the weights
    groups  : each group's score is the sum of its top-2 choice scores; the topk_groups best groups
              stay, the others are masked out before the top-k over experts
    weights = scores[topk] (/ their sum when norm_topk_prob) x route_scale
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from model import roles
from model.config import MoEConfig
from model.init import trunc_normal_
from model.moe.buffers import Fp32Buffers


@dataclass
class Routing:
    topk_idx: Tensor  # (N, k) int64: the selected experts
    topk_weight: Tensor  # (N, k) fp32: their weights in the combine
    scores: Tensor  # (N, E) fp32: softmax/sigmoid of the logits, without the selection bias
    logits: Tensor  # (N, E) fp32


class Router(Fp32Buffers):
    fp32_buffers = ("expert_bias",)

    def __init__(self, d_model: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(d_model, cfg.n_routed_experts, bias=False)
        # aux-loss-free balancing bias (updated by moe.apply_bias_update, saved in checkpoints)
        self.register_buffer(
            "expert_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32), persistent=True
        )

    def param_roles(self) -> dict[str, str]:
        return {"gate.weight": roles.ROUTER}  # a matrix that Muon must not orthogonalize

    def forward(self, x: Tensor, weight_grad_rows: Tensor | None = None) -> Routing:
        """x (N, C) -> Routing. `weight_grad_rows` (N,) bool: the tokens whose logits give the
        gate's weight a gradient (the others' reach x only); None: all of them."""
        with torch.autocast(x.device.type, enabled=False):
            weight = self.gate.weight.float()
            logits = nn.functional.linear(x.float(), weight)  # (N, E)
            if weight_grad_rows is not None:
                held = nn.functional.linear(x.float(), weight.detach())
                logits = torch.where(weight_grad_rows[:, None], logits, held)
        if self.cfg.score_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(dim=-1)
        with torch.no_grad():  # selection is not differentiable; only the gathered weights are
            choice = scores + self.expert_bias.float()
            choice = self._limit_groups(choice)
            topk_idx = choice.topk(self.cfg.top_k, dim=-1).indices  # (N, k)
        weights = scores.gather(1, topk_idx)
        if self.cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.cfg.route_scale != 1.0:
            weights = weights * self.cfg.route_scale
        return Routing(topk_idx=topk_idx, topk_weight=weights, scores=scores, logits=logits)

    def _limit_groups(self, choice: Tensor) -> Tensor:
        """Mask (-inf) the experts outside each token's topk_groups best groups."""
        G, keep = self.cfg.n_groups, self.cfg.topk_groups
        if keep >= G:
            return choice
        N, E = choice.shape
        grouped = choice.view(N, G, E // G)
        group_scores = grouped.topk(min(2, E // G), dim=-1).values.sum(dim=-1)  # (N, G)
        kept = torch.zeros(N, G, dtype=torch.bool, device=choice.device)
        kept.scatter_(1, group_scores.topk(keep, dim=-1).indices, True)
        return grouped.masked_fill(~kept[:, :, None], float("-inf")).view(N, E)

    def init_weights(self, std: float) -> None:
        trunc_normal_(self.gate.weight, std)
        nn.init.zeros_(self.expert_bias)
