"""Normalization layers (registry NORMS). Shapes: (..., C) with C the normalized width.

(The residual styles are in model/residual/stream.py.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from model import roles
from model.config import KernelsConfig
from model.kernels.fused import rms_norm
from model.registry import NORMS


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of reductions and small fp32 maths: fp32, or the input's when wider (fp64 tests)."""
    return torch.promote_types(dtype, torch.float32)


class RMSNormFunction(torch.autograd.Function):
    """y = x rstd w with rstd = 1 / sqrt(mean(x^2) + eps), in the wide dtype, y in x's dtype.

    Its backward is the closed form (x^ = x rstd, g = dy w):
        dx = rstd (g - x^ mean(g x^)),   dw = sum over rows of dy x^
    in four elementwise passes, a row sum and a matrix-vector product. On CPU, F.rms_norm has no
    fused kernel: autograd replays each of its pieces' backward (pow, mean, rsqrt, two products,
    a sum), 1.18-1.50x slower, and also keeps the normalized x in fp32 (bench/rms_norm.py); this
    keeps x (alive anyway as the residual stream) and rstd (..., 1). CUDA has fused F.rms_norm
    kernels, so RMSNorm uses this on CPU only. No double backward (rstd is saved as a constant).
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        wide = x.to(wide_dtype(x.dtype))
        rstd = torch.rsqrt(wide.square().mean(dim=-1, keepdim=True) + eps)  # (..., 1)
        ctx.save_for_backward(x, weight, rstd)
        return (wide * rstd * weight.to(wide.dtype)).to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor):
        x, weight, rstd = ctx.saved_tensors  # x (..., C), weight (C,), rstd (..., 1) wide
        want_x, want_w = ctx.needs_input_grad[:2]
        with torch.autocast(dy.device.type, enabled=False):  # the products stay wide
            w = weight.to(rstd.dtype)
            scaled = dy * rstd  # dy rstd, wide: x^ is never formed
            rows = (scaled * x).reshape(-1, x.shape[-1])  # (N, C) = dy x^
            dw = rows.sum(dim=0).to(weight.dtype) if want_w else None
            dx = None
            if want_x:  # dx = rstd (g - x^ mean(g x^)) = dy rstd w - x rstd^2 mean(dy x^ w)
                coef = (rows @ w).view_as(rstd) * rstd.square() / -x.shape[-1]  # (..., 1)
                dx = torch.addcmul(scaled * w, x, coef).to(x.dtype)
        return dx, dw, None


@NORMS.register("rms")
class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back to the input dtype."""

    kernel = "torch"  # torch | triton (model.kernels.rms_norm: model/kernels/fused.py)

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def param_roles(self) -> dict[str, str]:
        return {"weight": roles.GAIN}

    def use_kernels(self, kernels: KernelsConfig) -> None:
        self.kernel = kernels.rms_norm

    def forward(self, x: Tensor) -> Tensor:
        if self.kernel == "triton":
            return rms_norm(x, self.weight, self.eps)
        if x.device.type == "cpu":
            return RMSNormFunction.apply(x, self.weight, self.eps)
        wide = wide_dtype(x.dtype)  # fp32 (fp64 stays fp64); CUDA's fused kernels
        y = F.rms_norm(x.to(wide), (x.shape[-1],), eps=self.eps)
        return (y * self.weight.to(wide)).to(x.dtype)

    def add_and_normalize(self, x: Tensor, residual: Tensor) -> Tensor:
        """norm(x + residual): one pass with the fused kernel, else the add then the norm."""
        if self.kernel == "triton":
            dtype = torch.result_type(x, residual)  # autocast: an fp32 stream + a bf16 output
            return rms_norm(x.to(dtype), self.weight, self.eps, residual=residual.to(dtype))[0]
        return self(x + residual)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


@NORMS.register("layer")
class LayerNorm(nn.Module):
    """Standard LayerNorm (mean-centred, weight and bias), computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim))

    def param_roles(self) -> dict[str, str]:
        return {"weight": roles.GAIN, "bias": roles.BIAS}

    def forward(self, x: Tensor) -> Tensor:
        y = F.layer_norm(
            x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps
        )
        return y.to(x.dtype)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)


class GatedRMSNorm(nn.Module):
    """RMSNorm of x, then times act(gate): norm before gate. Gated DeltaNet (act SiLU) casts the
    normalized x back before the weight; KDA (act sigmoid, `strict_fp32`) keeps it all in fp32."""

    def __init__(
        self, dim: int, eps: float = 1e-6, activation: str = "silu", strict_fp32: bool = False
    ) -> None:
        super().__init__()
        self.eps, self.strict_fp32 = eps, strict_fp32
        self.activation = {"silu": F.silu, "sigmoid": torch.sigmoid}[activation]
        self.weight = nn.Parameter(torch.empty(dim))

    def param_roles(self) -> dict[str, str]:
        return {"weight": roles.GAIN}

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        wide = wide_dtype(x.dtype)  # fp32 (fp64 stays fp64)
        y = F.rms_norm(x.to(wide), (x.shape[-1],), eps=self.eps)
        y = y * self.weight.to(wide) if self.strict_fp32 else y.to(x.dtype) * self.weight
        return (y * self.activation(gate.to(wide))).to(x.dtype)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


def build_norm(kind: str, dim: int, eps: float) -> nn.Module:
    return NORMS.get(kind)(dim, eps)
