"""What context parallelism adds to a rank's plan (model/planner.py; parallel/context_parallel.py).

Each of the cp ranks computes 2 head-tail chunks of every sequence: T / cp positions, so every
per-token activation of model/planner_activations.py counts T / cp tokens. On top of that, per
layer kind, with T the whole sequence and B the micro-batch:

- softmax attention (gqa, MLA): the keys and values of every rank, gathered in one all-gather
  and kept for backward: B T x (Hkv (Dk + Dv)) in the compute dtype per rank's kv heads (MLA:
  every head's key H (Dn + Dr) and value H Dv), of which the rank's own T / cp positions are
  already counted. The Triton kernel (what `auto` takes on a GPU under cp) reads them chunk by
  chunk with per-row key bounds: nothing else. SDPA's path (CPU, or backend=sdpa) also keeps
  the boolean mask of the rank's queries against every key (B x T / cp x T bytes once per
  forward and window) and, for grouped-query heads, the keys and values repeated to the query
  heads: not counted here. Sent: the all-gather, (cp - 1) / cp of the gathered tensor, in
  forward and its gradient's reduce-scatter in backward (once more in a full checkpointing
  recompute).
- Gated DeltaNet and KDA: each segment's state map (M (Dk x Dk) and b (Dk x Dv) per head, fp32),
  2 cp of them gathered in forward and reduce-scattered in backward; the short convolutions'
  halos (K - 1 rows) are not counted (a few rows per segment).
Everything else (norms, FFN, MoE, AttnRes, mHC, the loss) is per token: nothing exchanged.
"""

from __future__ import annotations

from torch import nn

from model.transformer import Transformer

SOFTMAX_KINDS = ("gqa", "mla")
DELTA_RULE_KINDS = ("gdn", "kda")


def _kv_per_token(mixer: nn.Module, share: float) -> float:
    """Elements per token of the gathered keys and values on a rank, for a softmax-attention
    mixer whose heads a rank holds `share` of."""
    if mixer.kind == "mla":
        return mixer.n_heads * share * (mixer.nope_dim + mixer.rope_dim + mixer.v_dim)
    K = max(mixer.n_kv_heads * share, 1)  # a rank keeps at least one key/value head
    return 2 * K * mixer.head_dim


def context_activations(block: nn.Module, share: float, layout) -> float:
    """Bytes one block keeps on a rank beyond its per-token activations of T / cp positions."""
    cp = layout.cp
    if cp == 1 or block.attn.kind not in SOFTMAX_KINDS:
        return 0.0
    width = 4 if layout.param_dtype == "fp32" else 2
    B, T = layout.micro_batch_size, layout.seq_len
    return B * T * _kv_per_token(block.attn, share) * (1 - 1 / cp) * width


def context_comm(model: Transformer, layout, shares: dict) -> float:
    """Bytes a rank sends over its cp group per micro-batch step (module docstring)."""
    cp = layout.cp
    if cp == 1:
        return 0.0
    width = 4 if layout.param_dtype == "fp32" else 2
    B, T = layout.micro_batch_size, layout.seq_len
    passes = 3 if layout.activation_checkpoint == "full" else 2
    gathered = 0.0  # bytes of the whole gathered tensors per pass
    for block in model.blocks():  # (MTP's blocks attend over the split too)
        mixer, share = block.attn, shares.get(id(block.attn), 1.0)
        if mixer.kind in SOFTMAX_KINDS:
            gathered += B * T * _kv_per_token(mixer, share) * width
        elif mixer.kind in DELTA_RULE_KINDS:
            heads = mixer.n_heads * share
            gathered += B * 2 * cp * heads * mixer.k_dim * (mixer.k_dim + mixer.v_dim) * 4
    return passes * (cp - 1) / cp * gathered
