"""Fused training ops in Triton (kernels in model/kernels/fused_triton.py), chosen per op by
`model.kernels` (model/config.py: KernelsConfig) and wired in by the modules that compute them:

    rms_norm(x, weight, eps, residual=None)   y = (x [+ residual]) / rms * weight  [, the sum]
    rope(x, rot, interleaved)                  x (B, T, H, D) rotated by rot (B, T, R/2) complex
    swiglu(gate, up)                           silu(gate) * up

Each is a torch custom op with its backward registered (opaque to torch.compile, recomputed as
a whole under activation checkpointing). fp32 arithmetic inside, results in the input dtype, the
same values as the torch modules (model/norms.py, model/mixers/rope.py, model/ffn.py) up to rounding.
Triton is imported on first use, never at module load; on CPU the kernels run only under Triton's
interpreter (TRITON_INTERPRET=1), which is how the tests run them.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

SWIGLU_BLOCK = 1024  # elements per program


def require_kernel_device(x: Tensor, key: str) -> None:
    """A clear error instead of Triton's "0 active drivers" on a CPU run."""
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"model.kernels.{key}=triton runs on CUDA (on CPU only under Triton's interpreter, "
            f"TRITON_INTERPRET=1, for tests); use model.kernels.{key}=torch here"
        )


def _rows(x: Tensor) -> Tensor:
    """(..., C) -> (N, C) with contiguous columns (a view where possible)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    return x.reshape(-1, x.shape[-1])


def _programs(device: torch.device, rows: int) -> int:
    """Programs of the RMSNorm backward, each summing dw over a run of rows: a few per SM."""
    if device.type == "cuda":
        return min(rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count)
    return min(rows, 4)


def _row_warps(C: int) -> int:
    """Warps for one row of C elements: 4 up to 2048, then more (16 at 8192)."""
    return min(16, max(4, C // 512))


# ---- RMSNorm (+ residual add) -------------------------------------------------------------------


@torch.library.custom_op("lmforge::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd(
    x: Tensor, weight: Tensor, residual: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(y like x, h = x + residual like x (empty without a residual), rstd (N,) fp32)."""
    import triton

    from model.kernels.fused_triton import _rms_norm_fwd as kernel

    rows = _rows(x)
    N, C = rows.shape
    y = torch.empty_like(rows)
    h = torch.empty_like(rows) if residual is not None else rows.new_empty(0)
    r = _rows(residual) if residual is not None else rows
    rstd = torch.empty(N, dtype=torch.float32, device=x.device)
    kernel[(N,)](
        rows, r, weight, y, h, rstd, rows.stride(0), r.stride(0), y.stride(0), C, C, eps,
        BLOCK_C=triton.next_power_of_2(C), HAS_RESIDUAL=residual is not None,
        num_warps=_row_warps(C),
    )  # fmt: skip
    return y.view(x.shape), h.view(x.shape) if residual is not None else h, rstd


@_rms_norm_fwd.register_fake
def _(x, weight, residual, eps):
    h = torch.empty_like(x) if residual is not None else x.new_empty(0)
    return torch.empty_like(x), h, x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)


@torch.library.custom_op("lmforge::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd(
    dy: Tensor, dh: Tensor | None, h: Tensor, weight: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor]:
    """(dx like h: also the residual's gradient, dw like weight)."""
    import triton

    from model.kernels.fused_triton import _rms_norm_bwd as kernel

    dy_rows, h_rows = _rows(dy), _rows(h)
    dh_rows = _rows(dh) if dh is not None else dy_rows
    N, C = h_rows.shape
    programs = _programs(h.device, N)
    per_program = triton.cdiv(N, programs)
    dx = torch.empty_like(h_rows)
    dw = torch.empty(programs, C, dtype=torch.float32, device=h.device)
    kernel[(programs,)](
        dy_rows, dh_rows, h_rows, weight, rstd, dx, dw, dy_rows.stride(0), dh_rows.stride(0),
        h_rows.stride(0), dx.stride(0), N, C, per_program,
        BLOCK_C=triton.next_power_of_2(C), HAS_DH=dh is not None, num_warps=_row_warps(C),
    )  # fmt: skip
    return dx.view(h.shape), dw.sum(0).to(weight.dtype)


@_rms_norm_bwd.register_fake
def _(dy, dh, h, weight, rstd):
    return torch.empty_like(h), torch.empty_like(weight)


def _rms_norm_setup(ctx, inputs, output) -> None:
    x, weight, residual, _ = inputs
    _, h, rstd = output
    ctx.has_residual = residual is not None
    ctx.save_for_backward(h if ctx.has_residual else x, weight, rstd)
    ctx.mark_non_differentiable(rstd)


