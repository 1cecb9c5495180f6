"""Mixed precision: `trainer.precision=bf16` (autocast over fp32 weights), `bf16_master` (bf16
weights for compute, fp32 master weights that the optimizer updates), `float8` (bf16 with the
qualifying matmuls in float8: parallel/float8.py), `fp32`, or `auto` (the
default: bf16 where the device multiplies bf16 natively, else fp32; `resolve_precision`).

Why auto: a CPU without bf16 instructions (measured on an AVX2-only AMD EPYC, Zen 3) runs bf16
matmuls through a slow fallback, 78x slower than fp32 (a 2048 x 256
by 256 x 768 matmul on an AVX2 AMD EPYC: 649 ms bf16, 8.3 ms fp32), while one with AVX512-BF16
or AMX runs them about twice as fast as fp32.

With `bf16_master` the model the loop runs is bf16 throughout (no per-matmul casts), while
`MasterWeights.master`, an fp32 copy with the same parameter names, is what the optimizer
steps and what checkpoints hold: after backward the bf16 gradients move to the fp32 copy, and
after the update the copy is rounded back into the bf16 weights.
"""

from __future__ import annotations

import contextlib
import platform
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import torch
from torch import nn


def resolve_precision(precision: str, device: torch.device) -> str:
    """trainer.precision with `auto` made concrete for `device`: bf16 where bf16 matmuls are
    native (`native_bf16`), else fp32. Other values pass through."""
    if precision != "auto":
        return precision
    return "bf16" if native_bf16(device)[0] else "fp32"


def native_bf16(device: torch.device) -> tuple[bool, str]:
    """(whether `device` multiplies bf16 natively, why): CUDA devices with bf16 tensor cores
    (Ampere on); CPUs by their feature flags (`cpu_has_bf16`), so every run on a machine
    decides alike. (optim.newton_schulz.iteration_dtype asks the same of the CPU: optim
    imports nothing of ours.)"""
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported(including_emulation=False)
        name = torch.cuda.get_device_name(device)
        return ok, f"{name} {'has' if ok else 'has no'} bf16 tensor cores"
    if device.type != "cpu":
        return True, f"{device.type} device"
    ok = cpu_has_bf16()
    return ok, f"this CPU ({platform.machine()}) {'has' if ok else 'has no'} bf16 instructions"


def cpu_has_bf16() -> bool:
    """x86: AVX512-BF16 or AMX; aarch64 Linux: the `bf16` feature (Graviton 3, Neoverse V1 on);
    elsewhere False (fp32 is the safe guess where bf16 may be emulated)."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    if machine in ("aarch64", "arm64") and Path("/proc/cpuinfo").exists():
        features = Path("/proc/cpuinfo").read_text().split()
        return "bf16" in features
    return False


def autocast_factory(precision: str, device: torch.device) -> Callable[[], AbstractContextManager]:
    _require_resolved(precision)
    if precision in ("bf16", "float8"):  # float8: the matmuls torchao converts, bf16 elsewhere
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext  # fp32, and bf16_master (the weights are bf16 already)


def compute_dtype(precision: str) -> torch.dtype:
    _require_resolved(precision)
    return torch.float32 if precision == "fp32" else torch.bfloat16


def _require_resolved(precision: str) -> None:
    if precision == "auto":
        raise ValueError("precision 'auto' must be resolved for a device first (resolve_precision)")


class MasterWeights:
    """fp32 master copy of a model whose own parameters become bf16.

    `copy` is an fp32 module of the same structure (built apart, not deep-copied: the model may
    already be rewritten for activation checkpointing or compile); it takes the model's values.
    Parameters the model keeps in fp32 (`keep_fp32` modules: stream maps, Engram's tables) are
    shared with the copy, not copied: no per-step copies of a large table."""

    def __init__(self, model: nn.Module, copy: nn.Module):
        copy.load_state_dict(model.state_dict())
        self.master = copy  # fp32, same names (checkpoints, export)
        model.to(torch.bfloat16)
        self.pairs = list(zip(model.parameters(), self.master.parameters()))
        self.shared = set()  # ids of the masters that share the model's fp32 storage
        for param, master in self.pairs:
            if param.dtype == torch.float32:  # kept fp32 (`keep_fp32` modules): one tensor
                master.data = param.data
                self.shared.add(id(master))
        # persistent buffers the training loop changes (MoE selection biases) live on the model
        saved = model.state_dict().keys()
        master_buffers = dict(self.master.named_buffers())
        self.buffer_pairs = [
            (buffer, master_buffers[name])
            for name, buffer in model.named_buffers()
            if name in saved
        ]

    def grads_to_master(self) -> None:
        for param, master in self.pairs:  # (.float() of an fp32 gradient is itself: no copy)
            master.grad = None if param.grad is None else param.grad.float()
            param.grad = None

    @torch.no_grad()
    def master_to_model(self, buffers: bool = False) -> None:
        """Round the master weights into the model (and, after a resume, its buffers too)."""
        for param, master in self.pairs:
            if id(master) not in self.shared:
                param.copy_(master)
        if buffers:
            for buffer, master in self.buffer_pairs:
                buffer.copy_(master)

    @torch.no_grad()
    def buffers_to_master(self) -> None:
        """Before a checkpoint: the model's buffers (e.g. MoE expert biases) into the copy."""
        for buffer, master in self.buffer_pairs:
            master.copy_(buffer)
