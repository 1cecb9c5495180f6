"""FlashAttention-2 in Triton (model/kernels/flash_attention_triton.py) that also returns each
head's max attention logit, the statistic MuonClip's QK-clip needs (the log-sum-exp is not the
max: max <= LSE <= max + log(keys)).

    out, max_logits = flash_attention(q, k, v, causal=True, first_key=fk, return_max_logits=True)

Shapes: q (B, Hq, Tq, Dqk), k (B, Hkv, Tk, Dqk), v (B, Hkv, Tk, Dv), Hq a multiple of Hkv, head
dims up to 256 (any size: padded to a power of two inside; MLA's 192 / 128 included), fp32, bf16
or fp16, any strides with a contiguous last dim; out (B, Hq, Tq, Dv) in q's dtype, its memory
laid out as (B, Tq, Hq, Dv) so that merging the heads afterwards is free; max_logits (Hq,) fp32:
the max over batch and rows of softmax_scale q.k over the keys each row may see.

Tq == Tk, or Tq < Tk with causal=True: the queries are then the last Tq positions of the keys
(bottom-right alignment, as flash-attn's causal attention with seqlen_q < seqlen_k): query row i
sits at key position Tk - Tq + i. That is a context-parallel chunk: queries at global positions
[s, s + c) over the gathered keys [0, s + c). Keys that no row sees get zero dK, dV.

`first_key` (B, Tq) int32, with causal attention: the first key position (0..Tk-1) each row may
see, nondecreasing along the rows (`key_bounds` builds it from packed documents and a sliding
window, `rows=` for a chunk of rows). The kernels visit only the key blocks between it and the
diagonal.

The kernels are torch custom ops (`lmforge::flash_attention_fwd`, `..._bwd`), opaque to
torch.compile and safe under activation checkpointing. Triton is imported on first use, never at
module load; on a CPU machine they run under its interpreter (`TRITON_INTERPRET=1`, set before
triton is first imported), with fixed block sizes; on a GPU the block sizes are autotuned once
per shape.
"""

from __future__ import annotations

import functools
import math
import os

import torch
from torch import Tensor

INTERPRETER_BLOCK = 16  # rows and keys per program under the interpreter (no autotuning there)
MAX_HEAD_DIM = 256


def key_bounds(
    doc_starts: Tensor | None,
    window: int,
    T: int,
    device: torch.device,
    rows: slice | None = None,
) -> Tensor | None:
    """(B|1, T) int32 first visible key of each row under causal masking: the start of the row's
    document (doc_starts (B, T) bool, True where a document begins) and, with a sliding window
    of W tokens (self included), row - W + 1; None when every row sees keys 0..row.

    `rows=slice(s, e)` (e <= T): only the rows at positions [s, e), (B|1, e - s), still in key
    positions from 0: the `first_key` of queries [s, e) attending to keys [0, e), a
    context-parallel chunk (doc_starts still covers positions [0, T))."""
    if doc_starts is None and not window:
        return None
    if rows is not None and (rows.step not in (None, 1) or not 0 <= (rows.start or 0) < T):
        raise ValueError(f"key_bounds: rows must be a slice of 0..{T - 1} with step 1; got {rows}")
    index = torch.arange(T, device=device)
    first = torch.zeros(1, T, dtype=torch.long, device=device)
    if doc_starts is not None:
        first = torch.where(doc_starts, index, 0).cummax(dim=1).values  # (B, T)
    if window:
        first = torch.maximum(first, index - window + 1)
    if rows is not None:
        first = first[:, rows]
    return first.to(torch.int32).contiguous()


def last_rows(first_key: Tensor, n_keys: int | None = None) -> Tensor:
    """(B, n_keys) int32 last row (0..Tq-1, -1 for none) whose first key is at most each key
    c < n_keys (default Tq): first_key (B, Tq) is nondecreasing, so those rows are a prefix.
    With the causal bound (row i sits at key position n_keys - Tq + i) these are the rows that
    see key c from row max(0, c - n_keys + Tq) on."""
    n = first_key.shape[-1] if n_keys is None else n_keys
    keys = torch.arange(n, device=first_key.device, dtype=torch.int32)
    keys = keys.expand(first_key.shape[0], n).contiguous()
    return (torch.searchsorted(first_key, keys, right=True) - 1).to(torch.int32)


