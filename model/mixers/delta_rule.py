"""The gated delta rule (Gated DeltaNet, Yang et al. 2024, arXiv 2412.06464) in pure torch: a
chunked parallel form for training and prefill, and a recurrent form for decoding. The decay is
one per head (Gated DeltaNet) or one per key channel (Kimi Delta Attention, arXiv 2510.26692:
S_t = Diag(exp(g_t)) S_{t-1} before the same delta update).

Shapes: B batch, H value heads, T tokens, Dk / Dv key / value head dims, C chunk length.
Inputs are prepared by the layer: q, k (B, H, T, Dk) L2-normalized (q also scaled by Dk^-1/2),
v (B, H, T, Dv), log-decay g (B, H, T) <= 0, beta (B, H, T); all fp32. Per head, with the state
S (Dk, Dv):
    S_t = exp(g_t) S_{t-1};   S_t += k_t (beta_t (v_t - S_t^T k_t))^T;   o_t = S_t^T q_t

Chunked form (per chunk, gamma = in-chunk cumsum of g, Gamma_rs = exp(gamma_r - gamma_s) for
s <= r in the same document, else 0):
    T = (I + strict_tril(K_beta K^T * Gamma))^-1      the WY/UT transform (a unit-triangular solve)
    U = T V_beta,   W = T (K_beta * exp(gamma))
    V' = U - W S;   O = (Q * exp(gamma)) S + (Q K^T * Gamma) V';   S <- exp(gamma_C) S + (K * exp(gamma_C - gamma))^T V'
The scan over chunks is sequential; everything inside a chunk is matmuls. Padding T up to a
multiple of C with k = v = beta = g = 0 changes nothing, so results do not depend on C.

A segment of a longer sequence whose incoming state S0 is not known yet (context parallelism:
each rank holds a segment) is affine in S0: o = o0 + R S0, final = M S0 + b
(`affine_chunk_gated_delta_rule`); the segments' (M, b) passed on in order give each its S0
(`combine_segments`), and the result equals one call on the whole sequence.

Packed documents (`doc_starts` (B, T) bool): the state is zero before every document's first
token. In the chunked form, pairs across documents are masked out of Gamma, the incoming state
reaches only the chunk's positions before its first document start, and the outgoing state
keeps only the chunk's last document.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor


def recurrent_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor | None = None,
    doc_starts: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Token by token: (o (B, H, T, Dv), final state (B, H, Dk, Dv)). g (B, H, T) decays each
    head's state, g (B, H, T, Dk) each key channel (row of S)."""
    B, H, T, Dk = q.shape
    S = q.new_zeros(B, H, Dk, v.shape[-1]) if state is None else state
    outputs = []
    for t in range(T):
        decay = g[:, :, t].exp()  # (B, H) or (B, H, Dk)
        if decay.dim() == 2:
            decay = decay[..., None]
        if doc_starts is not None:
            decay = decay * (~doc_starts[:, t]).to(decay.dtype)[:, None, None]
        S = S * decay[..., None]
        k_t = k[:, :, t]
        read = (S * k_t[..., None]).sum(-2)  # S^T k: (B, H, Dv)
        delta = (v[:, :, t] - read) * beta[:, :, t, None]
        S = S + k_t[..., None] * delta[..., None, :]
        outputs.append((S * q[:, :, t, :, None]).sum(-2))
    return torch.stack(outputs, dim=2), S


def _pad_time(x: Tensor, pad: int) -> Tensor:
    """Zeros appended on the time axis (dim 2)."""
    if not pad:
        return x
    widths = [0, 0] * (x.dim() - 3) + [0, pad]
    return F.pad(x, widths)


SUB_CHUNK = 16  # per-channel decay: explicit (sub x sub x Dk) decay only within sub-chunks


def _pair_products(a: Tensor, b: Tensor, gamma: Tensor, allowed: Tensor) -> tuple[Tensor, Tensor]:
    """(a_r . b_s Gamma_rs for every pair (r, s) of a chunk, exp(gamma)). gamma (..., C) is one
    log-decay per head (Gated DeltaNet) or (..., C, Dk) one per key channel (KDA), where
    Gamma_rs = exp(gamma_r - gamma_s) weights each channel of the dot product."""
    if gamma.dim() == a.dim() - 1:  # per head: a scalar weight per pair
        diff = gamma[..., :, None] - gamma[..., None, :]
        decay = torch.exp(diff.masked_fill(~allowed, -torch.inf))
        return (a @ b.transpose(-1, -2)) * decay, gamma.exp()[..., None]
    return _channel_pair_products(a, b, gamma).masked_fill(~allowed, 0.0), gamma.exp()


