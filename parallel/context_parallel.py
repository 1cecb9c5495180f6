"""Context parallelism: the sequence split over `cp` ranks, and the ways layers look across the
split, exactly (the trainer does not offer it yet: `apply_context_parallel` splits a model of
softmax attention (GQA/MHA/MQA), Gated DeltaNet and KDA layers).

Load balance (causal attention costs more at later positions): the sequence of T positions is
cut into 2 cp chunks of T / (2 cp); rank r keeps chunks r and 2 cp - 1 - r (head-tail, or
"zig-zag"), so every rank does the same attention work. A rank's tensors hold its two chunks
one after the other, (B, 2 T / (2 cp), ...): `kept_positions` gives their global positions.

- Softmax attention (`attention_over_ranks`): each rank's queries attend to every rank's keys
  and values, all-gathered in one collective (gathering K and V apart gave wrong K gradients on
  gloo: backward collectives can pair up across ranks in another order) and put back in global
  order; the mask compares global positions (causal, sliding window, packed documents). Backward
  reduce-scatters the keys' and values' gradients to their ranks.
- Causal convolutions (the delta-rule layers' short convs, Engram's dilated one): each chunk
  reads the last positions of the chunk before it (`previous_rows`), then convolves as usual
  (their document masks use positions within the document, which stay global).
- The gated delta rule (`delta_rule_over_ranks`, Gated DeltaNet and KDA): each rank runs its two
  segments from an unknown incoming state (model/mixers/delta_rule.py
  affine_chunk_gated_delta_rule: o = o0 + R S0, final = M S0 + b), the (M, b) of all 2 cp
  segments are all-gathered and passed on in global order (S <- M S + b: 2 cp small products per
  head, every rank the same), and each rank finishes its outputs from its segments' incoming
  states (fla's "Kimi Context Parallel"). Sent per layer: 2 (Dk + Dv) Dk numbers per head and
  segment, whatever T.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn

from model.errors import ConfigError
from model.mixers.delta_rule import affine_chunk_gated_delta_rule
from model.mixers.qk_logits import max_logits_per_head

# the functional all-gather with autograd (backward: a reduce-scatter of the gradients); torch
# 2.13 renamed it, 2.11 has only the old name
_ALL_GATHER = (
    getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
)


def kept_positions(length: int, cp: int, rank: int, device: torch.device | str = "cpu") -> Tensor:
    """(2 T / (2 cp),) the global positions rank `rank` keeps: chunks r and 2 cp - 1 - r."""
    if length % (2 * cp):
        raise ValueError(f"a sequence of {length} positions does not split into 2 x cp={cp} chunks")
    chunk = length // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, last])


def _global_chunk_order(cp: int) -> list[int]:
    """Where global chunk j lies in the rank-order concatenation of every rank's two chunks
    (rank r contributes slots 2 r (its chunk r) and 2 r + 1 (its chunk 2 cp - 1 - r))."""
    return [2 * j if j < cp else 2 * (2 * cp - 1 - j) + 1 for j in range(2 * cp)]


def gather_sequence(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Every rank's (B, T_local, ...) two chunks -> (B, T, ...) in global order, with autograd
    (backward sums each position's gradient over the ranks onto the rank that holds it)."""
    cp = dist.get_world_size(group)
    gathered = _ALL_GATHER(x.movedim(1, 0).contiguous(), gather_dim=0, group=group).movedim(0, 1)
    chunks = gathered.chunk(2 * cp, dim=1)  # rank order: (r0: 0, 2cp-1), (r1: 1, 2cp-2), ...
    return torch.cat([chunks[slot] for slot in _global_chunk_order(cp)], dim=1)


