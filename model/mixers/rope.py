"""Rotary position embedding: frequency ladders with context-extension variants, and the two pairings.

Shapes: positions (B, T) int; inv_freq (R/2,); rot (B, T, R/2) complex64 = factor * e^(i pos inv_freq);
x (B, T, H, D) with R <= D the rotary dims (partial rotary rotates the first R dims of each head and
passes the rest through). The rotations travel as one complex tensor, not as float cos/sin, so that
FSDP2's mixed-precision input casting (which casts floating tensors to bf16) leaves them in fp32.

Pairings. RoPE rotates 2-D pairs of dims, pair i by angle pos * inv_freq[i]:
  interleaved: pair i = dims (2i, 2i+1)      Meta's original Llama, GPT-J, DeepSeek's reference code
  half:        pair i = dims (i, i + R/2)    GPT-NeoX and every Hugging Face Llama/Qwen checkpoint
Both compute the same attention scores once the q/k projection rows of each head are permuted:
`interleaved_to_half` reorders dims [0, 2, 4, ..., R-2, 1, 3, ..., R-1]; applied to the rows of W_q
and W_k (per head) it turns an interleaved model into an equivalent half-split one (this is what
Meta -> HF conversion does), and `half_to_interleaved` is its inverse.

Scalings (registry ROPE_SCALINGS) return (inv_freq, attention_factor); attention_factor multiplies
cos and sin, so YaRN's temperature scales the rotary logits by its square.
  linear       inv_freq / s (position interpolation)
  ntk          theta * s^(R/(R-2)): NTK-aware base change, high frequencies kept, lowest divided by s
  dynamic_ntk  the ntk base recomputed from the current length L once L > L0:
               theta * (s L / L0 - (s - 1))^(R/(R-2)). An inference-time scaling: with a KV cache,
               keys keep the frequencies they were written with, so decoding past L0 differs from
               a full forward over the same tokens (as in transformers).
  yarn         per-dim ramp between interpolation (inv_freq / s) and extrapolation, by how many
               rotations a dim completes over L0 (beta_slow .. beta_fast), plus the temperature
               0.1 ln(s) + 1 (DeepSeek's mscale / mscale_all_dim form supported)
  llama3       Llama 3.1's wavelength bands: long wavelengths / s, short kept, smooth in between
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from model.config import RopeConfig
from model.registry import ROPE_PAIRINGS, ROPE_SCALINGS


def base_inv_freq(theta: float, rotary_dim: int) -> Tensor:
    """theta^(-2i/R) for i < R/2, in fp32: (R/2,)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (theta**exponents)


def yarn_mscale(factor: float, weight: float = 1.0) -> float:
    """YaRN's temperature sqrt(1/t) = 0.1 * weight * ln(s) + 1 (1 when not extending)."""
    return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0


def softmax_multiplier(cfg: RopeConfig) -> float:
    """Extra softmax scale for DeepSeek-style YaRN (mscale_all_dim applies to every logit dim)."""
    if cfg.scaling == "yarn" and cfg.mscale_all_dim:
        return yarn_mscale(cfg.factor, cfg.mscale_all_dim) ** 2
    return 1.0


# Each scaling: (cfg, R, L0 = original context, L = current length) -> (inv_freq (R/2,), cos/sin factor)


@ROPE_SCALINGS.register("none")
def _plain(cfg: RopeConfig, dim: int, original: int, length: int) -> tuple[Tensor, float]:
    return base_inv_freq(cfg.theta, dim), 1.0


@ROPE_SCALINGS.register("linear")
def _linear(cfg: RopeConfig, dim: int, original: int, length: int) -> tuple[Tensor, float]:
    return base_inv_freq(cfg.theta, dim) / cfg.factor, 1.0


@ROPE_SCALINGS.register("ntk")
def _ntk(cfg: RopeConfig, dim: int, original: int, length: int) -> tuple[Tensor, float]:
    return base_inv_freq(cfg.theta * cfg.factor ** (dim / (dim - 2)), dim), 1.0


@ROPE_SCALINGS.register("dynamic_ntk")
def _dynamic_ntk(cfg: RopeConfig, dim: int, original: int, length: int) -> tuple[Tensor, float]:
    length = max(length, original)
    stretch = cfg.factor * length / original - (cfg.factor - 1)
    return base_inv_freq(cfg.theta * stretch ** (dim / (dim - 2)), dim), 1.0


def _yarn_correction_dim(rotations: float, dim: int, theta: float, original: int) -> float:
    """The (fractional) dim index whose wavelength completes `rotations` turns over `original`."""
    return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))


@ROPE_SCALINGS.register("yarn")
def _yarn(cfg: RopeConfig, dim: int, original: int, length: int) -> tuple[Tensor, float]:
    low = max(math.floor(_yarn_correction_dim(cfg.beta_fast, dim, cfg.theta, original)), 0)
    high = min(math.ceil(_yarn_correction_dim(cfg.beta_slow, dim, cfg.theta, original)), dim - 1)
    high = high + 0.001 if low == high else high  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = base_inv_freq(cfg.theta, dim)
    interpolated = extrapolated / cfg.factor
    # ramp 0 (fast dims, many rotations): keep; ramp 1 (slow dims): interpolate
    inv_freq = extrapolated * (1 - ramp) + interpolated * ramp
    if cfg.attention_factor:
        factor = cfg.attention_factor
    elif cfg.mscale and cfg.mscale_all_dim:
        factor = yarn_mscale(cfg.factor, cfg.mscale) / yarn_mscale(cfg.factor, cfg.mscale_all_dim)
    else:
        factor = yarn_mscale(cfg.factor)
    return inv_freq, factor


