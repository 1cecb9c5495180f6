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
    q = tl.load(
        Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :],
        mask=offs_m[:, None] < T,
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    hi = T
    if CAUSAL:
        hi = tl.minimum((pid_m + 1) * BLOCK_M, T)
    for start in range(0, hi, BLOCK_N):
        cols = start + offs_n
        k = tl.load(
            K + b * skb + hk * skh + cols[:, None] * skt + offs_d[None, :],
            mask=cols[:, None] < T,
            other=0.0,
        )
        v = tl.load(
            V + b * svb + hk * svh + cols[:, None] * svt + offs_d[None, :],
            mask=cols[:, None] < T,
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k)) * sm_scale
        valid = cols[None, :] < T
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= cols[None, :])
        s = tl.where(valid, s, float("-inf"))
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
    k = tl.load(
        K + b * skb + hk * skh + cols[:, None] * skt + offs_d[None, :], mask=kmask, other=0.0
    )
    v = tl.load(
        V + b * skb + hk * skh + cols[:, None] * skt + offs_d[None, :], mask=kmask, other=0.0
    )
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    lo = 0
    if CAUSAL:
        lo = pid_n * BLOCK_N // BLOCK_M * BLOCK_M
    for g in range(0, GROUP):
        h = hk * GROUP + g
        for start in range(lo, T, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            qmask = rows[:, None] < T
            q = tl.load(
                Q + b * sqb + h * sqh + rows[:, None] * sqt + offs_d[None, :], mask=qmask, other=0.0
            )
            do = tl.load(
                DO + b * sqb + h * sqh + rows[:, None] * sqt + offs_d[None, :],
                mask=qmask,
                other=0.0,
            )
            lse = tl.load(LSE + (b * HQ + h) * T + rows, mask=rows < T, other=0.0)
            delta = tl.load(DELTA + (b * HQ + h) * T + rows, mask=rows < T, other=0.0)
            s = tl.dot(q, tl.trans(k)) * sm_scale
            valid = (rows[:, None] < T) & (cols[None, :] < T)
            if CAUSAL:
                valid = valid & (rows[:, None] >= cols[None, :])
            p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
            dv += tl.dot(tl.trans(p), do)
            dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - delta[:, None]) * sm_scale
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
    q = tl.load(
        Q + b * sqb + h * sqh + rows[:, None] * sqt + offs_d[None, :], mask=qmask, other=0.0
    )
    do = tl.load(
        DO + b * sqb + h * sqh + rows[:, None] * sqt + offs_d[None, :], mask=qmask, other=0.0
    )
    lse = tl.load(LSE + pid_bh * T + rows, mask=rows < T, other=0.0)
    delta = tl.load(DELTA + pid_bh * T + rows, mask=rows < T, other=0.0)
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    hi = T
    if CAUSAL:
        hi = tl.minimum((pid_m + 1) * BLOCK_M, T)
    for start in range(0, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        kmask = cols[:, None] < T
        k = tl.load(
            K + b * skb + hk * skh + cols[:, None] * skt + offs_d[None, :], mask=kmask, other=0.0
        )
        v = tl.load(
            V + b * skb + hk * skh + cols[:, None] * skt + offs_d[None, :], mask=kmask, other=0.0
        )
        s = tl.dot(q, tl.trans(k)) * sm_scale
        valid = (rows[:, None] < T) & (cols[None, :] < T)
        if CAUSAL:
            valid = valid & (rows[:, None] >= cols[None, :])
        p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None]) * sm_scale
        dq += tl.dot(ds, k)
    tl.store(DQ + b * sqb + h * sqh + rows[:, None] * sqt + offs_d[None, :], dq, mask=qmask)
