"""trainer.precision=auto: bf16 where the device multiplies bf16 natively, else fp32, decided
from the CPU's feature flags (an AVX2-only CPU runs bf16 matmuls 78x slower than fp32); the
run's choice in its log, a warning when bf16 is asked for where it is emulated; Muon's
Newton-Schulz iterates in the same dtype (optim.newton_schulz.iteration_dtype)."""

from __future__ import annotations

import logging

import pytest
import torch

from optim import newton_schulz
from parallel import precision
from parallel.precision import autocast_factory, compute_dtype, resolve_precision
from trainer.app import choose_precision

CPU = torch.device("cpu")


@pytest.fixture
def x86(monkeypatch):
    """An x86 CPU whose bf16 instructions the test sets (x86(True) / x86(False))."""
    monkeypatch.setattr(precision.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)

    def set_bf16(has: bool) -> None:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: has)

    return set_bf16


@pytest.mark.parametrize(("has_bf16", "expected"), [(True, "bf16"), (False, "fp32")])
def test_auto_takes_bf16_only_where_the_cpu_has_bf16_instructions(x86, has_bf16, expected):
    x86(has_bf16)
    assert resolve_precision("auto", CPU) == expected
    for explicit in ("bf16", "bf16_master", "fp32"):  # an explicit choice is kept
        assert resolve_precision(explicit, CPU) == explicit


def test_amx_counts_as_bf16(x86, monkeypatch):
    x86(False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert resolve_precision("auto", CPU) == "bf16"


def test_aarch64_reads_the_bf16_feature(monkeypatch, tmp_path):
    monkeypatch.setattr(precision.platform, "machine", lambda: "aarch64")
    cpuinfo = tmp_path / "cpuinfo"
    monkeypatch.setattr(precision, "Path", lambda _: cpuinfo)
    cpuinfo.write_text("Features\t: fp asimd sve bf16 i8mm\n")
    assert precision.cpu_has_bf16()
    cpuinfo.write_text("Features\t: fp asimd evtstrm aes\n")
    assert not precision.cpu_has_bf16()


def test_an_unresolved_auto_is_refused_where_a_dtype_is_needed():
    with pytest.raises(ValueError, match="resolve_precision"):
        autocast_factory("auto", CPU)
    with pytest.raises(ValueError, match="resolve_precision"):
        compute_dtype("auto")


def test_the_run_logs_its_choice_and_warns_about_emulated_bf16(x86, caplog):
    x86(False)
    with caplog.at_level(logging.INFO, logger="trainer"):
        assert choose_precision("auto", CPU) == "fp32"
        assert choose_precision("bf16", CPU) == "bf16"  # warned, not overridden
        assert choose_precision("fp32", CPU) == "fp32"
    messages = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert messages[0] == (
        "INFO",
        "trainer.precision=auto: fp32 (this CPU (x86_64) has no bf16 instructions)",
    )
    assert messages[1][0] == "WARNING" and "trainer.precision=bf16, but this CPU" in messages[1][1]
    assert len(messages) == 2


@pytest.mark.parametrize(("has_bf16", "dtype"), [(True, torch.bfloat16), (False, torch.float32)])
def test_newton_schulz_iterates_in_bf16_only_where_it_is_native(monkeypatch, has_bf16, dtype):
    monkeypatch.setattr(newton_schulz, "_cpu_has_bf16", lambda: has_bf16)
    assert newton_schulz.iteration_dtype(CPU) == dtype
    assert newton_schulz.iteration_dtype(torch.device("cuda")) == torch.bfloat16
    seen = []
    plain_baddbmm = torch.baddbmm
    monkeypatch.setattr(
        torch, "baddbmm", lambda *a, **k: seen.append(a[1].dtype) or plain_baddbmm(*a, **k)
    )
    g = torch.randn(2, 16, 24)
    coefficients = newton_schulz.coefficient_schedule("quintic", 2)
    out = newton_schulz.orthogonalize(g, coefficients)
    assert out.dtype == torch.bfloat16 and out.shape == g.shape  # the result is bf16 either way
    assert seen and set(seen) == {dtype}