def _check(q: Tensor, k: Tensor, v: Tensor, first_key: Tensor | None, causal: bool) -> None:
    B, _, T, Dqk = q.shape if q.dim() == 4 else (0, 0, 0, 0)
    if (
        q.dim() != 4
        or k.dim() != 4
        or v.dim() != 4
        or k.shape != (B, k.shape[1], k.shape[2], Dqk)
        or k.shape[2] < T
        or v.shape[:3] != k.shape[:3]
    ):
        raise ValueError(
            "flash_attention takes q (B, Hq, Tq, Dqk), k (B, Hkv, Tk, Dqk), v (B, Hkv, Tk, Dv) "
            f"with Tk >= Tq; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape[2] != T and not causal:
        raise ValueError(
            f"{T} queries over {k.shape[2]} keys needs causal=True (bottom-right aligned); "
            "full attention takes as many keys as queries"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    for name, dim in (("query-key", Dqk), ("value", v.shape[-1])):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name} head dim {dim}: the Triton kernel takes 1..{MAX_HEAD_DIM}")
    if len({q.dtype, k.dtype, v.dtype}) != 1 or q.dtype not in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
    ):
        raise ValueError(
            f"q, k, v must share one of fp32, bf16, fp16; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if first_key is not None:
        if not causal:
            raise ValueError("first_key (documents, sliding window) needs causal=True")
        if first_key.dtype != torch.int32 or first_key.shape[-1] != T or first_key.dim() != 2:
            raise ValueError(
                f"first_key must be (B, Tq) int32; got {tuple(first_key.shape)} {first_key.dtype}"
            )


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _new_out(q: Tensor, dv: int) -> Tensor:
    """(B, Hq, T, Dv) in q's dtype, memory laid out as (B, T, Hq, Dv)."""
    B, H, T, _ = q.shape
    return q.new_empty(B, T, H, dv).transpose(1, 2)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# GPU autotuning candidates (BLOCK_M rows, BLOCK_N keys, warps, stages), largest first: few, so
# that tuning a new shape costs seconds; the last of each list fits the shared memory of an sm_90
# block even in fp32 at head dim 256 (model/kernels/aot.py checks). Forward and dQ: BLOCK_M a
# multiple of BLOCK_N; dK/dV the reverse.
FORWARD_CONFIGS = ((128, 64, 8, 3), (128, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 2))
DQ_CONFIGS = ((128, 32, 8, 2), (64, 32, 4, 3), (64, 64, 4, 2), (32, 16, 4, 1))
DKV_CONFIGS = ((32, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 2), (16, 32, 4, 1))


def _configs(candidates: tuple) -> list:
    import triton

    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=warps, num_stages=stages)
        for m, n, warps, stages in candidates
    ]


@functools.cache
def _kernels(interpreting: bool) -> dict:
    """name -> (kernel, fixed meta-parameters or {} when autotuned)."""
    from model.kernels import flash_attention_triton as fa

    if interpreting:
        fixed = {"BLOCK_M": INTERPRETER_BLOCK, "BLOCK_N": INTERPRETER_BLOCK}
        return {name: (getattr(fa, name), fixed) for name in ("_fwd", "_bwd_kv", "_bwd_q")}
    import triton

    key = ["T", "n_keys", "D_QK", "D_V", "CAUSAL", "BOUNDED"]  # T: query rows
    return {
        "_fwd": (triton.autotune(_configs(FORWARD_CONFIGS), key=key)(fa._fwd), {}),
        "_bwd_kv": (triton.autotune(_configs(DKV_CONFIGS), key=key)(fa._bwd_kv), {}),
        "_bwd_q": (triton.autotune(_configs(DQ_CONFIGS), key=key)(fa._bwd_q), {}),
    }


def _run(name: str, rows: int, heads: int, args: tuple, meta: dict) -> None:
    """Runs kernel `name` on the grid (blocks of `rows`, heads); meta holds the constexprs."""
    import triton

    kernel, fixed = _kernels(_interpreting())[name]
    block = "BLOCK_N" if name == "_bwd_kv" else "BLOCK_M"
    kernel[lambda m: (triton.cdiv(rows, m[block]), heads)](*args, **meta, **fixed)


def _precision(dtype: torch.dtype) -> str:
    """The kernels' dot precision: exact fp32 products for fp32 inputs (no TF32), tensor-core
    16-bit dots otherwise, and fp32 copies of 16-bit operands under the interpreter."""
    if dtype == torch.float32:
        return "ieee"
    return "upcast" if _interpreting() else "tf32"  # tf32: ignored by 16-bit dots