def _channel_pair_products(a: Tensor, b: Tensor, gamma: Tensor) -> Tensor:
    """sum_d a_rd b_sd exp(gamma_rd - gamma_sd) for s <= r (0 above the diagonal): a, b, gamma
    (..., C, Dk) -> (..., C, C), without the (C, C, Dk) decay tensor of the direct form.

    The chunk is cut into M sub-chunks of c tokens. Within a sub-chunk the decay is explicit
    (..., M, c, c, Dk). A pair across sub-chunks (s before the start t_i of r's sub-chunk i)
    factors through t_i: exp(gamma_r - gamma_t) exp(gamma_t - gamma_s), both factors <= 1
    (gamma falls over time), so it is a matmul of scaled rows that cannot overflow; b is scaled
    once per sub-chunk i, (..., M, C, Dk). Memory C Dk (c + M) instead of C^2 Dk."""
    *lead, C, D = a.shape
    c = next(size for size in (SUB_CHUNK, 8, 4, 2, 1) if C % size == 0)
    M = C // c
    a_, b_, g_ = (x.reshape(*lead, M, c, D) for x in (a, b, gamma))
    within = torch.ones(c, c, dtype=torch.bool, device=a.device).tril()
    diff = g_[..., :, None, :] - g_[..., None, :, :]  # (..., M, c, c, D)
    decay = torch.exp(diff.masked_fill(~within[..., None], -torch.inf))
    diagonal = torch.einsum("...mrd,...msd,...mrsd->...mrs", a_, b_, decay)  # (..., M, c, c)
    start = g_[..., :, :1, :]  # (..., M, 1, D): gamma at each sub-chunk's first token
    a_scaled = a_ * torch.exp(g_ - start)  # (..., M, c, D)
    position = torch.arange(C, device=a.device)
    before = position[None, :] < (position[::c][:, None])  # (M, C): s before sub-chunk i
    exponent = (start - gamma[..., None, :, :]).masked_fill(~before[..., None], -torch.inf)
    b_scaled = b[..., None, :, :] * torch.exp(exponent)  # (..., M, C, D)
    across = a_scaled @ b_scaled.transpose(-1, -2)  # (..., M, c, C)
    eye = torch.eye(M, dtype=a.dtype, device=a.device)
    placed = torch.einsum("...mrs,mn->...mrns", diagonal, eye).reshape(*lead, M, c, C)
    return (across + placed).reshape(*lead, C, C)


class ChunkTerms(NamedTuple):
    """The per-chunk tensors of the chunked form (module docstring), N chunks of C tokens:
    U (B, H, N, C, Dv), W and q_in (B, H, N, C, Dk), intra (B, H, N, C, C), k_out (B, H, N, C,
    Dk), keep (B, H, N, 1 | Dk, 1): the incoming state's decay over the chunk (per head or key
    channel; 0 where a document starts inside the chunk)."""

    U: Tensor
    W: Tensor
    q_in: Tensor
    intra: Tensor
    k_out: Tensor
    keep: Tensor


def chunk_terms(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, doc_starts: Tensor | None, chunk: int
) -> ChunkTerms:
    """Everything inside the chunks (matmuls and the triangular solves), before the scan."""
    B, H, T, Dk = q.shape
    per_channel = g.dim() == 4
    pad = (-T) % chunk
    q, k, v = (_pad_time(x, pad) for x in (q, k, v))
    g = _pad_time(g, pad) if per_channel else F.pad(g, (0, pad))
    beta = F.pad(beta, (0, pad))
    N, C = (T + pad) // chunk, chunk
    q, k, v = (x.reshape(B, H, N, C, -1) for x in (q, k, v))
    g = g.reshape(B, H, N, C, Dk) if per_channel else g.reshape(B, H, N, C)
    beta = beta.reshape(B, H, N, C)

    gamma = g.cumsum(3)  # log-decay from the chunk start: (B, H, N, C) or (B, H, N, C, Dk)
    gamma_last = gamma[:, :, :, -1:]
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # s <= r
    allowed = lower
    carry = last = None
    if doc_starts is not None:
        starts = F.pad(doc_starts, (0, pad)).reshape(B, 1, N, C)
        document = starts.cumsum(-1)  # (B, 1, N, C) documents started so far in the chunk
        allowed = lower & (document[..., :, None] == document[..., None, :])
        carry = document == 0  # positions before the chunk's first document start
        last = document == document[..., -1:]  # the chunk's last document

    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # unit lower-triangular system: the diagonal is implied (unitriangular), the rest is strict
    system, exp_gamma = _pair_products(k_beta, k, gamma, allowed)
    intra, _ = _pair_products(q, k, gamma, allowed)  # (B, H, N, C, C), diagonal included
    U = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(system, k_beta * exp_gamma, upper=False, unitriangular=True)
    q_in = q * exp_gamma  # reads the incoming state
    out_decay = (gamma_last - gamma).exp()
    k_out = k * (out_decay if per_channel else out_decay[..., None])  # writes the outgoing state
    # the incoming state's decay over the chunk: per head (B, H, N, 1, 1) or channel (.., Dk, 1)
    keep = gamma_last.exp().reshape(B, H, N, -1, 1)
    if doc_starts is not None:
        W, q_in = W * carry[..., None], q_in * carry[..., None]
        k_out = k_out * last[..., None]
        keep = (
            keep * carry[..., -1, None, None]
        )  # a document start inside the chunk ends the old state
    return ChunkTerms(U, W, q_in, intra, k_out, keep)


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor | None = None,
    doc_starts: Tensor | None = None,
    chunk: int = 64,
) -> tuple[Tensor, Tensor]:
    """Chunk by chunk: the same (o, final state) as `recurrent_gated_delta_rule`. g (B, H, T)
    decays each head's state (Gated DeltaNet), g (B, H, T, Dk) each key channel (KDA)."""
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    terms = chunk_terms(q, k, v, g, beta, doc_starts, chunk)
    U, W, q_in, intra, k_out, keep = terms
    N, C = U.shape[2], U.shape[3]
    S = q.new_zeros(B, H, Dk, Dv) if state is None else state
    outputs = []
    for n in range(N):
        new_v = U[:, :, n] - W[:, :, n] @ S  # (B, H, C, Dv) what the state does not predict
        outputs.append(q_in[:, :, n] @ S + intra[:, :, n] @ new_v)
        S = S * keep[:, :, n] + k_out[:, :, n].transpose(-1, -2) @ new_v
    o = torch.stack(outputs, dim=2).reshape(B, H, N * C, Dv)[:, :, :T]
    return o, S


