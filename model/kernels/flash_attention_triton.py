"""Triton kernels of FlashAttention-2 (forward with the per-row max logit, backward), imported only
when `model.kernels.flash_attention` runs them: CPU installs never import triton at module load.

Layout: q, o, dq (B, Hq, T, Dqk|Dv); k, dk (B, Hkv, n_keys, Dqk); v, dv (B, Hkv, n_keys, Dv);
any strides with the last dim contiguous. Hq = G Hkv (GQA: query head h reads kv head h // G,
nothing repeated). Head dims need not be powers of two: they are padded to BD_QK, BD_V (masked
loads). Per (batch, query head): lse2 and max (T,) fp32.

Rows and keys: T query rows, n_keys >= T keys (n_keys == T unless CAUSAL). Row r sits at key
position r + n_keys - T (bottom-right alignment: the rows are the last T positions of the keys,
as a context-parallel chunk whose keys start at position 0); with n_keys == T that offset is 0.
Key c is visible to row r iff c < n_keys, c <= r + offset (CAUSAL), and c >= FK[b, r] (BOUNDED:
the first visible key of each row, a key position, nondecreasing in r; packed documents and
sliding windows both reduce to it under causal masking). LR[b, c] (c < n_keys), the last row that
may see key c, is its mirror for the backward over keys. Loops visit only the blocks that hold
visible keys, and apply the mask only on the blocks where it can remove something (the causal
diagonal, the rows' first keys, the end of the sequence).

Online softmax in the base-2 domain (exp2; scores scaled by softmax_scale log2(e)), fp32
accumulators. `_fwd` keeps m_i, the running row max: m_i ln 2 is the row's max of softmax_scale
q.k over its visible keys, QK-clip's statistic, stored beside the base-2 log-sum-exp the backward
needs. `_bwd_kv` walks the query blocks of one key block (every query head of its group); `_bwd_q`
the key blocks of one query block.
"""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _load_rows(ptr, idx, stride_t, offs_d, T, D: tl.constexpr):
    """(len(idx), BD) rows idx of one (batch, head) slice at `ptr`; zeros past T and past D."""
    mask = (idx[:, None] < T) & (offs_d[None, :] < D)
    return tl.load(ptr + idx[:, None] * stride_t + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """a @ b with fp32 accumulation. PRECISION "upcast" (bf16/fp16 under the interpreter, whose
    numpy dot misreads 16-bit floats) multiplies fp32 copies of the operands."""
    if PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _visible(pos, cols, first_keys, n_keys, CAUSAL: tl.constexpr, BOUNDED: tl.constexpr):
    """(rows, cols) bool for the rows at key positions `pos`: key inside the sequence, not after
    the row (causal), not before the row's first key (bounded). Rows past T keep their keys:
    their softmax stays finite."""
    ok = cols[None, :] < n_keys
    if CAUSAL:
        ok = ok & (pos[:, None] >= cols[None, :])
    if BOUNDED:
        ok = ok & (cols[None, :] >= first_keys[:, None])
    return ok


@triton.jit
def _first_keys(FK, rows, T, BOUNDED: tl.constexpr):
    """(len(rows),) int32 first visible key of each row (0 without bounds)."""
    if BOUNDED:
        return tl.load(FK + rows, mask=rows < T, other=0)
    return tl.zeros_like(rows)


@triton.jit
def _key_ranges(fk_ptr, m0, T, n_keys, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, BOUNDED: tl.constexpr):  # fmt: skip
    """The key blocks of query block [m0, m0 + BLOCK_M): [lo, mid) masked (the rows' first
    keys), [mid, diag) whole, [diag, hi) masked (the causal diagonal, the end of the sequence).
    The block's first row sits at key position p0 = m0 + n_keys - T: keys before p0 (rounded
    down to a key block, so that [mid, diag) holds whole blocks) are before every row."""
    lo = 0
    mid = 0
    diag = n_keys // BLOCK_N * BLOCK_N
    hi = n_keys
    if CAUSAL:
        p0 = m0 + n_keys - T
        diag = p0 // BLOCK_N * BLOCK_N
        hi = tl.minimum(p0 + BLOCK_M, n_keys)
        if BOUNDED:  # keys before the block's smallest first key are never visible
            lo = tl.load(fk_ptr + m0) // BLOCK_N * BLOCK_N
            last = tl.load(fk_ptr + tl.minimum(m0 + BLOCK_M, T) - 1)  # the largest first key
            mid = tl.minimum((last + BLOCK_N - 1) // BLOCK_N * BLOCK_N, diag)
    return lo, mid, diag, hi


@triton.jit
def _fwd_keys(
    acc, l_i, m_i, q, k_ptr, v_ptr, skt, svt, pos, first_keys, lo, hi, qk_scale, n_keys,
    offs_dqk, offs_dv, D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BOUNDED: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Online-softmax update of one query block (rows at key positions pos) with the key blocks
    in [lo, hi)."""
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = _load_rows(k_ptr, cols, skt, offs_dqk, n_keys, D_QK)
        v = _load_rows(v_ptr, cols, svt, offs_dv, n_keys, D_V)
        s = _dot(q, tl.trans(k), PRECISION) * qk_scale  # (BM, BN) base 2
        if MASKED:
            ok = _visible(pos, cols, first_keys, n_keys, CAUSAL, BOUNDED)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key seen yet
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd(
    Q, K, V, OUT, LSE2, MAX, FK, sm_scale, T, n_keys, HQ, GROUP,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
    D_QK: tl.constexpr, D_V: tl.constexpr, BD_QK: tl.constexpr, BD_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    BOUNDED: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One query block of one (batch, query head). BLOCK_M is a multiple of BLOCK_N."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)  # int64 offsets: B H T D may pass 2^31
    b = pid_bh // HQ
    h = pid_bh % HQ
    hk = h // GROUP
    m0 = pid_m * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    pos = rows + (n_keys - T)  # the rows' key positions
    offs_dqk = tl.arange(0, BD_QK)
    offs_dv = tl.arange(0, BD_V)
    qk_scale = sm_scale * 1.4426950408889634  # log2(e): exp2 below
    q = _load_rows(Q + b * sqb + h * sqh, rows, sqt, offs_dqk, T, D_QK)
    fk_ptr = FK + b * T
    first_keys = _first_keys(fk_ptr, rows, T, BOUNDED)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BD_V], tl.float32)
    k_ptr = K + b * skb + hk * skh
    v_ptr = V + b * svb + hk * svh
    lo, mid, diag, hi = _key_ranges(fk_ptr, m0, T, n_keys, BLOCK_M, BLOCK_N, CAUSAL, BOUNDED)
    acc, l_i, m_i = _fwd_keys(
        acc, l_i, m_i, q, k_ptr, v_ptr, skt, svt, pos, first_keys, lo, mid, qk_scale, n_keys,
        offs_dqk, offs_dv, D_QK, D_V, BLOCK_N, True, CAUSAL, BOUNDED, PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_keys(
        acc, l_i, m_i, q, k_ptr, v_ptr, skt, svt, pos, first_keys, mid, diag, qk_scale, n_keys,
        offs_dqk, offs_dv, D_QK, D_V, BLOCK_N, False, CAUSAL, BOUNDED, PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_keys(
        acc, l_i, m_i, q, k_ptr, v_ptr, skt, svt, pos, first_keys, diag, hi, qk_scale, n_keys,
        offs_dqk, offs_dv, D_QK, D_V, BLOCK_N, True, CAUSAL, BOUNDED, PRECISION,
    )  # fmt: skip
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # rows past T only
    o = acc / l_safe[:, None]
    in_seq = rows < T
    tl.store(
        OUT + b * sob + h * soh + rows[:, None] * sot + offs_dv[None, :],
        o.to(OUT.dtype.element_ty),
        mask=in_seq[:, None] & (offs_dv[None, :] < D_V),
    )
    tl.store(LSE2 + pid_bh * T + rows, m_i + tl.math.log2(l_safe), mask=in_seq)
    tl.store(MAX + pid_bh * T + rows, m_i * 0.6931471805599453, mask=in_seq)  # ln 2: natural


@triton.jit
def _bwd_kv_rows(
    dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, FK, sqt, sot, cols, lo, hi, qk_scale, T,
    n_keys, offs_dqk, offs_dv, D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_M: tl.constexpr,
    BOUNDED: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dK, dV (unscaled dK) of one key block from the query blocks in [lo, hi) of one head."""
    for start in range(lo, hi, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        q = _load_rows(q_ptr, rows, sqt, offs_dqk, T, D_QK)
        do = _load_rows(do_ptr, rows, sot, offs_dv, T, D_V)
        lse2 = tl.load(lse_ptr + rows, mask=rows < T, other=0.0)
        delta = tl.load(delta_ptr + rows, mask=rows < T, other=0.0)
        s_t = _dot(k, tl.trans(q), PRECISION) * qk_scale  # (BN, BM) keys x rows
        p_t = tl.math.exp2(s_t - lse2[None, :])
        if MASKED:
            first_keys = _first_keys(FK, rows, T, BOUNDED)
            pos = rows + (n_keys - T)
            seen = _visible(pos, cols, first_keys, n_keys, CAUSAL, BOUNDED) & (rows[:, None] < T)
            p_t = tl.where(tl.trans(seen), p_t, 0.0)
        dv += _dot(p_t.to(do.dtype), do, PRECISION)
        dp_t = _dot(v, tl.trans(do), PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += _dot(ds_t.to(q.dtype), q, PRECISION)
    return dk, dv


@triton.jit
def _bwd_kv(
    Q, K, V, DO, LSE2, DELTA, DK, DV, FK, LR, sm_scale, T, n_keys, HQ, GROUP,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
    sdkb, sdkh, sdkt, sdvb, sdvh, sdvt,
    D_QK: tl.constexpr, D_V: tl.constexpr, BD_QK: tl.constexpr, BD_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    BOUNDED: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One key block of one kv head: dK, dV summed over the group's query heads. BLOCK_N is a
    multiple of BLOCK_M. (sob, soh, sot) are DO's strides; DK and DV have their own."""
    pid_n = tl.program_id(0)
    pid_bk = tl.program_id(1).to(tl.int64)  # int64 offsets: B H T D may pass 2^31
    HKV = HQ // GROUP
    b = pid_bk // HKV
    hk = pid_bk % HKV
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BD_QK)
    offs_dv = tl.arange(0, BD_V)
    qk_scale = sm_scale * 1.4426950408889634
    k = _load_rows(K + b * skb + hk * skh, cols, skt, offs_dqk, n_keys, D_QK)
    v = _load_rows(V + b * svb + hk * svh, cols, svt, offs_dv, n_keys, D_V)
    dk = tl.zeros([BLOCK_N, BD_QK], tl.float32)
    dv = tl.zeros([BLOCK_N, BD_V], tl.float32)
    fk_ptr = FK + b * T
    # row blocks [first, diag_end) masked (the causal diagonal), [diag_end, full) whole,
    # [full, hi) masked (rows that see part of the block, the end of the sequence). Row r sits
    # at key position r + offset; both ends are rounded to row blocks (clamped at 0 first: the
    # rows of a key block before the offset start at row 0)
    offset = n_keys - T
    if CAUSAL:
        first = tl.maximum(n0 - offset, 0) // BLOCK_M * BLOCK_M  # earlier rows see none
        key_end = tl.minimum(n0 + BLOCK_N, n_keys)
        diag_end = tl.maximum(n0 + BLOCK_N - offset + BLOCK_M - 1, 0) // BLOCK_M * BLOCK_M
        diag_end = tl.minimum(diag_end, T)  # rows from here on sit after the block's last key
        full = T // BLOCK_M * BLOCK_M
        hi = T
        if BOUNDED:  # rows after the last one that sees the block's first (last) key
            full = (tl.load(LR + b * n_keys + n0) + 1) // BLOCK_M * BLOCK_M
            hi = tl.load(LR + b * n_keys + key_end - 1) + 1
        full = tl.maximum(full, diag_end)
        hi = tl.maximum(hi, full)
    else:  # no diagonal
        first = 0
        diag_end = 0
        full = T // BLOCK_M * BLOCK_M
        hi = T
    for g in range(0, GROUP):
        h = hk * GROUP + g
        q_ptr = Q + b * sqb + h * sqh
        do_ptr = DO + b * sob + h * soh
        lse_ptr = LSE2 + (b * HQ + h) * T
        delta_ptr = DELTA + (b * HQ + h) * T
        dk, dv = _bwd_kv_rows(
            dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, fk_ptr, sqt, sot, cols, first,
            diag_end, qk_scale, T, n_keys, offs_dqk, offs_dv, D_QK, D_V, BLOCK_M, BOUNDED, True,
            CAUSAL, PRECISION,
        )  # fmt: skip
        dk, dv = _bwd_kv_rows(
            dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, fk_ptr, sqt, sot, cols, diag_end,
            full, qk_scale, T, n_keys, offs_dqk, offs_dv, D_QK, D_V, BLOCK_M, BOUNDED, False,
            CAUSAL, PRECISION,
        )  # fmt: skip
        dk, dv = _bwd_kv_rows(
            dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, fk_ptr, sqt, sot, cols, full, hi,
            qk_scale, T, n_keys, offs_dqk, offs_dv, D_QK, D_V, BLOCK_M, BOUNDED, True, CAUSAL,
            PRECISION,
        )  # fmt: skip
    kmask = (cols[:, None] < n_keys) & (offs_dqk[None, :] < D_QK)
    vmask = (cols[:, None] < n_keys) & (offs_dv[None, :] < D_V)
    dk_ptr = DK + b * sdkb + hk * sdkh + cols[:, None] * sdkt + offs_dqk[None, :]
    dv_ptr = DV + b * sdvb + hk * sdvh + cols[:, None] * sdvt + offs_dv[None, :]
    tl.store(dk_ptr, (dk * sm_scale).to(DK.dtype.element_ty), mask=kmask)
    tl.store(dv_ptr, dv.to(DV.dtype.element_ty), mask=vmask)


@triton.jit
def _bwd_q_keys(
    dq, q, do, lse2, delta, k_ptr, v_ptr, skt, svt, pos, first_keys, lo, hi, qk_scale, n_keys,
    offs_dqk, offs_dv, D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BOUNDED: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dQ (unscaled) of one query block (rows at key positions pos) from the key blocks in
    [lo, hi)."""
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = _load_rows(k_ptr, cols, skt, offs_dqk, n_keys, D_QK)
        v = _load_rows(v_ptr, cols, svt, offs_dv, n_keys, D_V)
        s = _dot(q, tl.trans(k), PRECISION) * qk_scale
        p = tl.math.exp2(s - lse2[:, None])
        if MASKED:
            p = tl.where(_visible(pos, cols, first_keys, n_keys, CAUSAL, BOUNDED), p, 0.0)
        dp = _dot(do, tl.trans(v), PRECISION)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, PRECISION)
    return dq


@triton.jit
def _bwd_q(
    Q, K, V, DO, LSE2, DELTA, DQ, FK, sm_scale, T, n_keys, HQ, GROUP,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot, sdqb, sdqh, sdqt,
    D_QK: tl.constexpr, D_V: tl.constexpr, BD_QK: tl.constexpr, BD_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    BOUNDED: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One query block of one (batch, query head): dQ (strides sdq*). BLOCK_M is a multiple of
    BLOCK_N; the key blocks visited are the forward's."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)  # int64 offsets: B H T D may pass 2^31
    b = pid_bh // HQ
    h = pid_bh % HQ
    hk = h // GROUP
    m0 = pid_m * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    pos = rows + (n_keys - T)  # the rows' key positions
    offs_dqk = tl.arange(0, BD_QK)
    offs_dv = tl.arange(0, BD_V)
    qk_scale = sm_scale * 1.4426950408889634
    q = _load_rows(Q + b * sqb + h * sqh, rows, sqt, offs_dqk, T, D_QK)
    do = _load_rows(DO + b * sob + h * soh, rows, sot, offs_dv, T, D_V)
    lse2 = tl.load(LSE2 + pid_bh * T + rows, mask=rows < T, other=0.0)
    delta = tl.load(DELTA + pid_bh * T + rows, mask=rows < T, other=0.0)
    fk_ptr = FK + b * T
    first_keys = _first_keys(fk_ptr, rows, T, BOUNDED)
    dq = tl.zeros([BLOCK_M, BD_QK], tl.float32)
    k_ptr = K + b * skb + hk * skh
    v_ptr = V + b * svb + hk * svh
    lo, mid, diag, hi = _key_ranges(fk_ptr, m0, T, n_keys, BLOCK_M, BLOCK_N, CAUSAL, BOUNDED)
    dq = _bwd_q_keys(
        dq, q, do, lse2, delta, k_ptr, v_ptr, skt, svt, pos, first_keys, lo, mid, qk_scale,
        n_keys, offs_dqk, offs_dv, D_QK, D_V, BLOCK_N, True, CAUSAL, BOUNDED, PRECISION,
    )  # fmt: skip
    dq = _bwd_q_keys(
        dq, q, do, lse2, delta, k_ptr, v_ptr, skt, svt, pos, first_keys, mid, diag, qk_scale,
        n_keys, offs_dqk, offs_dv, D_QK, D_V, BLOCK_N, False, CAUSAL, BOUNDED, PRECISION,
    )  # fmt: skip
    dq = _bwd_q_keys(
        dq, q, do, lse2, delta, k_ptr, v_ptr, skt, svt, pos, first_keys, diag, hi, qk_scale,
        n_keys, offs_dqk, offs_dv, D_QK, D_V, BLOCK_N, True, CAUSAL, BOUNDED, PRECISION,
    )  # fmt: skip
    qmask = (rows[:, None] < T) & (offs_dqk[None, :] < D_QK)
    dq_ptr = DQ + b * sdqb + h * sdqh + rows[:, None] * sdqt + offs_dqk[None, :]
    tl.store(dq_ptr, (dq * sm_scale).to(DQ.dtype.element_ty), mask=qmask)