def _rms_norm_backward(ctx, dy: Tensor, dh: Tensor, _drstd: Tensor):
    h, weight, rstd = ctx.saved_tensors
    dh = dh if ctx.has_residual and dh is not None else None
    dx, dw = _rms_norm_bwd(dy, dh, h, weight, rstd)
    return dx, dw, dx if ctx.has_residual else None, None


_rms_norm_fwd.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """x (..., C) normalized by its root mean square over C and scaled by weight (C,); with
    `residual` (like x), h = x + residual is normalized instead and (y, h) returned: the add of
    a post-norm residual and the norm after it in one pass."""
    require_kernel_device(x, "rms_norm")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} must be like x {tuple(x.shape)} {x.dtype}"
        )
    y, h, _ = _rms_norm_fwd(x, weight, residual, float(eps))
    return (y, h) if residual is not None else y


# ---- RoPE -----------------------------------------------------------------------------------------


@torch.library.custom_op("lmforge::rope", mutates_args=())
def _rope(x: Tensor, rot: Tensor, interleaved: bool, sign: float) -> Tensor:
    """x (B, T, H, D) rotated by rot (B|1, T, R/2, 2) fp32 [cos, sin] (sign -1: the inverse)."""
    import triton

    from model.kernels.fused_triton import _rope as kernel

    B, T, H, D = x.shape
    half_r = rot.shape[2]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rot_b = rot.stride(0) if rot.shape[0] > 1 else 0
    kernel[(B * T,)](
        x, rot, y, T, H, *x.stride()[:3], rot_b, rot.stride(1), *y.stride()[:3], sign,
        D=D, HALF_R=half_r, BLOCK_H=triton.next_power_of_2(H),
        BLOCK_P=triton.next_power_of_2(half_r),
        BLOCK_REST=triton.next_power_of_2(D - 2 * half_r) if 2 * half_r < D else 0,
        INTERLEAVED=interleaved,
    )  # fmt: skip
    return y


@_rope.register_fake
def _(x, rot, interleaved, sign):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _rope_setup(ctx, inputs, output) -> None:
    _, rot, ctx.interleaved, ctx.sign = inputs
    ctx.save_for_backward(rot)


def _rope_backward(ctx, dy: Tensor):
    (rot,) = ctx.saved_tensors
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    return _rope(dy, rot, ctx.interleaved, -ctx.sign), None, None, None


_rope.register_autograd(_rope_backward, setup_context=_rope_setup)


def rope(x: Tensor, rot: Tensor, interleaved: bool) -> Tensor:
    """x (B, T, H, D) with its first R dims rotated in pairs by rot (B, T, R/2) complex (pairing
    as in model/mixers/rope.py: interleaved (2i, 2i+1) or half (i, i + R/2)); dims R..D unchanged."""
    require_kernel_device(x, "rope")
    x = x if x.stride(-1) == 1 else x.contiguous()
    return _rope(x, torch.view_as_real(rot), interleaved, 1.0)


# ---- SwiGLU ---------------------------------------------------------------------------------------


@torch.library.custom_op("lmforge::swiglu_fwd", mutates_args=())
def _swiglu_fwd(gate: Tensor, up: Tensor) -> Tensor:
    import triton

    from model.kernels.fused_triton import _swiglu_fwd as kernel

    out = torch.empty_like(gate)
    n = gate.numel()
    kernel[(triton.cdiv(n, SWIGLU_BLOCK),)](gate, up, out, n, BLOCK=SWIGLU_BLOCK)
    return out


@_swiglu_fwd.register_fake
def _(gate, up):
    return torch.empty_like(gate)


@torch.library.custom_op("lmforge::swiglu_bwd", mutates_args=())
def _swiglu_bwd(gate: Tensor, up: Tensor, dout: Tensor) -> tuple[Tensor, Tensor]:
    import triton

    from model.kernels.fused_triton import _swiglu_bwd as kernel

    dg, du = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    kernel[(triton.cdiv(n, SWIGLU_BLOCK),)](
        gate, up, dout.contiguous(), dg, du, n, BLOCK=SWIGLU_BLOCK
    )
    return dg, du


@_swiglu_bwd.register_fake
def _(gate, up, dout):
    return torch.empty_like(gate), torch.empty_like(up)


def _swiglu_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, dout: Tensor):
    return _swiglu_bwd(*ctx.saved_tensors, dout)


_swiglu_fwd.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up, elementwise (gate and up of one shape and dtype)."""
    require_kernel_device(gate, "swiglu")
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must match"
        )
    return _swiglu_fwd(gate.contiguous(), up.contiguous())