def _meta(q: Tensor, v: Tensor, causal: bool, bounded: bool) -> dict:
    import triton

    d_qk, d_v = q.shape[-1], v.shape[-1]
    return dict(
        D_QK=d_qk,
        D_V=d_v,
        BD_QK=max(16, triton.next_power_of_2(d_qk)),
        BD_V=max(16, triton.next_power_of_2(d_v)),
        CAUSAL=causal,
        BOUNDED=bounded,
        PRECISION=_precision(q.dtype),
    )


def _strides(*tensors: Tensor) -> tuple[int, ...]:
    return tuple(s for t in tensors for s in t.stride()[:3])


@torch.library.custom_op("lmforge::flash_attention_fwd", mutates_args=())
def _fwd_op(
    q: Tensor, k: Tensor, v: Tensor, first_key: Tensor | None, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(out (B, Hq, Tq, Dv), lse2 (B, Hq, Tq) base-2 log-sum-exp, row max (B, Hq, Tq) fp32).
    The rows sit at key positions Tk - Tq + i: the offset comes from the shapes."""
    B, HQ, T, _ = q.shape
    out = _new_out(q, v.shape[-1])
    lse2 = torch.empty(B, HQ, T, dtype=torch.float32, device=q.device)
    row_max = torch.empty_like(lse2)
    fk = first_key if first_key is not None else lse2.new_zeros(1, dtype=torch.int32)
    args = (q, k, v, out, lse2, row_max, fk, scale, T, k.shape[2], HQ, HQ // k.shape[1])
    args += _strides(q, k, v, out)
    _run("_fwd", T, B * HQ, args, _meta(q, v, causal, first_key is not None))
    return out, lse2, row_max


@_fwd_op.register_fake
def _(q, k, v, first_key, causal, scale):
    lse2 = q.new_empty(q.shape[:3], dtype=torch.float32)
    return _new_out(q, v.shape[-1]), lse2, torch.empty_like(lse2)


@torch.library.custom_op("lmforge::flash_attention_bwd", mutates_args=())
def _bwd_op(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse2: Tensor,
    first_key: Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in the inputs' dtypes (and layouts, where they are dense)."""
    B, HQ, T, _ = q.shape
    HKV, n_keys = k.shape[1], k.shape[2]
    delta = (grad_out.float() * out.float()).sum(-1).contiguous()  # (B, Hq, T) rowsum(dO O)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    bounded = first_key is not None
    fk = first_key if bounded else lse2.new_zeros(1, dtype=torch.int32)
    lr = last_rows(first_key, n_keys) if bounded else fk
    meta = _meta(q, v, causal, bounded)
    common = (scale, T, n_keys, HQ, HQ // HKV, *_strides(q, k, v, grad_out))
    kv_args = (q, k, v, grad_out, lse2, delta, dk, dv, fk, lr, *common, *_strides(dk, dv))
    _run("_bwd_kv", n_keys, B * HKV, kv_args, meta)
    _run(
        "_bwd_q", T, B * HQ, (q, k, v, grad_out, lse2, delta, dq, fk, *common, *_strides(dq)), meta
    )
    return dq, dk, dv


@_bwd_op.register_fake
def _(grad_out, q, k, v, out, lse2, first_key, causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, first_key, causal, scale = inputs
    out, lse2, _ = output
    ctx.save_for_backward(q, k, v, out, lse2, first_key)
    ctx.causal, ctx.scale = causal, scale
    ctx.mark_non_differentiable(output[1], output[2])


def _backward(ctx, grad_out: Tensor, _grad_lse: Tensor, _grad_max: Tensor):
    q, k, v, out, lse2, first_key = ctx.saved_tensors
    grad_out = _last_dim_contiguous(grad_out)
    dq, dk, dv = _bwd_op(grad_out, q, k, v, out, lse2, first_key, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    first_key: Tensor | None = None,
    return_max_logits: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """softmax(scale q k^T, over the visible keys) v, by query heads over their kv group; with
    `return_max_logits` also the (Hq,) max of scale q.k over every visible (row, key) pair.

    With Tk > Tq keys (causal only) query row i sits at key position Tk - Tq + i: it sees keys
    first_key[:, i] (0 without bounds) .. Tk - Tq + i; keys that no row sees get zero gradients.
    """
    _check(q, k, v, first_key, causal)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if first_key is not None and first_key.shape[0] != q.shape[0]:
        first_key = first_key.expand(q.shape[0], -1).contiguous()
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    out, _, row_max = _fwd_op(q, k, v, first_key, causal, float(scale))
    if not return_max_logits:
        return out
    return out, row_max.amax(dim=(0, 2))
