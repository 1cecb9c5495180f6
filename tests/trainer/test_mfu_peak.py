"""The MFU peak measured at start-up: what it runs, and that a dtype the CPU only emulates
(bf16 without AVX512-BF16 / AMX: a 2048^3 matmul took 14 s on an AVX2 CPU) costs one matmul,
not minutes."""

from __future__ import annotations

import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.mfu import device_peak, gpu_peak, measure_matmul_peak


class CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            self.sizes.append(args[0].shape[0])
        return func(*args, **(kwargs or {}))


def test_a_budget_one_matmul_exceeds_stops_after_that_matmul():
    # a budget below one 1024^3 matmul's time stands for a slow (emulated) dtype
    with CountMatmuls() as counted:
        peak = measure_matmul_peak(torch.device("cpu"), torch.float32, seconds=1e-9)
    assert counted.sizes == [1024]
    assert 1e8 < peak < 1e14  # FLOP/s of that one matmul: 2 n^3 over its time


def test_a_fast_dtype_tries_both_sizes_and_repeats_them():
    with CountMatmuls() as counted:
        peak = measure_matmul_peak(torch.device("cpu"), torch.float32, seconds=2.0)
    assert set(counted.sizes) == {1024, 2048} and counted.sizes.count(2048) >= 3
    assert peak > 1e9


def test_a_configured_peak_or_the_data_sheet_wins():
    assert device_peak(torch.device("cpu"), torch.bfloat16, 1e12) == (
        1e12,
        "configured (trainer.peak_flops)",
    )
    assert gpu_peak("NVIDIA H200", torch.bfloat16) == 989e12
    assert gpu_peak("NVIDIA H100 80GB HBM3", torch.float32) == 494e12
    assert gpu_peak("Some Future GPU", torch.bfloat16) is None


def test_a_measured_peak_is_cached_per_machine_and_read_back_without_measuring(
    tmp_path, monkeypatch
):
    """Re-measuring at every start gave 1.09e12 and 4.39e11 FLOP/s on a busy machine: the first
    measurement is kept (per processor, threads, dtype and torch) and said where."""
    monkeypatch.delenv("LMFORGE_CACHE_DIR", raising=False)  # (the tests' own, tests/conftest.py)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # a quiet machine
    cpu = torch.device("cpu")
    with CountMatmuls() as counted:
        first, how = device_peak(cpu, torch.float32, 0.0)
    assert counted.sizes and "measured now (cached in" in how and "float32 matmul on" in how
    with CountMatmuls() as counted:
        again, how = device_peak(cpu, torch.float32, 0.0)
    assert counted.sizes == [] and again == first and "delete it to re-measure" in how
    assert f"{torch.get_num_threads()} threads" in how
    (tmp_path / "lmforge" / "mfu_peaks.json").write_text("{not json")  # damaged: measured again
    with CountMatmuls() as counted:
        device_peak(cpu, torch.float32, 0.0, write_cache=False)
    assert counted.sizes


def test_a_peak_measured_on_a_busy_machine_is_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("LMFORGE_CACHE_DIR", str(tmp_path / "lmforge"))
    monkeypatch.setattr(os, "getloadavg", lambda: (float(os.cpu_count()), 0.0, 0.0))
    _, how = device_peak(torch.device("cpu"), torch.float32, 0.0)
    assert "not cached: the machine was busy, load" in how
    assert not (tmp_path / "lmforge" / "mfu_peaks.json").exists()
