"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 section 2.2; `model.mtp`): D sequential
modules after the main model, module k predicting the token k + 1 ahead, sharing the embedding and
the output head.

Shapes: B batch, T tokens, C d_model.

    h^0    = the main model's last hidden state before its final norm (torchtitan's and
             Megatron-LM's choice; transformers' speculative generator reads the normed one)
    x^k    = the input tokens shifted left by k within each document (the token k ahead), 0 where
             there is none; y^k = the targets shifted likewise, ignored (-100) where there is none
    h'^k   = W_k [RMSNorm_e(Emb(x^k)) ; RMSNorm_h(h^{k-1})]   (2C -> C; embedding first, as the
             checkpoints store eh_proj)
    h^k    = Block_k(h'^k)   one block of the kind of the model's last layer (its mixer and its
             FFN, dense or MoE), with the main model's positions and masks (not shifted)
    L^k    = CE(Head(RMSNorm_k(h^k)), y^k), mean over the valid targets
    objective = L_main + (lambda / D) sum_k L^k

Alignment (torchtitan: MTP.md section 2.3; B0 starts a second document):
    inputs        A0 A1 A2 B0 B1 B2        targets       A1 A2 B0 B1 B2 B3
    depth 1 in    A1 A2 -  B1 B2 -         depth 1 out   A2 B0 -  B2 B3 -
    depth 2 in    A2 -  -  B2 -  -         depth 2 out   B0 -  -  B3 -  -
Each depth has k fewer targets per document; position i never reads past its document's last
input token (its target may be the next document's first token, as the main model's is).
Without document ids (trainer.doc_mask=false) each row is one document, as attention sees it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from model.block import Block
from model.config import LayerSpec, ModelConfig
from model.init import trunc_normal_
from model.loss import IGNORE_INDEX, split_targets
from model.mixers.masks import AttentionContext, document_starts
from model.norms import build_norm
from model.training_hooks import Reduce, TrainingHook


def shifted_valid(doc_starts: Tensor | None, shape: torch.Size, k: int, device) -> Tensor:
    """(B, T) bool: position i may read position i + k (inside the row, no document start in
    (i, i + k])."""
    B, T = shape
    valid = torch.zeros(B, T, dtype=torch.bool, device=device)
    if k >= T:
        return valid
    if doc_starts is None:
        valid[:, : T - k] = True
        return valid
    runs = doc_starts.cumsum(dim=1)  # document number of each position
    valid[:, : T - k] = runs[:, k:] == runs[:, : T - k]
    return valid


def roll_left(x: Tensor, k: int, valid: Tensor, fill: int) -> Tensor:
    """x (B, T) -> position i holds x[i + k] where `valid`, else `fill`."""
    out = torch.full_like(x, fill)
    if k < x.shape[1]:
        out[:, : x.shape[1] - k] = x[:, k:]
    return torch.where(valid, out, torch.full_like(out, fill))


class MTPModule(nn.Module):
    """Depth k: the norms, the 2C -> C projection, one block and the final norm (DeepSeek-V3's
    model.layers.{L + k - 1}.{enorm, hnorm, eh_proj, <block>, shared_head.norm})."""

    def __init__(self, cfg: ModelConfig, depth: int) -> None:
        super().__init__()
        C, last = cfg.d_model, cfg.layer_specs()[-1]
        self.depth = depth
        self.enorm = build_norm(cfg.norm, C, cfg.norm_eps)
        self.hnorm = build_norm(cfg.norm, C, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * C, C, bias=False)
        spec = LayerSpec(cfg.n_layers + depth - 1, last.mixer, last.ffn)
        self.block = Block(cfg, spec.index, spec)
        self.norm = build_norm(cfg.norm, C, cfg.norm_eps)

    def forward(
        self, hidden: Tensor, embedded: Tensor, ctx: AttentionContext, cache=None
    ) -> tuple[Tensor, Tensor]:
        """hidden h^{k-1} (B, T, C), embedded Emb(x^k) (B, T, C) -> (h^k, RMSNorm_k(h^k)), both
        (B, T, C): the next depth's input and the head's (the norm runs here, inside the
        module's FSDP2 unit)."""
        mixed = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        out = self.block(mixed, ctx, cache)
        return out, self.norm(out)

    def init_weights(self, cfg: ModelConfig) -> None:
        for norm in (self.enorm, self.hnorm, self.norm):
            norm.init_weights()
        trunc_normal_(self.eh_proj.weight, cfg.init.std)
        self.block.init_weights(cfg)


class MultiTokenPrediction(nn.Module):
    """The D modules (`layers`), lambda (`weight`, set before each step by `MTPHook` from the
    schedule), and the per-depth loss sums since the last `stats` (`loss_sums`, for the
    metrics)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.depth = cfg.mtp.depth
        self.layers = nn.ModuleList(MTPModule(cfg, k) for k in range(1, self.depth + 1))
        # the last training forward's weighted depth losses, until the trainer adds them
        self.pending: Tensor | None = None
        self.weight = cfg.mtp.weight
        # per-depth loss sums over the training forwards since the last `stats` (micro-batches)
        self.register_buffer("loss_sums", torch.zeros(self.depth), persistent=False)
        self.register_buffer("forwards", torch.zeros(()), persistent=False)

    def objective(
        self,
        model: nn.Module,
        hidden: Tensor,
        tokens: Tensor,
        targets: Tensor,
        ctx: AttentionContext,
    ) -> Tensor | None:
        """(lambda / D) x the sum of the depth losses, with gradients; None when lambda is 0 (the
        modules are skipped: no cost, no update). `model`: the Transformer whose embedding and
        head are shared; hidden: h^0 (B, T, C)."""
        if self.weight == 0:
            return None
        total = None
        split = ctx.context_parallel  # (hidden: the rank's positions; tokens, targets: whole)
        starts = ctx.doc_starts
        if split is not None:
            starts = document_starts(split.doc_ids) if split.doc_ids is not None else None
        for k, module in enumerate(self.layers, start=1):
            valid = shifted_valid(starts, tokens.shape, k, tokens.device)
            inputs = roll_left(tokens, k, valid, 0)
            labels = roll_left(targets, k, valid, IGNORE_INDEX)
            weight = 1.0
            if split is not None:  # this rank's positions, its weighted mean (as the loss's)
                inputs = inputs[:, split.kept]
                labels, weight = split_targets(labels, split.kept, split.cp)
            hidden, normed = module(hidden, model.embed(inputs), ctx)
            head = model.head_weight
            loss = weight * model.loss_fn(normed, head, labels, model.cfg.loss_chunk_tokens)
            with torch.no_grad():  # (split: the ranks' weighted means average to the depth's)
                self.loss_sums[k - 1] += loss.detach().float()
            total = loss if total is None else total + loss
        with torch.no_grad():
            self.forwards += 1
        return total * (self.weight / self.depth)

    def init_weights(self, cfg: ModelConfig) -> None:
        for module in self.layers:
            module.init_weights(cfg)
        self.loss_sums.zero_()
        self.forwards.zero_()

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        """The metric sums stay fp32 when the model is cast (bf16 would round the losses)."""
        super()._apply(fn, recurse)
        for name in ("loss_sums", "forwards"):
            buffer = self._buffers[name]
            if buffer is not None and buffer.dtype != torch.float32:
                self._buffers[name] = buffer.float()
        return self

    @torch.no_grad()
    def stats(self, reduce: Callable[[Tensor], None] | None = None) -> dict[str, float]:
        """mtp/loss_<k>: depth k's mean loss over the training forwards since the last call (all
        ranks' micro-batches when `reduce` sums a tensor over them in place), and mtp/weight
        (lambda); {} when there was none. Resets."""
        sums = torch.cat([self.loss_sums, self.forwards[None]])
        if reduce is not None:
            reduce(sums)
        self.loss_sums.zero_()
        self.forwards.zero_()
        count = float(sums[-1])
        if not count:
            return {}
        means = (sums[:-1] / count).tolist()
        return {f"mtp/loss_{k}": v for k, v in enumerate(means, start=1)} | {
            "mtp/weight": self.weight
        }


class MTPHook(TrainingHook):
    """Multi-token prediction as a training hook: lambda from the schedule before each step
    (`model.mtp.weight`, then `final_weight`, over the schedule's run length as the learning rate
    is), the weighted depth losses added to each micro-batch's objective, and the per-depth mean
    losses over every rank's micro-batches as metrics (mtp/loss_<k>, mtp/weight)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model  # the Transformer: it keeps the last forward's MTP objective

    def before_step(self, step: int, total_steps: int) -> None:
        self.model.mtp.weight = self.model.cfg.mtp.weight_at(step, total_steps)

    def objective(self) -> Tensor | None:
        return self.model.pop_mtp_objective()

    def after_backward(self, reduce: Reduce) -> dict[str, float]:
        return self.model.mtp.stats(lambda sums: reduce(sums, "sum"))
