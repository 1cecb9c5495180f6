"""Peak FLOP/s of the training device, for MFU = achieved model FLOP/s / peak.

GPUs: dense (no sparsity) tensor-core peaks from the vendors' data sheets, matched by name.
CPUs have no such table: a short square-matmul measurement in the training dtype stands in for
the peak (so CPU MFU reads "fraction of what this machine's matmul reaches"). It is measured
once per machine, thread count, dtype and torch version, on a machine not busy with other work
(a 1-minute load average under half the cores), and kept in
`~/.cache/lmforge/mfu_peaks.json` ($LMFORGE_CACHE_DIR or $XDG_CACHE_HOME/lmforge instead): a re-measurement at every start
read 1.09e12 and 4.39e11 FLOP/s in two starts on a busy machine, so a resumed run's MFU jumped.
Delete the file (or set trainer.peak_flops) to choose again.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

from data.atomic import atomic_write_json

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


def device_peak(
    device: torch.device, dtype: torch.dtype, configured: float, write_cache: bool = True
) -> tuple[float, str]:
    """(peak FLOP/s, how it was obtained) for MFU; a measurement is cached per machine (see the
    module docstring), written only when `write_cache` (one rank of a launch)."""
    if configured > 0:
        return configured, "configured (trainer.peak_flops)"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak(name, dtype)
        if peak is not None:
            return peak, f"data sheet of {name}"
    path, key = peak_cache(), machine_key(device, dtype)
    cached = _read_cache(path).get(key)
    if isinstance(cached, dict) and isinstance(cached.get("flops"), float):
        return float(
            cached["flops"]
        ), f"{key}, measured {cached.get('when', '?')} ({path}; delete it to re-measure)"
    load = busy_load()
    peak = measure_matmul_peak(device, dtype)
    if load is not None:  # other work shared the cores: a low reading must not stay
        return peak, f"{key}, measured now (not cached: the machine was busy, load {load:.1f})"
    if write_cache:
        entries = _read_cache(path) | {
            key: {"flops": peak, "when": time.strftime("%Y-%m-%d %H:%M")}
        }
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, entries)
        except OSError:  # a read-only home: measured again next time
            return peak, f"{key}, measured now (not cached: {path} is not writable)"
    return peak, f"{key}, measured now (cached in {path})"


def busy_load() -> float | None:
    """The 1-minute load average when other work occupies at least half the cores (a peak
    measured then reads low: 4.39e11 against 1.09e12 FLOP/s on one machine), else None."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # not on this platform: nothing to tell
        return None
    return load if load >= 0.5 * (os.cpu_count() or 1) else None


def peak_cache() -> Path:
    """$LMFORGE_CACHE_DIR, else $XDG_CACHE_HOME/lmforge, else ~/.cache/lmforge."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(os.environ.get("LMFORGE_CACHE_DIR") or Path(root) / "lmforge") / "mfu_peaks.json"


def machine_key(device: torch.device, dtype: torch.dtype) -> str:
    """What a measured peak depends on: the processor, the threads, the dtype, torch."""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    return (
        f"{str(dtype).removeprefix('torch.')} matmul on {where}{threads}, torch {torch.__version__}"
    )


def cpu_model() -> str:
    """The processor's name (/proc/cpuinfo's model name where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read_cache(path: Path) -> dict:
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or damaged: measured again
        return {}
    return entries if isinstance(entries, dict) else {}
