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
triton is first imported), with fixed block sizes (INTERPRETER_BLOCKS); on a GPU the block sizes
are autotuned once per shape among CONFIGS' candidates, pruned first to those that fit.

The backward runs one of two variants, named by the environment variable LMFORGE_FLASH_BACKWARD
at each call: `two_kernel` (default; dK/dV, then dQ, each summed in a fixed order, so results are
bitwise reproducible) or `single_pass` (dQ added with fp32 atomics from the dK/dV kernel: fewer
matmuls, but the order of dQ's sums, and so its last bits, varies from run to run).
"""

from __future__ import annotations

import functools
import math
import os

import torch
from torch import Tensor

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


# Backward variants (LMFORGE_FLASH_BACKWARD, read at each call): "two_kernel" (default) runs
# dK/dV over the key blocks, then dQ over the query blocks (7 matmuls a block pair, each
# gradient summed in a fixed order); "single_pass" adds each block pair's dQ into an fp32
# buffer with atomics from the dK/dV kernel (5 matmuls, FlashAttention-2's CUDA backward): the
# order of dQ's sums then depends on scheduling, so dQ is not bitwise reproducible.
BACKWARD_ENV = "LMFORGE_FLASH_BACKWARD"
BACKWARDS = ("two_kernel", "single_pass")

# GPU autotuning candidates (BLOCK_M rows, BLOCK_N keys, warps, stages) per kernel: 16-bit inputs
# (tensor-core dots: Hopper's wgmma takes 64-row slices per warpgroup, with 2-3 stages of loads
# in flight) and fp32 (exact IEEE dots on the FMA units: one small tile, for checks rather than
# speed). Forward and dQ: BLOCK_M a multiple of BLOCK_N; dK/dV the reverse. Chosen with ptxas's
# register counts for sm_90 (`python -m model.kernels.aot --candidates all --registers`): the
# dK/dV kernel holds two (BLOCK_N, D) fp32 accumulators, so at D 128 its 64-row blocks spill
# (328 bytes a thread, 544 with atomic dQ) while 16- and 32-row ones spill 0-216; at MLA's
# dims every dK/dV candidate spills some; 4-warp candidates with 128-row or 128-key tiles
# spill more and are left out. Before tuning a
# shape, `_prune` keeps those that fit: estimated shared memory (shared_bytes_estimate) within
# the GPU's, and blocks no longer than the sequence; model/kernels/aot.py compiles the largest
# survivors for sm_90 and checks both the fit and the estimate.
CONFIGS = {
    "_fwd": {
        "16-bit": ((128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3),
                   (64, 32, 4, 2)),
        "fp32": ((32, 16, 4, 1),),
    },
    "_bwd_kv": {
        "16-bit": ((64, 128, 8, 2), (32, 128, 8, 3), (32, 128, 8, 2), (16, 128, 8, 2),
                   (32, 64, 8, 2), (16, 64, 8, 2)),
        "fp32": ((16, 32, 4, 1),),
    },
    "_bwd_kv_atomic": {
        "16-bit": ((32, 128, 8, 2), (16, 128, 8, 3), (16, 128, 8, 2), (32, 64, 8, 2),
                   (16, 64, 8, 2)),
        "fp32": ((16, 32, 4, 1),),
    },
    "_bwd_q": {
        "16-bit": ((128, 64, 8, 2), (128, 32, 8, 3), (128, 32, 8, 2), (64, 64, 4, 3),
                   (64, 32, 4, 2)),
        "fp32": ((32, 16, 4, 1),),
    },
}  # fmt: skip
DELTA_BLOCK = (64, 4)  # _bwd_delta's rows per program and warps (memory-bound, not tuned)
# rows and keys per program under the interpreter (no autotuning there), read at each call
INTERPRETER_BLOCKS = {
    "_fwd": (16, 16), "_bwd_kv": (16, 16), "_bwd_kv_atomic": (16, 16), "_bwd_q": (16, 16),
    "_bwd_delta": (16, 0),
}  # fmt: skip
SHARED_BYTES_SM90 = 232448  # the largest dynamic shared memory one block may use on sm_90


def dtype_class(itemsize: int) -> str:
    return "fp32" if itemsize == 4 else "16-bit"


def shared_bytes_estimate(
    name: str, block_m: int, block_n: int, stages: int, bd_qk: int, bd_v: int, itemsize: int
) -> int:
    """An upper bound of the shared memory Triton 3.x gives one program of kernel `name` on
    sm_90 (padded head dims bd_qk, bd_v), fitted to the compiler's numbers for every candidate
    (model/kernels/aot.py checks it on each variant it compiles): the tiles the loop loads, one
    buffer per stage, and the tiles staged once (the program's own rows or keys); backward:
    lse2 and delta rows per stage; fp32: the (BM, BN) scores' layout change for the FMA dots;
    atomic dQ: its fp32 tile on the way to the atomics, and the transposed dS."""
    row = bd_qk + bd_v
    if name == "_fwd":  # loop: K, V; once: Q
        loop, once = block_n * row, block_m * bd_qk
    elif name == "_bwd_q":  # loop: K, V; once: Q, dO
        loop, once = block_n * row, block_m * row
    else:  # dK/dV: loop: Q, dO; once: K, V
        loop, once = block_m * row, block_n * row
    total = itemsize * (stages * loop + once)
    if itemsize == 4:
        total += 4 * block_m * block_n
    if name != "_fwd":
        total += 16 * stages * block_m
    if name == "_bwd_kv_atomic":
        total += 4 * max(block_m, 64) * bd_qk + 4 * max(block_m, 32) * block_n
    return total


def _shared_limit(device: torch.device) -> int:
    """The most shared memory one block may use on `device` (sm_90's where unknown)."""
    try:
        from triton.runtime import driver

        props = driver.active.utils.get_device_properties(device.index or 0)
        return int(props["max_shared_mem"])
    except Exception:  # an older triton or no driver: Hopper's
        return SHARED_BYTES_SM90


def _pruner(name: str):
    """early_config_prune for kernel `name`: the dtype's candidates that fit the device's shared
    memory and whose blocks are no longer than the rows and keys (rounded up to 16)."""
    import triton

    def prune(configs: list, named_args: dict, **kwargs) -> list:
        q, v = named_args["Q"], named_args["V"]  # (triton < 3.0 passes no kwargs)
        itemsize = q.element_size()
        allowed = set(CONFIGS[name][dtype_class(itemsize)])
        limit = _shared_limit(q.device)
        bd_qk, bd_v = (max(16, triton.next_power_of_2(x.shape[-1])) for x in (q, v))
        rows = max(16, triton.next_power_of_2(named_args["T"]))
        keys = max(16, triton.next_power_of_2(named_args["n_keys"]))

        def blocks(c) -> tuple:
            return (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)

        def estimate(c) -> int:
            m, n, _, stages = blocks(c)
            return shared_bytes_estimate(name, m, n, stages, bd_qk, bd_v, itemsize)

        mine = [c for c in configs if blocks(c) in allowed]
        keep = [
            c
            for c in mine
            if estimate(c) <= limit and c.kwargs["BLOCK_M"] <= rows and c.kwargs["BLOCK_N"] <= keys
        ]
        return keep or [min(mine, key=estimate)]

    return prune


def _configs(name: str) -> list:
    import triton

    candidates = dict.fromkeys(c for group in CONFIGS[name].values() for c in group)
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=warps, num_stages=stages)
        for m, n, warps, stages in candidates
    ]


EVEN = {
    "EVEN_M": lambda args: args["T"] % args["BLOCK_M"] == 0,
    "EVEN_N": lambda args: args["n_keys"] % args["BLOCK_N"] == 0,
}
KERNELS = {  # name -> (function in flash_attention_triton, grid axis 0's block, heuristics)
    "_fwd": ("_fwd", "BLOCK_M", EVEN),
    "_bwd_kv": ("_bwd_kv", "BLOCK_N", EVEN),
    "_bwd_kv_atomic": ("_bwd_kv", "BLOCK_N", EVEN),
    "_bwd_q": ("_bwd_q", "BLOCK_M", EVEN),
    "_bwd_delta": ("_bwd_delta", "BLOCK_M", {"EVEN_M": EVEN["EVEN_M"]}),
}


@functools.cache
def _kernels(interpreting: bool) -> dict:
    """name -> kernel: the Triton function under heuristics that set EVEN_M / EVEN_N from the
    blocks; on a GPU under an autotuner too (but _bwd_delta), keyed by the shape."""
    import triton

    from model.kernels import flash_attention_triton as fa

    kernels = {}
    for name, (fn, _, even) in KERNELS.items():
        kernel = triton.heuristics(even)(getattr(fa, fn))
        if not interpreting and name in CONFIGS:
            kernel = triton.autotune(
                _configs(name),
                key=["T", "n_keys", "D_QK", "D_V", "CAUSAL", "BOUNDED"],  # T: query rows
                prune_configs_by={"early_config_prune": _pruner(name)},
                reset_to_zero=["DQ_ACC"] if name == "_bwd_kv_atomic" else None,
            )(kernel)
        kernels[name] = kernel
    return kernels


def tuned_configs() -> dict:
    """{kernel: [{"key": the autotuner's key, "config": the chosen config}]} of every shape
    tuned so far in this process (GPU runs: which candidates win, for the next revision)."""
    if _interpreting():
        return {}  # fixed blocks
    return {
        name: [{"key": str(key), "config": str(c)} for key, c in kernel.cache.items()]
        for name, kernel in _kernels(False).items()
        if hasattr(kernel, "cache")  # the autotuned ones
    }


def _run(name: str, rows: int, heads: int, args: tuple, meta: dict) -> None:
    """Runs kernel `name` on the grid (blocks of `rows`, heads); meta holds the constexprs."""
    import triton

    interpreting = _interpreting()
    kernel = _kernels(interpreting)[name]
    block = KERNELS[name][1]
    fixed = {}
    if interpreting:
        block_m, block_n = INTERPRETER_BLOCKS[name]
        fixed = {"BLOCK_M": block_m} | ({"BLOCK_N": block_n} if block_n else {})
    elif name == "_bwd_delta":
        fixed = {"BLOCK_M": DELTA_BLOCK[0], "num_warps": DELTA_BLOCK[1]}
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


def backward_variant() -> str:
    """LMFORGE_FLASH_BACKWARD's value (default two_kernel); a ValueError names the choices."""
    value = os.environ.get(BACKWARD_ENV, "") or BACKWARDS[0]
    if value not in BACKWARDS:
        raise ValueError(f"{BACKWARD_ENV}={value!r}: expected one of {', '.join(BACKWARDS)}")
    return value


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
    """(dq, dk, dv) in the inputs' dtypes (and layouts, where they are dense), by the backward
    variant LMFORGE_FLASH_BACKWARD names."""
    single_pass = backward_variant() == "single_pass"
    B, HQ, T, _ = q.shape
    HKV, n_keys = k.shape[1], k.shape[2]
    meta = _meta(q, v, causal, first_key is not None)
    delta = torch.empty_like(lse2)  # (B, Hq, T) fp32 rowsum(dO O)
    delta_args = (out, grad_out, delta, T, HQ, *_strides(out, grad_out))
    _run("_bwd_delta", T, B * HQ, delta_args, dict(D_V=meta["D_V"], BD_V=meta["BD_V"]))
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    # single pass: dQ summed in fp32 (scaled) by atomics, in q's layout; else a dummy pointer
    dq = torch.zeros_like(q, dtype=torch.float32) if single_pass else torch.empty_like(q)
    dq_acc = dq if single_pass else dk
    fk = first_key if first_key is not None else lse2.new_zeros(1, dtype=torch.int32)
    lr = last_rows(first_key, n_keys) if first_key is not None else fk
    common = (scale, T, n_keys, HQ, HQ // HKV, *_strides(q, k, v, grad_out))
    kv_args = (q, k, v, grad_out, lse2, delta, dk, dv, dq_acc, fk, lr, *common)
    kv_args += _strides(dk, dv) + (_strides(dq) if single_pass else (0, 0, 0))
    kv_meta = meta | {"ATOMIC_DQ": single_pass}
    _run("_bwd_kv_atomic" if single_pass else "_bwd_kv", n_keys, B * HKV, kv_args, kv_meta)
    if single_pass:
        return dq.to(q.dtype), dk, dv
    q_args = (q, k, v, grad_out, lse2, delta, dq, fk, *common, *_strides(dq))
    _run("_bwd_q", T, B * HQ, q_args, meta)
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
    backward_variant()  # a bad LMFORGE_FLASH_BACKWARD fails here, before the forward runs
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if first_key is not None and first_key.shape[0] != q.shape[0]:
        first_key = first_key.expand(q.shape[0], -1).contiguous()
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    out, _, row_max = _fwd_op(q, k, v, first_key, causal, float(scale))
    if not return_max_logits:
        return out
    return out, row_max.amax(dim=(0, 2))
