"""Causal attention forward + backward on CPU in bf16 (or --dtype fp32), per sequence length, through each kernel
the trainer can use: SDPA's default dispatch (the flash kernel for causal bf16), SDPA's math
kernel, the plain matmul - softmax - matmul kernel (`model.attention.backend=matmul`) eager and
under torch.compile, and that kernel given the causal mask as a per-row bool mask
(`matmul_masked_fill`: scale and masked_fill passes after the GEMM, the path of document masks
and, before issue 21, of every mask; a shared mask now enters the GEMM as baddbmm's bias). The tokens per batch stay fixed (B x T = --tokens); heads are the tiny
preset's (4 query heads on 2 kv heads of 64). `auto` picks matmul up to
model.mixers.attention_backend.MATMUL_MAX_KEYS keys in bf16 (prefers_matmul); the last columns say what
this run measured and what auto takes.

    python bench/attention_kernels.py [--tokens 4096] [--lengths 128 256 512 1024 2048] [--dtype fp32]
Writes bench/results/attention_kernels_cpu.json (_fp32.json in fp32).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.machine import machine
from model.mixers.attention_backend import MATMUL_MAX_KEYS, matmul_attention, prefers_matmul
from model.mixers.masks import AttentionContext

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CAUSAL = AttentionContext(positions=None, rope=None, mask=None, is_causal=True, start=0)


def sdpa_default(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def sdpa_math(q, k, v):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def matmul(q, k, v):
    return matmul_attention(q, k, v, CAUSAL, q.shape[-1] ** -0.5, False)[0]


def matmul_masked_fill(q, k, v):
    B, T = q.shape[0], q.shape[2]
    per_row = torch.ones(T, T, dtype=torch.bool).tril().expand(B, 1, T, T)
    ctx = AttentionContext(positions=None, rope=None, mask=per_row, is_causal=False, start=0)
    return matmul_attention(q, k, v, ctx, q.shape[-1] ** -0.5, False)[0]


KERNELS: dict[str, Callable] = {
    "sdpa": sdpa_default,
    "sdpa_math": sdpa_math,
    "matmul": matmul,
    "matmul_masked_fill": matmul_masked_fill,
    "matmul_compiled": torch.compile(matmul, dynamic=False),
}


def seconds(kernel: Callable, shape: tuple[int, int, int, int, int], dtype: torch.dtype) -> float:
    """Median seconds of one forward + backward (after two warm-up calls); shape (batch,
    query heads, kv heads, sequence length, head dim)."""
    batch, heads, kv_heads, seq, dim = shape
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, seq, dim, generator=gen).to(dtype).requires_grad_()
    k, v = (
        torch.randn(batch, kv_heads, seq, dim, generator=gen).to(dtype).requires_grad_()
        for _ in range(2)
    )
    grad = torch.randn(batch, heads, seq, dim, generator=gen).to(dtype)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        kernel(q, k, v).backward(grad)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def kernel_seconds(shape: tuple[int, int, int, int, int], dtype: torch.dtype) -> dict[str, float]:
    return {name: seconds(f, shape, dtype) for name, f in KERNELS.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    rows = []
    print("| T | B | " + " | ".join(KERNELS) + " | fastest | auto |")
    print("|---:|---:|" + "---:|" * len(KERNELS) + "---|---|")
    for seq in args.lengths:
        batch = max(1, args.tokens // seq)
        times = kernel_seconds((batch, 4, 2, seq, 64), dtype)
        eager = {name: t for name, t in times.items() if not name.endswith("compiled")}
        fastest = min(eager, key=eager.get)
        probe = torch.empty(1, 1, seq, 64, dtype=dtype)
        auto = "matmul" if prefers_matmul(probe, probe, 0) else "sdpa"
        rows.append({"seq_len": seq, "batch": batch, "seconds": times, "fastest_eager": fastest})
        cells = " | ".join(f"{1e3 * t:.1f} ms" for t in times.values())
        print(f"| {seq} | {batch} | {cells} | {fastest} | {auto} |")
    report = {
        "benchmark": "attention_kernels",
        "args": vars(args),
        "dtype": args.dtype,
        "machine": machine(torch_threads=torch.get_num_threads()),
        "heads": {"query": 4, "kv": 2, "dim": 64},
        "matmul_max_keys": MATMUL_MAX_KEYS,
        "rows": rows,
    }
    suffix = "_fp32" if args.dtype == "fp32" else ""
    out = Path(__file__).parent / "results" / f"attention_kernels_cpu{suffix}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
