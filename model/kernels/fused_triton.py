"""Triton kernels of the fused training ops (model/kernels/fused.py wraps them): RMSNorm with an
optional residual add, RoPE in both pairings, SwiGLU's gate. Imported only when a fused kernel
runs: CPU installs never import triton at module load.

Shapes: rows (N, C) with a row stride and contiguous columns (RMSNorm); x (B, T, H, D) with the
rotations as (B, T, R/2, 2) fp32 [cos, sin] (RoPE); flat contiguous (n,) tensors (SwiGLU). All
arithmetic in fp32; results stored in the input dtype. Scalars arrive as kernel arguments and are
only used in arithmetic (Triton's interpreter rejects `.to()` on them); offsets are int64.
"""

import triton
import triton.language as tl


@triton.jit
def _rms_norm_fwd(
    X, R, W, Y, SUM, RSTD, sx, sr, sy, sh, C, eps,
    BLOCK_C: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """One row: h = x (+ r, rounded to the input dtype as the unfused add would), y = h / rms(h)
    * w; stores y, h (with a residual) and 1 / rms(h)."""
    row = tl.program_id(0).to(tl.int64)  # int64 offsets: N C may pass 2^31
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    h = tl.load(X + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(R + row * sr + cols, mask=mask, other=0.0).to(tl.float32)
        h = h.to(SUM.dtype.element_ty)  # the sum as the unfused add stores it
        tl.store(SUM + row * sh + cols, h, mask=mask)
        h = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / C + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * sy + cols, (h * rstd * w).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_bwd(
    DY, DH, SUM, W, RSTD, DX, DW, sdy, sdh, sh, sdx, N, C, rows_per_program,
    BLOCK_C: tl.constexpr, HAS_DH: tl.constexpr,
):  # fmt: skip
    """Rows [pid r, (pid + 1) r) of dx = rstd (w dy - h_hat mean(w dy h_hat)) (+ dh, the
    gradient of the residual sum h itself) and this program's partial sum of dw = dy h_hat."""
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_C], tl.float32)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, N)
    for row in range(first, last):
        dy = tl.load(DY + row * sdy + cols, mask=mask, other=0.0).to(tl.float32)
        h = tl.load(SUM + row * sh + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        h_hat = h * rstd
        wdy = w * dy
        dx = rstd * (wdy - h_hat * (tl.sum(wdy * h_hat, 0) / C))
        if HAS_DH:
            dx += tl.load(DH + row * sdh + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row * sdx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * h_hat
    tl.store(DW + pid * C + cols, dw, mask=mask)


@triton.jit
def _rope(
    X, ROT, Y, T, H, sxb, sxt, sxh, srb, srt, syb, syt, syh, sign,
    D: tl.constexpr, HALF_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_REST: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """One token, every head: pair i of dims (2i, 2i+1) (interleaved) or (i, i + R/2) (half)
    rotated by the token's angle i (sign -1: by minus it, the backward); dims R..D copied."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    heads = tl.arange(0, BLOCK_H)[:, None]
    pairs = tl.arange(0, BLOCK_P)[None, :]
    mask = (heads < H) & (pairs < HALF_R)
    rot = ROT + b * srb + t * srt + pairs * 2
    cos = tl.load(rot, mask=pairs < HALF_R, other=0.0)
    sin = tl.load(rot + 1, mask=pairs < HALF_R, other=0.0) * sign
    if INTERLEAVED:
        first = pairs * 2
        second = pairs * 2 + 1
    else:
        first = pairs
        second = pairs + HALF_R
    x_row = X + b * sxb + t * sxt + heads * sxh
    y_row = Y + b * syb + t * syt + heads * syh
    x1 = tl.load(x_row + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + second, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_row + first, (x1 * cos - x2 * sin).to(Y.dtype.element_ty), mask=mask)
    tl.store(y_row + second, (x2 * cos + x1 * sin).to(Y.dtype.element_ty), mask=mask)
    if BLOCK_REST > 0:  # partial rotary: the dims after R pass through
        rest = 2 * HALF_R + tl.arange(0, BLOCK_REST)[None, :]
        rest_mask = (heads < H) & (rest < D)
        tl.store(y_row + rest, tl.load(x_row + rest, mask=rest_mask), mask=rest_mask)


@triton.jit
def _swiglu_fwd(G, U, OUT, n, BLOCK: tl.constexpr):
    """out = silu(g) u."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    out = g * tl.sigmoid(g) * u
    tl.store(OUT + offs, out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(G, U, DOUT, DG, DU, n, BLOCK: tl.constexpr):
    """dg = dout u sigmoid(g) (1 + g (1 - sigmoid(g))), du = dout silu(g)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    dout = tl.load(DOUT + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    tl.store(
        DG + offs, (dout * u * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty), mask=mask
    )
    tl.store(DU + offs, (dout * g * sig).to(DU.dtype.element_ty), mask=mask)