@ROPE_SCALINGS.register("llama3")
def _llama3(cfg: RopeConfig, dim: int, original: int, length: int) -> tuple[Tensor, float]:
    inv_freq = base_inv_freq(cfg.theta, dim)
    wavelen = 2 * math.pi / inv_freq
    long_wavelen = original / cfg.low_freq_factor  # longer than this: interpolate fully
    short_wavelen = original / cfg.high_freq_factor  # shorter than this: keep
    smooth = (original / wavelen - cfg.low_freq_factor) / (
        cfg.high_freq_factor - cfg.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / cfg.factor + smooth * inv_freq
    out = torch.where(wavelen > long_wavelen, inv_freq / cfg.factor, inv_freq)
    middle = (wavelen >= short_wavelen) & (wavelen <= long_wavelen)
    return torch.where(middle, blended, out), 1.0


def rope_frequencies(
    cfg: RopeConfig, rotary_dim: int, original: int, length: int
) -> tuple[Tensor, float]:
    """(inv_freq (R/2,), cos/sin factor) for the configured scaling at current length `length`."""
    return ROPE_SCALINGS.get(cfg.scaling)(cfg, rotary_dim, original, length)


def rope_rotations(positions: Tensor, inv_freq: Tensor, factor: float) -> Tensor:
    """factor * (cos + i sin) of positions * inv_freq: (B, T, R/2) complex64."""
    angles = positions.float()[..., None] * inv_freq.float()
    return torch.polar(torch.full_like(angles, factor), angles)


def cos_sin(rot: Tensor) -> tuple[Tensor, Tensor]:
    """(B, T, R/2) complex -> cos, sin each (B, T, 1, R/2) fp32, broadcast over heads."""
    parts = torch.view_as_real(rot)[:, :, None]  # (B, T, 1, R/2, 2)
    return parts[..., 0], parts[..., 1]


# ---- applying the rotation (registry ROPE_PAIRINGS): x (B, T, H, D), rot (B, T, R/2) complex -------


def _rotate(x1: Tensor, x2: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@ROPE_PAIRINGS.register("half")
def apply_rope_half(x: Tensor, rot: Tensor) -> Tensor:
    # each head as its two halves (B, T, H, 2, R/2): out = x cos + swap(x) (-sin, sin), swap
    # exchanging the halves: bitwise what _rotate gives per half (a - b is a + (-b) in IEEE
    # arithmetic) in one pass over whole heads, with no concatenated copy of x. cos and sin are
    # first made contiguous (view_as_real interleaves them), so compiled code loads them as
    # vectors; concatenating (x2, x1) instead made Inductor gather element by element through
    # masks (bench/rope_pairing.py: 1.41-1.56x compiled, 1.08-1.15x eager)
    half = rot.shape[-1]
    r = 2 * half
    rows = torch.view_as_real(rot).transpose(-1, -2).contiguous()  # (B, T, 2, R/2): cos; sin
    cos, sin = rows[:, :, None, 0, None], rows[:, :, None, 1]  # (B, T, 1, 1, R/2), (B, T, 1, R/2)
    signed_sin = torch.stack([-sin, sin], dim=-2)  # (B, T, 1, 2, R/2)
    part = x[..., :r].float().unflatten(-1, (2, half))  # (B, T, H, 2, R/2)
    out = (part * cos + part.flip(-2) * signed_sin).flatten(-2).to(x.dtype)
    return out if r == x.shape[-1] else torch.cat([out, x[..., r:]], dim=-1)


@ROPE_PAIRINGS.register("interleaved")
def apply_rope_interleaved(x: Tensor, rot: Tensor) -> Tensor:
    r = 2 * rot.shape[-1]
    cos, sin = cos_sin(rot)
    part, rest = x[..., :r].float(), x[..., r:]
    a, b = _rotate(part[..., 0::2], part[..., 1::2], cos, sin)
    return torch.cat([torch.stack([a, b], dim=-1).flatten(-2).to(x.dtype), rest], dim=-1)


def rope_applier(pairing: str, kernel: str = "torch") -> Callable[[Tensor, Tensor], Tensor]:
    """(x, rot) -> x rotated in `pairing`, by torch's ops or the fused Triton kernel."""
    if kernel == "triton":
        return functools.partial(_fused_rope, interleaved=pairing == "interleaved")
    return ROPE_PAIRINGS.get(pairing)


def _fused_rope(x: Tensor, rot: Tensor, *, interleaved: bool) -> Tensor:
    from model.kernels.fused import rope

    return rope(x, rot, interleaved)


def interleaved_to_half(rotary_dim: int, head_dim: int) -> Tensor:
    """Index over one head's dims that turns the interleaved layout into the half-split one."""
    rot = torch.cat([torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)])
    return torch.cat([rot, torch.arange(rotary_dim, head_dim)])


def half_to_interleaved(rotary_dim: int, head_dim: int) -> Tensor:
    """Inverse of `interleaved_to_half`."""
    return torch.argsort(interleaved_to_half(rotary_dim, head_dim))
