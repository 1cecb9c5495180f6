"""FlashAttention-2 in Triton (model/kernels/flash_attention_triton.py) that also returns each
head's max attention logit, the statistic MuonClip's QK-clip needs (the log-sum-exp is not the
max: max <= LSE <= max + log(keys)). A first step of issue 18: causal or full attention with GQA,
no mask (documents and sliding windows fall back to SDPA until the kernel takes them).

    out, max_logits = flash_attention(q, k, v, causal=True, return_max_logits=True)

Shapes: q (B, Hq, T, D), k and v (B, Hkv, T, D), Hq a multiple of Hkv, D a power of two in
16..256; out like q; max_logits (Hq,) fp32: max over batch and rows of softmax_scale q.k over
the keys each row may see. Triton is imported on first use, never at module load; on a CPU
machine the kernels run under its interpreter (`TRITON_INTERPRET=1`, set before triton is first
imported), which is what the tests do. Fixed block sizes (no autotuning: the interpreter cannot).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

BLOCK = 16  # rows and keys per program (fixed: no autotune under the interpreter)


def _check(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ValueError(
            f"flash_attention takes q (B, Hq, T, D) and k, v (B, Hkv, T, D); got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    D = q.shape[-1]
    if D & (D - 1) or not 16 <= D <= 256:
        raise ValueError(f"head dim {D}: the Triton kernel takes a power of two in 16..256")


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float):
        import triton

        from model.kernels.flash_attention_triton import _fwd

        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        B, HQ, T, D = q.shape
        out = torch.empty_like(q)
        lse = torch.empty(B, HQ, T, dtype=torch.float32, device=q.device)
        row_max = torch.empty_like(lse)
        grid = (triton.cdiv(T, BLOCK), B * HQ)
        _fwd[grid](
            q, k, v, out, lse, row_max, scale, T, HQ, HQ // k.shape[1],
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
            D=D, BLOCK_M=BLOCK, BLOCK_N=BLOCK, CAUSAL=causal,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        ctx.mark_non_differentiable(row_max)
        return out, row_max

    @staticmethod
    def backward(ctx, grad_out: Tensor, _grad_max: Tensor):
        import triton

        from model.kernels.flash_attention_triton import _bwd_kv, _bwd_q

        q, k, v, out, lse = ctx.saved_tensors
        B, HQ, T, D = q.shape
        HKV = k.shape[1]
        grad_out = grad_out.contiguous()
        delta = (grad_out.float() * out.float()).sum(-1).contiguous()  # (B, Hq, T) rowsum(dO O)
        dq = torch.empty_like(q, dtype=torch.float32)
        dk = torch.empty_like(k, dtype=torch.float32)
        dv = torch.empty_like(v, dtype=torch.float32)
        common = dict(D=D, BLOCK_M=BLOCK, BLOCK_N=BLOCK, CAUSAL=ctx.causal)
        _bwd_kv[(triton.cdiv(T, BLOCK), B * HKV)](
            q, k, v, grad_out, lse, delta, dk, dv, ctx.scale, T, HQ, HQ // HKV,
            *q.stride()[:3], *k.stride()[:3], **common,
        )  # fmt: skip
        _bwd_q[(triton.cdiv(T, BLOCK), B * HQ)](
            q, k, v, grad_out, lse, delta, dq, ctx.scale, T, HQ, HQ // HKV,
            *q.stride()[:3], *k.stride()[:3], **common,
        )  # fmt: skip
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    return_max_logits: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """softmax(scale q k^T (+ causal mask)) v, by query heads over their kv group; with
    `return_max_logits` also the (Hq,) max of scale q.k over every unmasked (row, key) pair."""
    _check(q, k, v)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out, row_max = _FlashAttention.apply(q, k, v, causal, scale)
    if not return_max_logits:
        return out
    return out, row_max.amax(dim=(0, 2))
