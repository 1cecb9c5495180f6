"""Triton kernels of FlashAttention-2 (forward with the per-row max logit, backward), imported only
when `model.kernels.flash_attention` runs them: CPU installs never import triton at module load.

Layout: q, o, dq (B, Hq, T, Dqk|Dv); k, dk (B, Hkv, n_keys, Dqk); v, dv (B, Hkv, n_keys, Dv);
any strides with the last dim contiguous. Hq = G Hkv (GQA: query head h reads kv head h // G,
nothing repeated). Head dims need not be powers of two: they are padded to BD_QK, BD_V (masked
loads). Per (batch, query head): lse2, max and delta (T,) fp32.

Rows and keys: T query rows, n_keys >= T keys (n_keys == T unless CAUSAL). Row r sits at key
position r + n_keys - T (bottom-right alignment: the rows are the last T positions of the keys,
as a context-parallel chunk whose keys start at position 0); with n_keys == T that offset is 0.
Key c is visible to row r iff c < n_keys, c <= r + offset (CAUSAL), and c >= FK[b, r] (BOUNDED:
the first visible key of each row, a key position, nondecreasing in r; packed documents and
sliding windows both reduce to it under causal masking). LR[b, c] (c < n_keys), the last row that
may see key c, is its mirror for the backward over keys. Loops visit only the blocks that hold
visible keys, and apply the mask only on the blocks where it can remove something (the causal
diagonal, the rows' first keys, the end of the sequence).

Masks on loads and stores: a block that lies inside the sequence (every block but the last one
when the length is not a multiple of the block: EVEN_M for rows, EVEN_N for keys, and every
block of the unmasked middle ranges) loads and stores without a row mask, and a head dim that is
a power of two (D == BD) without a column mask: whole-block loads that the compiler vectorizes
and pipelines without predicates.

Online softmax in the base-2 domain (exp2; scores scaled by softmax_scale log2(e), folded with
the max subtraction into one multiply-add), fp32 accumulators passed to tl.dot (accumulated in
place by the MMA). `_fwd` keeps m_i, the running row max: m_i ln 2 is the row's max of
softmax_scale q.k over its visible keys, QK-clip's statistic, stored beside the base-2
log-sum-exp the backward needs. Backward: `_bwd_delta` rowsum(dO O); `_bwd_kv` walks the query
blocks of one key block (every query head of its group) and, with ATOMIC_DQ, also adds each
block's dQ into an fp32 buffer with atomics (single pass: 5 matmuls a block pair instead of 7);
otherwise `_bwd_q` walks the key blocks of one query block. Forward and dQ programs take their
query blocks last first (grid axis 0 reversed): under causal masking the longest start first.
"""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _rows_mask(idx, offs_d, T, D: tl.constexpr, BD: tl.constexpr, IN_RANGE: tl.constexpr):
    """(len(idx), BD) or (1, BD) bool: idx < T (unless IN_RANGE) and columns < D."""
    if IN_RANGE:  # (one return: the compiler types every return of a function alike)
        mask = offs_d[None, :] < D
    elif D == BD:
        mask = idx[:, None] < T
    else:
        mask = (idx[:, None] < T) & (offs_d[None, :] < D)
    return mask


@triton.jit
def _load_rows(ptr, idx, stride_t, T, D: tl.constexpr, BD: tl.constexpr, IN_RANGE: tl.constexpr):
    """(len(idx), BD) rows idx of one (batch, head) slice at `ptr`; zeros past T and past D.
    IN_RANGE: every idx < T (no row mask); D == BD: no column mask."""
    offs_d = tl.arange(0, BD)
    ptrs = ptr + idx[:, None] * stride_t + offs_d[None, :]
    if IN_RANGE and D == BD:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=_rows_mask(idx, offs_d, T, D, BD, IN_RANGE), other=0.0)
    return x


@triton.jit
def _store_rows(ptr, idx, stride_t, x, T, D: tl.constexpr, BD: tl.constexpr,
                IN_RANGE: tl.constexpr):  # fmt: skip
    """Stores x (len(idx), BD) to rows idx < T, columns < D."""
    offs_d = tl.arange(0, BD)
    ptrs = ptr + idx[:, None] * stride_t + offs_d[None, :]
    if IN_RANGE and D == BD:
        tl.store(ptrs, x)
    else:
        tl.store(ptrs, x, mask=_rows_mask(idx, offs_d, T, D, BD, IN_RANGE))


