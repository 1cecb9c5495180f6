"""Mixed precision: `trainer.precision=bf16` (autocast over fp32 weights), `bf16_master` (bf16
weights for compute, fp32 master weights that the optimizer updates) or `fp32`.

With `bf16_master` the model the loop runs is bf16 throughout (no per-matmul casts), while
`MasterWeights.master`, an fp32 copy with the same parameter names, is what the optimizer
steps and what checkpoints hold: after backward the bf16 gradients move to the fp32 copy, and
after the update the copy is rounded back into the bf16 weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn


def autocast_factory(precision: str, device: torch.device) -> Callable[[], AbstractContextManager]:
    if precision == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext  # fp32, and bf16_master (the weights are bf16 already)


def compute_dtype(precision: str) -> torch.dtype:
    return torch.float32 if precision == "fp32" else torch.bfloat16


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