def previous_rows(x: Tensor, span: int, group: dist.ProcessGroup) -> Tensor:
    """The `span` positions before each of this rank's two chunks, (B, 2, span, ...) (zeros
    before the sequence's start): what a causal convolution reading `span` positions back
    needs across the chunk boundary. x (B, T_local, ...) this rank's two chunks. Each chunk's
    last min(span, chunk) positions are all-gathered (a span longer than a chunk reaches into
    the chunks before); backward sums the rows' gradients onto their ranks."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    half = x.shape[1] // 2
    m = min(span, half)
    tails = torch.stack([x[:, half - m : half], x[:, x.shape[1] - m :]], dim=1)
    every = gather_sequence(tails, group)  # (B, 2 cp, m, ...): each chunk's last rows
    reach = -(-span // m)  # chunks back
    out = []
    for j in (rank, 2 * cp - 1 - rank):
        rows = every[:, max(0, j - reach) : j].flatten(1, 2)  # (B, <= reach m, ...)
        if rows.shape[1] < span:  # before the sequence's start
            pad = rows.new_zeros(rows.shape[0], span - rows.shape[1], *rows.shape[2:])
            rows = torch.cat([pad, rows], dim=1)
        out.append(rows[:, rows.shape[1] - span :])
    return torch.stack(out, dim=1)


def visible_keys(
    q_positions: Tensor, length: int, window: int = 0, doc_ids: Tensor | None = None
) -> Tensor:
    """The keys each of this rank's queries sees: (1 or B, 1, T_local, T) bool from the global
    query positions (T_local,), causal, within `window` (0: all), inside its document (doc_ids
    (B, T) the whole row's, or None)."""
    k_positions = torch.arange(length, device=q_positions.device)
    allowed = k_positions[None, :] <= q_positions[:, None]  # (T_local, T)
    if window:
        allowed = allowed & (q_positions[:, None] - k_positions[None, :] < window)
    allowed = allowed[None, None]  # (1, 1, T_local, T)
    if doc_ids is not None:
        same = doc_ids[:, q_positions, None] == doc_ids[:, None, :]  # (B, T_local, T)
        allowed = allowed & same[:, None]
    return allowed


def gather_keys_values(k: Tensor, v: Tensor, group: dist.ProcessGroup) -> tuple[Tensor, Tensor]:
    """Every rank's keys (B, Hkv, T_local, Dq) and values (B, Hkv, T_local, Dv) in one
    all-gather (two separate ones gave wrong key gradients on gloo) -> (B, Hkv, T, D) each, in
    global order."""
    both = gather_sequence(torch.cat([k, v], dim=-1).transpose(1, 2), group).transpose(1, 2)
    return both.split([k.shape[-1], v.shape[-1]], dim=-1)


def attention_over_ranks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_positions: Tensor,
    group: dist.ProcessGroup,
    *,
    window: int = 0,
    doc_ids: Tensor | None = None,
    scale: float | None = None,
    want_max: bool = False,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Causal attention of this rank's queries over every rank's keys. q (B, H, T_local, Dq),
    k (B, Hkv, T_local, Dq), v (B, Hkv, T_local, Dv) (Hkv divides H); q_positions (T_local,)
    global (`kept_positions`); doc_ids (B, T) the whole row's document ids (packed rows) or
    None; window: keys at most window - 1 positions back (0: all); mask: `visible_keys` of
    these arguments when the caller keeps it (layers sharing one). -> ((B, H, T_local, Dv),
    with `want_max` each head's largest logit over this rank's queries (H,), for QK-clip,
    whose hook takes the maximum over the ranks, else None)."""
    k_all, v_all = gather_keys_values(k, v, group)
    if mask is None:
        mask = visible_keys(q_positions, k_all.shape[2], window, doc_ids)
    new_max = None
    if want_max:
        scaling = scale if scale is not None else q.shape[-1] ** -0.5
        new_max = max_logits_per_head(q, k_all, scaling, mask, False, 0)
    groups = q.shape[1] // k_all.shape[1]
    if groups > 1:
        k_all, v_all = (t.repeat_interleave(groups, dim=1) for t in (k_all, v_all))
    out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale)
    return out, new_max


def kernel_attention_over_ranks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup,
    *,
    window: int = 0,
    doc_ids: Tensor | None = None,
    scale: float | None = None,
    want_max: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """`attention_over_ranks` through the Triton FlashAttention kernel, without a mask: each of
    the rank's two chunks (global positions [s, s + c)) attends over the gathered keys [0, s + c)
    bottom-right aligned, the per-row first keys from the global document starts and window, so
    only visible key blocks are computed; grouped-query heads read their kv head in the kernel.
    Same arguments and result (the rank's chunks are r and 2 cp - 1 - r)."""
    from model.kernels.flash_attention import flash_attention, key_bounds
    from model.mixers.masks import document_starts

    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    k_all, v_all = gather_keys_values(k, v, group)
    T, c = k_all.shape[2], q.shape[2] // 2
    starts = document_starts(doc_ids) if doc_ids is not None else None
    outs, maxes = [], []
    for part, chunk in enumerate((rank, 2 * cp - 1 - rank)):
        end = (chunk + 1) * c
        first = key_bounds(starts, window, T, q.device, rows=slice(chunk * c, end))
        result = flash_attention(
            q[:, :, part * c : (part + 1) * c],
            k_all[:, :, :end],
            v_all[:, :, :end],
            causal=True,
            softmax_scale=scale,
            first_key=first,
            return_max_logits=want_max,
        )
        out, new_max = result if want_max else (result, None)
        outs.append(out)
        maxes.append(new_max)
    return torch.cat(outs, dim=2), torch.maximum(*maxes) if want_max else None


def delta_rule_over_ranks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    group: dist.ProcessGroup,
    doc_starts: Tensor | None = None,
    chunk: int = 64,
) -> tuple[Tensor, Tensor]:
    """The chunked gated delta rule of this rank's two segments (q, k (B, H, T_local, Dk), v
    (B, H, T_local, Dv), g (B, H, T_local) or (B, H, T_local, Dk), beta (B, H, T_local),
    doc_starts (B, T_local): this rank's positions of each), exactly as one call on the whole
    sequence: (outputs (B, H, T_local, Dv), the sequence's final state (B, H, Dk, Dv), the same
    on every rank). Inputs fp32."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    half = q.shape[2] // 2
    pieces = [(x[:, :, :half], x[:, :, half:]) for x in (q, k, v, g, beta)]
    docs = (doc_starts[:, :half], doc_starts[:, half:]) if doc_starts is not None else (None, None)
    own = [
        affine_chunk_gated_delta_rule(*(p[i] for p in pieces), doc_starts=docs[i], chunk=chunk)
        for i in (0, 1)
    ]
    Dk = q.shape[-1]
    # (B, 2 segments, H, Dk, Dk + Dv): both segments' (M, b), gathered in one collective
    maps = torch.stack([torch.cat([seg.M, seg.b], dim=-1) for seg in own], dim=1)
    every = gather_sequence(maps, group)  # (B, 2 cp, H, Dk, Dk + Dv) in global segment order
    state = q.new_zeros(every.shape[0], every.shape[2], Dk, v.shape[-1])
    incoming = []  # each segment's incoming state, in global order: S <- M S + b
    for j in range(2 * cp):
        incoming.append(state)
        state = every[:, j, ..., :Dk] @ state + every[:, j, ..., Dk:]
    mine = (rank, 2 * cp - 1 - rank)
    outputs = [seg.o0 + seg.R @ incoming[j] for seg, j in zip(own, mine, strict=True)]
    return torch.cat(outputs, dim=2), state


class ContextSplit:
    """What a model split over the context-parallel group `group` asks per forward
    (model/transformer.py `context_split`): the positions this rank computes, and the attention
    over every rank's keys."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def kept(self, length: int, device: torch.device) -> Tensor | None:
        """This rank's positions of a training forward of `length`; None (the whole sequence on
        every rank, the same numbers) when it does not split into 2 cp chunks."""
        if length % (2 * self.cp):
            return None
        return kept_positions(length, self.cp, self.rank, device)

    def local_length(self, length: int) -> int:
        """The positions this rank computes of a training forward of `length` (`kept`)."""
        return length if length % (2 * self.cp) else length // self.cp

    def total(self, loss: Tensor) -> Tensor:
        """The mean of the ranks' weighted means (0-d, no gradient): the whole sequence's."""
        whole = loss.detach().clone()
        dist.all_reduce(whole, group=self.group)
        return whole / self.cp

    def for_forward(
        self, kept: Tensor, doc_ids: Tensor | None, positions: Tensor, memory_tokens: Tensor | None
    ) -> _SplitForward:
        return _SplitForward(self.group, kept, doc_ids, positions, memory_tokens)


class _SplitForward:
    """One forward's split (AttentionContext.context_parallel): positions `kept` (T_local,);
    the whole row's document ids (B, T) or None, positions within documents (B, T) and the ids
    Engram hashes (B, T) or None (layers that look back over token ids take them whole)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        kept: Tensor,
        doc_ids: Tensor | None,
        positions: Tensor,
        memory_tokens: Tensor | None,
    ) -> None:
        self.group, self.kept, self.doc_ids = group, kept, doc_ids
        self.positions, self.memory_tokens = positions, memory_tokens
        self.cp = dist.get_world_size(group)
        self._masks: dict[int, Tensor] = {}  # window -> visible_keys, shared by the layers

    def attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        window: int,
        scale: float,
        want_max: bool,
        kernel: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """kernel: the Triton FlashAttention kernel (model.attention.backend resolved to triton)
        instead of SDPA with a mask."""
        if kernel:
            return kernel_attention_over_ranks(
                q,
                k,
                v,
                self.group,
                window=window,
                doc_ids=self.doc_ids,
                scale=scale,
                want_max=want_max,
            )
        if window not in self._masks:  # one mask a forward (per window), not one per layer
            length = self.kept.numel() * self.cp
            self._masks[window] = visible_keys(self.kept, length, window, self.doc_ids)
        return attention_over_ranks(
            q,
            k,
            v,
            self.kept,
            self.group,
            window=window,
            doc_ids=self.doc_ids,
            scale=scale,
            want_max=want_max,
            mask=self._masks[window],
        )

    def convolve(self, conv: Callable, x: Tensor, span: int, positions: Tensor | None) -> Tensor:
        """A causal convolution reading `span` positions back (the delta-rule layers' short
        convs, Engram's dilated one) of each chunk, continuing the chunk before it:
        conv(x_chunk, past (B, span, ...), positions_chunk or None) -> y_chunk; x (B, T_local,
        ...)."""
        past = previous_rows(x, span, self.group)
        half = x.shape[1] // 2
        out = []
        for i, part in enumerate((slice(0, half), slice(half, None))):
            where = positions[:, part] if positions is not None else None
            out.append(conv(x[:, part], past[:, i], where))
        return torch.cat(out, dim=1)

    def delta_rule(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, doc_starts, chunk: int
    ) -> tuple[Tensor, Tensor]:
        return delta_rule_over_ranks(q, k, v, g, beta, self.group, doc_starts, chunk)


def context_parallel_refusal(model: nn.Module) -> str | None:
    """Why `model` cannot be split over the sequence (one line naming the fix), or None."""
    kinds = {block.attn.kind for block in model.blocks()}
    unsupported = sorted(kinds - {"gqa", "mla", "gdn", "kda"})
    unsupported += ["alibi positions"] if model.cfg.position == "alibi" else []
    if not unsupported:
        return None
    return (
        f"parallel.cp > 1: context parallelism does not split {', '.join(unsupported)} yet; "
        "use model.position=rope, or parallel.cp=1"
    )


def apply_context_parallel(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Split `model`'s training forwards over the ranks of `group` (each rank reads the whole
    rows; the loss each returns is its weighted mean: their average is one process's loss, and
    averaging the weights' gradients over the group, as FSDP2 does over data-parallel ranks,
    gives its gradients). Layers that look across positions in another way than softmax
    attention and the delta rule are refused (ConfigError)."""
    if problem := context_parallel_refusal(model):
        raise ConfigError(problem)
    model.context_split = ContextSplit(group)
