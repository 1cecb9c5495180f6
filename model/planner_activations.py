"""Activation memory of a training forward: what each block keeps for its backward, estimated
from the layers' shapes (model/planner.py adds it to a rank's plan).

Counts are elements per token, `act` in the compute dtype (param_dtype) and `fp32` in fp32 (norm
statistics, softmax log-sum-exps, RoPE tables); a matmul's input and an op's output that the
next op saves count once (autograd keeps one storage). `share` is the fraction of a layer's heads
or hidden units a rank holds: 1 / tp where the layer's own `tensor_parallel_plan` splits it, else
1; the block's input and the normed input of its projections are whole on every tp rank.

Per block (pre-norm): each sublayer's norm keeps its input and 1 fp32 statistic (C + 1), then:
- softmax attention (gqa: MHA/GQA/MQA): the normed input C; per rank q, k, v and the output
  (2 H D + 2 K D: a FlashAttention-style kernel, no (T, T) probabilities; the matmul backend
  and torch's math fallback keep H x T more); H fp32 log-sum-exps; 4 Dr fp32 for the RoPE
  tables of Dr rotated dims; an output gate 2 H D more, QK-norm H D + K D and H + K statistics.
- MLA: the normed input, the latent path (kv_a's output R + Dr and its normed R; with a low-rank
  query 2 Rq), and per rank the concatenated q and k (H (Dn + Dr) each), kv_b's output
  H (Dn + Dv), the attention output and its o_proj input (2 H Dv), H log-sum-exps.
- Gated DeltaNet / KDA, torch's chunked path (model/mixers/delta_rule.py, also what `kernel=auto`
  runs without fla-core): the normed input; the q|k|v projection, conv and activation outputs
  (3 x (2 Hk Dk + H Dv)); per value head 6.5 L + 9.5 Dk + 1.5 Dv + 1.5 Dk Dv / L (L the chunk
  length: the chunk's pair products, the triangular solves, the per-chunk state copies;
  constants fitted to measurement, tests/model/test_planner.py; x (T rounded up to L) / T, the
  last chunk's padding) and 6 Dv (the output, the gated norm's tensors, o_proj's input); KDA's
  per-channel decay adds 3.9 Dk (c + L / c) per head (sub-chunks of c = min(16, L) tokens) and
  its low-rank gates 2 H D. With `kernel=fla` the kernel keeps its inputs and one (L) row per head instead of
  the chunk products: H (2 Dk + Dv + L + 2) + 6 H Dv.
- dense FFN: the normed input, then 4 F per rank for a gated one (gate and up outputs, the
  activation, the product: the down projection's input), 2 F for a plain one.
- MoE: the normed input; the router's E fp32 logits and 3 k + 2 more (top-k indices, weights);
  k routed copies of each token (2 C: the dispatched input and the expert output before the
  weighted sum, and 4 Fe inside a gated expert), of 1 / tp of the tokens under tensor
  parallelism (each rank routes its own positions': parallel/routed_work.py); a shared expert's
  4 Fs per rank.
Outside the blocks: the token ids (8 bytes), the final norm (C + 1), and the fused head + loss's
saved gradients (model/loss.py GradientsInForward): grad_h C per token, grad_w (V / tp) x C in
the compute dtype once per step (whatever the token count); each MTP module adds its block, its
norms and 2C -> C projection input (3 C + 2) and another grad_h and grad_w.

Full activation checkpointing keeps each block's input (the residual stream's width: n C for n
parallel streams), the parts outside the blocks, and during backward one block's recompute.

Sequence parallelism (parallel/sequence_parallel.py) keeps T / tp positions of the stream between
the sublayers: the norms' inputs and statistics and the checkpointed block inputs are divided by
tp; each sublayer's gathered input (the normed input above) stays whole, and the gather and cut
keep nothing (measured: tests/model/test_planner.py). MTP's blocks run after the final gather:
whole.

Not modelled (their kinds fall back to the nearest one above): AttnRes' growing list of sources,
mHC's stream maps, Engram's lookups, selective checkpointing.

Pipeline parallelism (`in_flight`): a stage keeps the activations of each micro-batch from its
forward until its backward is done (the weight pass, for the schedules that split the backward
into input and weight passes). With m micro-batches, pp ranks, v stages per rank and pipeline rank
r, the most micro-batches each stage of rank r holds at once (`caps`, in stage order) and the most
of all its stages together (`total`), read off torch.distributed.pipelining's schedules (the
warm-up counts of the single-stage ones' code; the multi-stage ones' `pipeline_order` action
lists, which tests/model/test_planner.py replays for pp 2-4 and every m they take up to 4 pp):
- GPipe: all m; 1F1B: min(m, pp - r) (its warm-up);
- LoopedBFS: all m of every stage (each stage's forwards before any backward);
- Interleaved1F1B and InterleavedZeroBubble, in rounds of R = m // max(1, m // pp) micro-batches,
  with d = 2 (pp - 1 - r) + 1 (Interleaved1F1B's warm-up, Megatron's formula for R = pp) or pp
  (InterleavedZeroBubble: its weight passes trail by r): total min(v m, (v - 1) R + d); with
  v = 2 the first stage at most min(m, R + min(R, d)), the second min(R, d);
- ZBVZeroBubble and DualPipeV (2 stages in a V): rank r's first stage at most min(m, 2 pp - r),
  its second min(m, r + 1), together at most 2 pp (DualPipeV 2 pp + 1).
The rank's peak (`pipeline_peak`) fills the caps heaviest stage first, up to `total`: for two
stages per rank that is the schedules' own peak whatever each stage keeps per micro-batch
(checked on the action lists); with more, each cap is taken as min(m, total): an upper bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from model.stages import V_SCHEDULES
from model.transformer import Transformer


@dataclass(frozen=True)
class Saved:
    """Elements per token kept for backward: `act` in the compute dtype, `fp32` in fp32."""

    act: float = 0.0
    fp32: float = 0.0

    def __add__(self, other: Saved) -> Saved:
        return Saved(self.act + other.act, self.fp32 + other.fp32)

    def bytes(self, width: int) -> float:
        return self.act * width + self.fp32 * 4


def _in_features(module: nn.Module) -> int:
    return next(m for m in module.modules() if isinstance(m, nn.Linear)).in_features


def _gqa(m: nn.Module, share: float, seq_len: int) -> Saved:
    H, D = m.n_heads, m.head_dim
    K = max(m.n_kv_heads * share, 1) / share  # a rank keeps at least one key/value head
    heads = 2 * H * D + 2 * K * D  # q, k, v and the attention output
    stats = H  # log-sum-exps
    if m.gate_proj is not None:  # gate projection output, sigmoid x output (o_proj's input)
        heads += 2 * H * D
    if m.q_norm is not None:
        heads += H * D + K * D
        stats += H + K
    return Saved(_in_features(m) + share * heads, share * stats + 4 * m.rotary_dim)


def _mla(m: nn.Module, share: float, seq_len: int) -> Saved:
    H, Dn, Dr, Dv, R = m.n_heads, m.nope_dim, m.rope_dim, m.v_dim, m.kv_rank
    latent = (R + Dr) + R  # kv_a's output, the normed latent
    stats = 1.0
    if m.q_a_proj is not None:
        latent += 2 * m.q_a_proj.out_features
        stats += 1
    heads = 2 * H * (Dn + Dr) + H * (Dn + Dv) + 2 * H * Dv
    return Saved(_in_features(m) + latent + share * heads, stats + share * H + 4 * m.rotary_dim)


def _delta_rule(m: nn.Module, share: float, seq_len: int) -> Saved:
    """Gated DeltaNet and KDA (KDA: k_dim = v_dim = head_dim, as many key as value heads)."""
    H, Dk, Dv, L = m.n_heads, m.k_dim, m.v_dim, m.chunk
    Hk = getattr(m, "n_k_heads", H)
    per_channel = hasattr(m, "f_b_proj")  # KDA: a decay per key channel
    heads = 3 * (2 * Hk * Dk + H * Dv)  # q|k|v projections, conv outputs, activations
    if per_channel:
        heads += 2 * H * Dv  # the low-rank forget and output gates' up projections
    if m.kernel == "fla":
        return Saved(_in_features(m) + share * (heads + H * (2 * Dk + Dv + L + 2) + 6 * H * Dv))
    core = H * (6.5 * L + 9.5 * Dk + 1.5 * Dv + 1.5 * Dk * Dv / L)
    if per_channel:
        c = min(16, L)
        core += H * 3.9 * Dk * (c + L / c)
    padded = math.ceil(seq_len / L) * L / seq_len  # the chunks cover T rounded up to L
    output = 6 * H * Dv  # the delta rule's output, the gated norm's, o_proj's input
    return Saved(_in_features(m) + share * (heads + core * padded + output), share * 6 * H)


# the estimate of each mixer kind (TokenMixer.kind); a kind without one counts as attention
MIXER_ESTIMATES = {"gqa": _gqa, "mla": _mla, "gdn": _delta_rule, "kda": _delta_rule}


def _dense_ffn(m: nn.Module, share: float) -> Saved:
    hidden = m.up_proj.out_features
    per_unit = 4 if hasattr(m, "gate_proj") else 2
    return Saved(m.up_proj.in_features + share * per_unit * hidden)


def _moe(m: nn.Module, shared_share: float, routed_share: float = 1.0) -> Saved:
    """`routed_share`: the fraction of the tokens whose routed experts run on a rank (1 / tp
    under tensor parallelism: each runs its positions', parallel/routed_work.py)."""
    C, k = m.router.gate.in_features, m.top_k
    hidden = m.experts.w_up.shape[-1]  # (E, C, Fe)
    routed = routed_share * k * (2 * C + 4 * hidden)
    shared = _dense_ffn(m.shared, shared_share).act - C if m.shared is not None else 0.0
    return Saved(C + routed + shared, m.n_experts + 3 * k + 2)


def block_saved(
    block: nn.Module,
    shares: dict[int, float],
    seq_len: int,
    stream: float = 1.0,
    routed: float = 1.0,
) -> Saved:
    """One block's saved elements per token; `shares[id(module)]`: 1 / tp for planned modules;
    `stream`: the fraction of the positions a rank keeps of the stream between the sublayers
    (1 / tp under sequence parallelism, whose gathered sublayer inputs stay whole); `routed`:
    the fraction of the tokens a MoE layer's routed experts take on a rank."""

    def share(module: nn.Module) -> float:
        return shares.get(id(module), 1.0)

    C = _in_features(block.attn)
    norms = Saved(2 * C * stream, 2 * stream)  # each sublayer norm's input and statistic
    estimate = MIXER_ESTIMATES.get(type(block.attn).kind, _gqa)
    mixer = estimate(block.attn, share(block.attn), seq_len)
    ffn = block.ffn
    if hasattr(ffn, "experts"):
        shared = share(ffn.shared) if ffn.shared is not None else 1.0
        return norms + mixer + _moe(ffn, shared, routed)
    return norms + mixer + _dense_ffn(ffn, share(ffn))


def outside_blocks(model: Transformer) -> Saved:
    """Per token outside the blocks: ids (8 bytes = 2 fp32 slots), final norm, the loss's grad_h
    (and per MTP module its norms, projection input and grad_h)."""
    C = model.cfg.d_model
    depth = len(model.mtp.layers) if model.mtp is not None else 0
    return Saved(2 * C + depth * 4 * C, 3 + depth * 2)


def loss_fixed_elements(model: Transformer, tp: int) -> float:
    """grad_w of the head, once per loss (the main one and each MTP module's), per tp rank."""
    losses = 1 + (len(model.mtp.layers) if model.mtp is not None else 0)
    return losses * model.head_weight.numel() / tp


def in_flight(schedule: str, pp: int, m: int, per_rank: int, rank: int) -> tuple[list[int], int]:
    """(the most micro-batches each of pipeline rank `rank`'s stages holds at once, in stage order;
    the most of all of them together) under `schedule` (module docstring)."""
    if schedule == "GPipe":
        return [m], m
    if schedule == "1F1B":
        return [min(m, pp - rank)], min(m, pp - rank)
    if schedule == "LoopedBFS":
        return [m] * per_rank, m * per_rank
    if schedule in V_SCHEDULES:
        caps = [min(m, 2 * pp - rank), min(m, rank + 1)]
        return caps, min(sum(caps), 2 * pp + (schedule == "DualPipeV"))
    per_round = m // max(1, m // pp)  # (Interleaved1F1B, InterleavedZeroBubble)
    d = 2 * (pp - 1 - rank) + 1 if schedule == "Interleaved1F1B" else pp
    total = min(per_rank * m, (per_rank - 1) * per_round + d)
    if per_rank > 2:  # (an upper bound: see the module docstring)
        return [min(m, total)] * per_rank, total
    caps = [min(m, (per_rank - 1 - j) * per_round + min(per_round, d)) for j in range(per_rank)]
    return caps, total


def pipeline_peak(per_micro_batch: list[float], caps: list[int], total: int) -> float:
    """The most bytes a pipeline rank keeps at once: n_j micro-batches of its stage j, each
    `per_micro_batch[j]` bytes, with n_j <= caps[j] and sum n_j <= total (heaviest first)."""
    left, peak = total, 0.0
    for size, cap in sorted(zip(per_micro_batch, caps, strict=True), reverse=True):
        n = min(cap, left)
        peak, left = peak + n * size, left - n
    return peak
