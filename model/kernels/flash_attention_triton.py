"""Triton kernels of FlashAttention-2 (forward with the per-row max logit, backward), imported only
when `model.kernels.flash_attention` runs them: CPU installs never import triton at module load.

Layout: q, o, dq (B, Hq, T, D); k, v, dk, dv (B, Hkv, T, D), Hq = G Hkv (GQA: query head h reads
kv head h // G, nothing repeated); D a power of two. Per (batch, head): lse and max (T,) fp32.
Online softmax in the natural-log domain, fp32 accumulators. `_fwd` keeps m_i, the running max of
softmax_scale q.k over the keys a row may see: its final value is the row's max logit (QK-clip's
statistic), stored beside the log-sum-exp the backward needs. `_bwd_kv` walks the query blocks of
one key block (every query head of its group); `_bwd_q` the key blocks of one query block.
"""

import triton
import triton.language as tl


@triton.jit
def _load_rows(ptr, idx, stride_t, offs_d, T):
    """(len(idx), D) rows idx of one (batch, head) slice at `ptr`, zeros past T."""
    return tl.load(
        ptr + idx[:, None] * stride_t + offs_d[None, :], mask=idx[:, None] < T, other=0.0
    )


@triton.jit
def _allowed(rows, cols, T, CAUSAL: tl.constexpr):
    """(rows, cols) bool: the keys inside the sequence (and not after the row when causal);
    rows past T are not stored, and keep a key each so that their softmax stays finite."""
    valid = cols[None, :] < T
    if CAUSAL:
        valid = valid & (rows[:, None] >= cols[None, :])
    return valid


@triton.jit
def _probs_and_score_grads(q, k, v, do, lse, delta, rows, cols, sm_scale, T, CAUSAL: tl.constexpr):
    """The backward's recomputed probabilities P and dS = P (dP - delta) scale for one block."""
    s = tl.dot(q, tl.trans(k)) * sm_scale
    valid = _allowed(rows, cols, T, CAUSAL) & (rows[:, None] < T)
    p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v))
    return p, p * (dp - delta[:, None]) * sm_scale


@triton.jit
def _fwd(
    Q,
    K,
    V,
    OUT,
    LSE,
    MAX,
    sm_scale,
    T,
    HQ,
    GROUP,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    svb,
    svh,
    svt,
    sob,
    soh,
    sot,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = _load_rows(Q + b * sqb + h * sqh, offs_m, sqt, offs_d, T)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    hi = T
    if CAUSAL:
        hi = tl.minimum((pid_m + 1) * BLOCK_M, T)
    for start in range(0, hi, BLOCK_N):
        cols = start + offs_n
        k = _load_rows(K + b * skb + hk * skh, cols, skt, offs_d, T)
        v = _load_rows(V + b * svb + hk * svh, cols, svt, offs_d, T)
        s = tl.dot(q, tl.trans(k)) * sm_scale
        s = tl.where(_allowed(offs_m, cols, T, CAUSAL), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    o = acc / l_i[:, None]
    rows = offs_m < T
    tl.store(
        OUT + b * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :],
        o.to(OUT.dtype.element_ty),
        mask=rows[:, None],
    )
    tl.store(LSE + pid_bh * T + offs_m, m_i + tl.log(l_i), mask=rows)
    tl.store(MAX + pid_bh * T + offs_m, m_i, mask=rows)


@triton.jit
def _bwd_kv(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    sm_scale,
    T,
    HQ,
    GROUP,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """One key block of one kv head: dK, dV summed over the group's query heads."""
    pid_n = tl.program_id(0)
    pid_bk = tl.program_id(1)
    HKV = HQ // GROUP
    b = pid_bk // HKV
    hk = pid_bk % HKV
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    kmask = cols[:, None] < T
    k = _load_rows(K + b * skb + hk * skh, cols, skt, offs_d, T)
    v = _load_rows(V + b * skb + hk * skh, cols, skt, offs_d, T)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    lo = 0
    if CAUSAL:
        lo = pid_n * BLOCK_N // BLOCK_M * BLOCK_M
    for g in range(0, GROUP):
        h = hk * GROUP + g
        for start in range(lo, T, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            q = _load_rows(Q + b * sqb + h * sqh, rows, sqt, offs_d, T)
            do = _load_rows(DO + b * sqb + h * sqh, rows, sqt, offs_d, T)
            lse = tl.load(LSE + (b * HQ + h) * T + rows, mask=rows < T, other=0.0)
            delta = tl.load(DELTA + (b * HQ + h) * T + rows, mask=rows < T, other=0.0)
            p, ds = _probs_and_score_grads(q, k, v, do, lse, delta, rows, cols, sm_scale, T, CAUSAL)
            dv += tl.dot(tl.trans(p), do)
            dk += tl.dot(tl.trans(ds), q)
    tl.store(DK + b * skb + hk * skh + cols[:, None] * skt + offs_d[None, :], dk, mask=kmask)
    tl.store(DV + b * skb + hk * skh + cols[:, None] * skt + offs_d[None, :], dv, mask=kmask)


@triton.jit
def _bwd_q(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    sm_scale,
    T,
    HQ,
    GROUP,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    hk = h // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    qmask = rows[:, None] < T
    q = _load_rows(Q + b * sqb + h * sqh, rows, sqt, offs_d, T)
    do = _load_rows(DO + b * sqb + h * sqh, rows, sqt, offs_d, T)
    lse = tl.load(LSE + pid_bh * T + rows, mask=rows < T, other=0.0)
    delta = tl.load(DELTA + pid_bh * T + rows, mask=rows < T, other=0.0)
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    hi = T
    if CAUSAL:
        hi = tl.minimum((pid_m + 1) * BLOCK_M, T)
    for start in range(0, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = _load_rows(K + b * skb + hk * skh, cols, skt, offs_d, T)
        v = _load_rows(V + b * skb + hk * skh, cols, skt, offs_d, T)
        _, ds = _probs_and_score_grads(q, k, v, do, lse, delta, rows, cols, sm_scale, T, CAUSAL)
        dq += tl.dot(ds, k)
    tl.store(DQ + b * sqb + h * sqh + rows[:, None] * sqt + offs_d[None, :], dq, mask=qmask)