@triton.jit
def _load_row_stat(ptr, rows, T, IN_RANGE: tl.constexpr):
    """(len(rows),) fp32 per-row statistic (lse2, delta); 0 past T."""
    if IN_RANGE:
        x = tl.load(ptr + rows)
    else:
        x = tl.load(ptr + rows, mask=rows < T, other=0.0)
    return x


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """a @ b with fp32 accumulation. PRECISION "upcast" (bf16/fp16 under the interpreter, whose
    numpy dot misreads 16-bit floats) multiplies fp32 copies of the operands."""
    if PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _dot_acc(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b, accumulated in place by the MMA (no second fp32 tile in registers)."""
    if PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _visible(pos, cols, first_keys, n_keys, CAUSAL: tl.constexpr, BOUNDED: tl.constexpr,
             IN_RANGE: tl.constexpr):  # fmt: skip
    """(rows, cols) bool for the rows at key positions `pos`: key inside the sequence (unless
    IN_RANGE: every col < n_keys), not after the row (causal), not before the row's first key
    (bounded). Rows past T keep their keys: their softmax stays finite."""
    if CAUSAL:
        ok = pos[:, None] >= cols[None, :]
        if not IN_RANGE:
            ok = ok & (cols[None, :] < n_keys)
    else:  # (full attention's masked blocks are the last one's, never IN_RANGE)
        ok = cols[None, :] < n_keys
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
    down to a key block, so that [mid, diag) holds whole blocks) are before every row. Every
    block before diag lies inside the keys."""
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
def _query_block(BLOCK_M: tl.constexpr):
    """First row of this program's query block: grid axis 0 reversed, the last block first."""
    return (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M


@triton.jit
def _fwd_keys(
    acc, l_i, m_i, q, k_ptr, v_ptr, skt, svt, pos, first_keys, lo, hi, qk_scale, n_keys,
    D_QK: tl.constexpr, D_V: tl.constexpr, BD_QK: tl.constexpr, BD_V: tl.constexpr,
    BLOCK_N: tl.constexpr, IN_RANGE: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    BOUNDED: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Online-softmax update of one query block (rows at key positions pos) with the key blocks
    in [lo, hi) (IN_RANGE: all inside the keys)."""
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = _load_rows(k_ptr, cols, skt, n_keys, D_QK, BD_QK, IN_RANGE)
        v = _load_rows(v_ptr, cols, svt, n_keys, D_V, BD_V, IN_RANGE)
        qk = _dot(q, tl.trans(k), PRECISION)  # (BM, BN) unscaled q.k
        if MASKED:
            ok = _visible(pos, cols, first_keys, n_keys, CAUSAL, BOUNDED, IN_RANGE)
            qk = tl.where(ok, qk, float("-inf"))
        # qk_scale > 0: max(qk) qk_scale is max(qk qk_scale) exactly (rounding is monotone)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # base 2
        m_safe = m_new
        if MASKED:  # a row with no key seen yet (unmasked blocks always add finite scores)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk * qk_scale - m_safe[:, None])  # one multiply-add an element
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _dot_acc(p.to(v.dtype), v, acc * alpha[:, None], PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd(
    Q, K, V, OUT, LSE2, MAX, FK, sm_scale, T, n_keys, HQ, GROUP,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
    D_QK: tl.constexpr, D_V: tl.constexpr, BD_QK: tl.constexpr, BD_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    BOUNDED: tl.constexpr, PRECISION: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
):  # fmt: skip
    """One query block of one (batch, query head). BLOCK_M is a multiple of BLOCK_N. EVEN_M:
    T % BLOCK_M == 0; EVEN_N: n_keys % BLOCK_N == 0."""
    pid_bh = tl.program_id(1).to(tl.int64)  # int64 offsets: B H T D may pass 2^31
    b = pid_bh // HQ
    h = pid_bh % HQ
    hk = h // GROUP
    m0 = _query_block(BLOCK_M)
    rows = m0 + tl.arange(0, BLOCK_M)
    pos = rows + (n_keys - T)  # the rows' key positions
    qk_scale = sm_scale * 1.4426950408889634  # log2(e): exp2 below
    q = _load_rows(Q + b * sqb + h * sqh, rows, sqt, T, D_QK, BD_QK, EVEN_M)
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
        D_QK, D_V, BD_QK, BD_V, BLOCK_N, True, True, CAUSAL, BOUNDED, PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_keys(
        acc, l_i, m_i, q, k_ptr, v_ptr, skt, svt, pos, first_keys, mid, diag, qk_scale, n_keys,
        D_QK, D_V, BD_QK, BD_V, BLOCK_N, True, False, CAUSAL, BOUNDED, PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_keys(
        acc, l_i, m_i, q, k_ptr, v_ptr, skt, svt, pos, first_keys, diag, hi, qk_scale, n_keys,
        D_QK, D_V, BD_QK, BD_V, BLOCK_N, EVEN_N, True, CAUSAL, BOUNDED, PRECISION,
    )  # fmt: skip
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # rows past T only
    o = acc / l_safe[:, None]
    o_ptr = OUT + b * sob + h * soh
    _store_rows(o_ptr, rows, sot, o.to(OUT.dtype.element_ty), T, D_V, BD_V, EVEN_M)
    lse2 = m_i + tl.math.log2(l_safe)
    row_max = m_i * 0.6931471805599453  # ln 2: natural units
    if EVEN_M:
        tl.store(LSE2 + pid_bh * T + rows, lse2)
        tl.store(MAX + pid_bh * T + rows, row_max)
    else:
        tl.store(LSE2 + pid_bh * T + rows, lse2, mask=rows < T)
        tl.store(MAX + pid_bh * T + rows, row_max, mask=rows < T)


@triton.jit
def _bwd_delta(
    OUT, DO, DELTA, T, HQ, sob, soh, sot, sdob, sdoh, sdot,
    D_V: tl.constexpr, BD_V: tl.constexpr, BLOCK_M: tl.constexpr, EVEN_M: tl.constexpr,
):  # fmt: skip
    """delta = rowsum(dO O) in fp32 for one block of rows of one (batch, query head): reads the
    16-bit tensors once (no fp32 copies)."""
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // HQ
    h = pid_bh % HQ
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    o = _load_rows(OUT + b * sob + h * soh, rows, sot, T, D_V, BD_V, EVEN_M)
    do = _load_rows(DO + b * sdob + h * sdoh, rows, sdot, T, D_V, BD_V, EVEN_M)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if EVEN_M:
        tl.store(DELTA + pid_bh * T + rows, delta)
    else:
        tl.store(DELTA + pid_bh * T + rows, delta, mask=rows < T)


@triton.jit
def _bwd_kv_rows(
    dk, dv, k, v, q_ptr, do_ptr, dq_ptr, lse_ptr, delta_ptr, FK, sqt, sot, sdqt, cols, lo, hi,
    sm_scale, qk_scale, T, n_keys, D_QK: tl.constexpr, D_V: tl.constexpr, BD_QK: tl.constexpr,
    BD_V: tl.constexpr, BLOCK_M: tl.constexpr, IN_RANGE: tl.constexpr, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, BOUNDED: tl.constexpr, PRECISION: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
):  # fmt: skip
    """dK, dV (unscaled dK) of one key block from the query blocks in [lo, hi) of one head
    (IN_RANGE: all inside the rows); with ATOMIC_DQ also adds their dQ (scaled) at dq_ptr."""
    for start in range(lo, hi, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        q = _load_rows(q_ptr, rows, sqt, T, D_QK, BD_QK, IN_RANGE)
        do = _load_rows(do_ptr, rows, sot, T, D_V, BD_V, IN_RANGE)
        lse2 = _load_row_stat(lse_ptr, rows, T, IN_RANGE)
        delta = _load_row_stat(delta_ptr, rows, T, IN_RANGE)
        s_t = _dot(k, tl.trans(q), PRECISION)  # (BN, BM) keys x rows, unscaled
        p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])
        if MASKED:
            first_keys = _first_keys(FK, rows, T, BOUNDED)
            pos = rows + (n_keys - T)
            seen = _visible(pos, cols, first_keys, n_keys, CAUSAL, BOUNDED, False)
            if not IN_RANGE:
                seen = seen & (rows[:, None] < T)
            p_t = tl.where(tl.trans(seen), p_t, 0.0)
        dv = _dot_acc(p_t.to(do.dtype), do, dv, PRECISION)
        dp_t = _dot(v, tl.trans(do), PRECISION)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk = _dot_acc(ds_t, q, dk, PRECISION)
        if ATOMIC_DQ:  # (BM, BD_QK) this key block's share of the rows' dQ
            dq = _dot(tl.trans(ds_t), k, PRECISION) * sm_scale
            offs_d = tl.arange(0, BD_QK)
            ptrs = dq_ptr + rows[:, None] * sdqt + offs_d[None, :]
            if IN_RANGE and D_QK == BD_QK:
                tl.atomic_add(ptrs, dq, sem="relaxed")
            else:
                mask = _rows_mask(rows, offs_d, T, D_QK, BD_QK, IN_RANGE)
                tl.atomic_add(ptrs, dq, mask=mask, sem="relaxed")
    return dk, dv


@triton.jit
def _bwd_kv(
    Q, K, V, DO, LSE2, DELTA, DK, DV, DQ_ACC, FK, LR, sm_scale, T, n_keys, HQ, GROUP,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
    sdkb, sdkh, sdkt, sdvb, sdvh, sdvt, sdqb, sdqh, sdqt,
    D_QK: tl.constexpr, D_V: tl.constexpr, BD_QK: tl.constexpr, BD_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    BOUNDED: tl.constexpr, PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
):  # fmt: skip
    """One key block of one kv head: dK, dV summed over the group's query heads. BLOCK_N is a
    multiple of BLOCK_M. (sob, soh, sot) are DO's strides; DK and DV have their own. ATOMIC_DQ:
    dQ (scaled, fp32) added into DQ_ACC (strides sdq*, zeros before the call) as well."""
    pid_n = tl.program_id(0)
    pid_bk = tl.program_id(1).to(tl.int64)  # int64 offsets: B H T D may pass 2^31
    HKV = HQ // GROUP
    b = pid_bk // HKV
    hk = pid_bk % HKV
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    qk_scale = sm_scale * 1.4426950408889634
    k = _load_rows(K + b * skb + hk * skh, cols, skt, n_keys, D_QK, BD_QK, EVEN_N)
    v = _load_rows(V + b * svb + hk * svh, cols, svt, n_keys, D_V, BD_V, EVEN_N)
    dk = tl.zeros([BLOCK_N, BD_QK], tl.float32)
    dv = tl.zeros([BLOCK_N, BD_V], tl.float32)
    fk_ptr = FK + b * T
    # row blocks [first, diag_end) masked (the causal diagonal), [diag_end, full) whole,
    # [full, hi) masked (rows that see part of the block, the end of the sequence). Row r sits
    # at key position r + offset; both ends are rounded to row blocks (clamped at 0 first: the
    # rows of a key block before the offset start at row 0). Every block of [diag_end, full)
    # lies inside the rows (full <= T // BLOCK_M * BLOCK_M, or diag_end when diag_end == T)
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
        dq_ptr = DQ_ACC + b * sdqb + h * sdqh
        lse_ptr = LSE2 + (b * HQ + h) * T
        delta_ptr = DELTA + (b * HQ + h) * T
        dk, dv = _bwd_kv_rows(
            dk, dv, k, v, q_ptr, do_ptr, dq_ptr, lse_ptr, delta_ptr, fk_ptr, sqt, sot, sdqt,
            cols, first, diag_end, sm_scale, qk_scale, T, n_keys, D_QK, D_V, BD_QK, BD_V,
            BLOCK_M, EVEN_M, True, CAUSAL, BOUNDED, PRECISION, ATOMIC_DQ,
        )  # fmt: skip
        dk, dv = _bwd_kv_rows(
            dk, dv, k, v, q_ptr, do_ptr, dq_ptr, lse_ptr, delta_ptr, fk_ptr, sqt, sot, sdqt,
            cols, diag_end, full, sm_scale, qk_scale, T, n_keys, D_QK, D_V, BD_QK, BD_V,
            BLOCK_M, True, False, CAUSAL, BOUNDED, PRECISION, ATOMIC_DQ,
        )  # fmt: skip
        dk, dv = _bwd_kv_rows(
            dk, dv, k, v, q_ptr, do_ptr, dq_ptr, lse_ptr, delta_ptr, fk_ptr, sqt, sot, sdqt,
            cols, full, hi, sm_scale, qk_scale, T, n_keys, D_QK, D_V, BD_QK, BD_V, BLOCK_M,
            EVEN_M, True, CAUSAL, BOUNDED, PRECISION, ATOMIC_DQ,
        )  # fmt: skip
    dk_ptr = DK + b * sdkb + hk * sdkh
    dv_ptr = DV + b * sdvb + hk * sdvh
    _store_rows(dk_ptr, cols, sdkt, (dk * sm_scale).to(DK.dtype.element_ty), n_keys, D_QK,
                BD_QK, EVEN_N)  # fmt: skip
    _store_rows(dv_ptr, cols, sdvt, dv.to(DV.dtype.element_ty), n_keys, D_V, BD_V, EVEN_N)


@triton.jit
def _bwd_q_keys(
    dq, q, do, lse2, delta, k_ptr, v_ptr, skt, svt, pos, first_keys, lo, hi, qk_scale, n_keys,
    D_QK: tl.constexpr, D_V: tl.constexpr, BD_QK: tl.constexpr, BD_V: tl.constexpr,
    BLOCK_N: tl.constexpr, IN_RANGE: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    BOUNDED: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dQ (unscaled) of one query block (rows at key positions pos) from the key blocks in
    [lo, hi) (IN_RANGE: all inside the keys)."""
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = _load_rows(k_ptr, cols, skt, n_keys, D_QK, BD_QK, IN_RANGE)
        v = _load_rows(v_ptr, cols, svt, n_keys, D_V, BD_V, IN_RANGE)
        s = _dot(q, tl.trans(k), PRECISION)
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
        if MASKED:
            ok = _visible(pos, cols, first_keys, n_keys, CAUSAL, BOUNDED, IN_RANGE)
            p = tl.where(ok, p, 0.0)
        dp = _dot(do, tl.trans(v), PRECISION)
        ds = p * (dp - delta[:, None])
        dq = _dot_acc(ds.to(k.dtype), k, dq, PRECISION)
    return dq


@triton.jit
def _bwd_q(
    Q, K, V, DO, LSE2, DELTA, DQ, FK, sm_scale, T, n_keys, HQ, GROUP,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot, sdqb, sdqh, sdqt,
    D_QK: tl.constexpr, D_V: tl.constexpr, BD_QK: tl.constexpr, BD_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    BOUNDED: tl.constexpr, PRECISION: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
):  # fmt: skip
    """One query block of one (batch, query head): dQ (strides sdq*). BLOCK_M is a multiple of
    BLOCK_N; the key blocks visited are the forward's."""
    pid_bh = tl.program_id(1).to(tl.int64)  # int64 offsets: B H T D may pass 2^31
    b = pid_bh // HQ
    h = pid_bh % HQ
    hk = h // GROUP
    m0 = _query_block(BLOCK_M)
    rows = m0 + tl.arange(0, BLOCK_M)
    pos = rows + (n_keys - T)  # the rows' key positions
    qk_scale = sm_scale * 1.4426950408889634
    q = _load_rows(Q + b * sqb + h * sqh, rows, sqt, T, D_QK, BD_QK, EVEN_M)
    do = _load_rows(DO + b * sob + h * soh, rows, sot, T, D_V, BD_V, EVEN_M)
    lse2 = _load_row_stat(LSE2 + pid_bh * T, rows, T, EVEN_M)
    delta = _load_row_stat(DELTA + pid_bh * T, rows, T, EVEN_M)
    fk_ptr = FK + b * T
    first_keys = _first_keys(fk_ptr, rows, T, BOUNDED)
    dq = tl.zeros([BLOCK_M, BD_QK], tl.float32)
    k_ptr = K + b * skb + hk * skh
    v_ptr = V + b * svb + hk * svh
    lo, mid, diag, hi = _key_ranges(fk_ptr, m0, T, n_keys, BLOCK_M, BLOCK_N, CAUSAL, BOUNDED)
    dq = _bwd_q_keys(
        dq, q, do, lse2, delta, k_ptr, v_ptr, skt, svt, pos, first_keys, lo, mid, qk_scale,
        n_keys, D_QK, D_V, BD_QK, BD_V, BLOCK_N, True, True, CAUSAL, BOUNDED, PRECISION,
    )  # fmt: skip
    dq = _bwd_q_keys(
        dq, q, do, lse2, delta, k_ptr, v_ptr, skt, svt, pos, first_keys, mid, diag, qk_scale,
        n_keys, D_QK, D_V, BD_QK, BD_V, BLOCK_N, True, False, CAUSAL, BOUNDED, PRECISION,
    )  # fmt: skip
    dq = _bwd_q_keys(
        dq, q, do, lse2, delta, k_ptr, v_ptr, skt, svt, pos, first_keys, diag, hi, qk_scale,
        n_keys, D_QK, D_V, BD_QK, BD_V, BLOCK_N, EVEN_N, True, CAUSAL, BOUNDED, PRECISION,
    )  # fmt: skip
    dq_ptr = DQ + b * sdqb + h * sdqh
    _store_rows(dq_ptr, rows, sdqt, (dq * sm_scale).to(DQ.dtype.element_ty), T, D_QK, BD_QK,
                EVEN_M)  # fmt: skip
