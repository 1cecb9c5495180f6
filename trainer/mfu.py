"""Peak FLOP/s of the training device, for MFU = achieved model FLOP/s / peak.

GPUs: dense (no sparsity) tensor-core peaks from the vendors' data sheets, matched by name.
CPUs have no such table: a short square-matmul measurement in the training dtype at start-up
stands in for the peak (so CPU MFU reads "fraction of what this machine's matmul reaches").
"""

from __future__ import annotations

import time

import torch

# name fragment -> (bf16 dense peak, tf32 dense peak) in FLOP/s, for SXM parts where both exist
GPU_PEAKS = {
    "B200": (2.25e15, 1.1e15),
    "H200": (989e12, 494e12),
    "H100": (989e12, 494e12),
    "GH200": (989e12, 494e12),
    "A100": (312e12, 156e12),
    "L40S": (362e12, 183e12),
    "A10G": (70e12, 35e12),
    "L4": (121e12, 60e12),
    "RTX 4090": (165e12, 82.6e12),
}


def gpu_peak(name: str, dtype: torch.dtype) -> float | None:
    for fragment, (bf16, tf32) in GPU_PEAKS.items():
        if fragment in name:
            return bf16 if dtype == torch.bfloat16 else tf32
    return None


def measure_matmul_peak(device: torch.device, dtype: torch.dtype, seconds: float = 1.0) -> float:
    """Best FLOP/s of repeated n x n matmuls over ~`seconds`, the best over a few sizes.

    CPUs (oneDNN/AMX) reach their best only from n = 2048 (n = 1024 reads ~30% lower on a
    Sapphire Rapids core), so both are tried there and the higher counts: an underestimated
    peak would overstate MFU. GPUs use n = 8192. A dtype the device only emulates (bf16 on an
    AVX2 CPU: 1.3 GFLOP/s, a 2048^3 matmul 14 s) is measured from one matmul of the smaller
    size, so that start-up takes about `seconds` there too, not minutes.
    """
    sizes = (8192,) if device.type == "cuda" else (1024, 2048)
    best = 0.0
    for i, n in enumerate(sizes):
        best = max(best, _best_matmul_rate(device, dtype, n, seconds / len(sizes)))
        if i + 1 < len(sizes) and 2 * sizes[i + 1] ** 3 / best > seconds:
            break  # one matmul of the next size alone would take longer than the budget
    return best


def _best_matmul_rate(device: torch.device, dtype: torch.dtype, n: int, seconds: float) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    _sync(device)
    start = time.perf_counter()
    a @ b
    _sync(device)
    first = time.perf_counter() - start
    if first > seconds:  # an emulated dtype: one cold call is all the budget allows
        return 2 * n**3 / first
    best, deadline = 0.0, time.perf_counter() + seconds
    for _ in range(2):  # warm-up (thread pools, kernels), after the first call above
        a @ b
    while time.perf_counter() < deadline or best == 0.0:
        _sync(device)
        start = time.perf_counter()
        for _ in range(2):
            a @ b
        _sync(device)
        best = max(best, 2 * 2 * n**3 / (time.perf_counter() - start))
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_peak(device: torch.device, dtype: torch.dtype, configured: float) -> tuple[float, str]:
    """(peak FLOP/s, how it was obtained) for MFU."""
    if configured > 0:
        return configured, "configured (trainer.peak_flops)"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak(name, dtype)
        if peak is not None:
            return peak, f"data sheet of {name}"
    return measure_matmul_peak(device, dtype), f"measured {dtype} matmul on {device.type}"
