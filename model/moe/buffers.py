"""Balancing state that stays fp32 when the model is cast (`model.to(torch.bfloat16)`).

The selection bias moves in steps of ~1e-3 and the load counters reach millions: bf16 (8-bit
mantissa) would round both away, so `module.to(dtype)` keeps these buffers fp32 (devices still move).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn


class Fp32Buffers(nn.Module):
    fp32_buffers: tuple[str, ...] = ()  # names of this module's buffers to keep in fp32

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> nn.Module:
        before = {name: self._buffers.get(name) for name in self.fp32_buffers}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers.get(name)
            if old is None or new is None or new.dtype == torch.float32:
                continue
            if old.dtype == torch.float32 and new.is_floating_point():
                self._buffers[name] = old.to(new.device)  # the fp32 values, unrounded
        return self