class AffineDeltaRule(NamedTuple):
    """A segment's outputs and final state as affine maps of its incoming state S0 (B, H, Dk,
    Dv): o = o0 + R S0 (R (B, H, T, Dk)), final = M S0 + b (M (B, H, Dk, Dk), b (B, H, Dk, Dv))."""

    o0: Tensor
    R: Tensor
    M: Tensor
    b: Tensor


def affine_chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    doc_starts: Tensor | None = None,
    chunk: int = 64,
) -> AffineDeltaRule:
    """The chunked form of one segment of a longer sequence whose incoming state is not known
    yet (context parallelism: fla's KCP). Per chunk n, with S_n = A_n S0 + c_n (A_0 = I, c_0 =
    0) and P_n = q_in - intra W, G_n = diag(keep) - k_out^T W:
        out_n = P_n S_n + intra U_n,   S_{n+1} = G_n S_n + k_out^T U_n
    so o0 = P c + intra U, R = P A, M = A_N, b = c_N. Once the segments before it are done, S0 is
    their combined final state, and o0 + R S0 equals `chunk_gated_delta_rule` on the whole
    sequence (a document starting in the segment cuts S0 off where it should: W, q_in and keep
    carry the document masks). The A chain adds one (Dk, Dk) product per chunk; keep the inputs
    fp32 (the M chain multiplies decays over the whole segment)."""
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    U, W, q_in, intra, k_out, keep = chunk_terms(q, k, v, g, beta, doc_starts, chunk)
    N, C = U.shape[2], U.shape[3]
    A = torch.eye(Dk, dtype=q.dtype, device=q.device).expand(B, H, Dk, Dk)
    c = q.new_zeros(B, H, Dk, Dv)
    outputs, reads = [], []
    for n in range(N):
        P = q_in[:, :, n] - intra[:, :, n] @ W[:, :, n]  # (B, H, C, Dk)
        outputs.append(P @ c + intra[:, :, n] @ U[:, :, n])
        reads.append(P @ A)
        k_t = k_out[:, :, n].transpose(-1, -2)  # (B, H, Dk, C)
        A = A * keep[:, :, n] - k_t @ (W[:, :, n] @ A)
        c = c * keep[:, :, n] + k_t @ (U[:, :, n] - W[:, :, n] @ c)
    o0 = torch.stack(outputs, dim=2).reshape(B, H, N * C, Dv)[:, :, :T]
    R = torch.stack(reads, dim=2).reshape(B, H, N * C, Dk)[:, :, :T]
    return AffineDeltaRule(o0, R, A, c)


def combine_segments(
    segments: list[AffineDeltaRule], state: Tensor | None = None
) -> tuple[list[Tensor], Tensor]:
    """Consecutive segments of one sequence, each from `affine_chunk_gated_delta_rule`: their
    outputs and the final state, as one call on the whole sequence gives them (the incoming
    state passed on in order: S <- M S + b)."""
    first = segments[0]
    B, H, Dk, Dv = first.b.shape
    S = first.b.new_zeros(B, H, Dk, Dv) if state is None else state
    outputs = []
    for segment in segments:
        outputs.append(segment.o0 + segment.R @ S)
        S = segment.M @ S + segment.b
    return outputs, S
