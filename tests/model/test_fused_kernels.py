"""The fused Triton training kernels (model/kernels/fused.py) under Triton's interpreter on CPU,
forward and backward, against the torch modules they replace: RMSNorm (model/norms.py, also with
the residual add of a post-norm connection), RoPE in both pairings with partial rotary
(model/mixers/rope.py), SwiGLU's gate (model/ffn.py). fp32 to 1e-6 (the same arithmetic, another order),
bf16 within its rounding. Skipped where triton is not installed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model.mixers.rope import apply_rope_half, apply_rope_interleaved, base_inv_freq, rope_rotations
from model.norms import RMSNorm

pytest.importorskip("triton")
from model.kernels.fused import rms_norm, rope, swiglu

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6)}


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).requires_grad_()


def grads(out, leaves, seed=9):
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    return torch.autograd.grad(out, leaves, cotangent)


def assert_close(got, want, dtype, msg=""):
    """bf16: within 2% of the reference's largest value (a few roundings of the operands)."""
    assert got.dtype == want.dtype, msg
    tol = (
        TOL[dtype]
        if dtype == torch.float32
        else dict(rtol=2e-2, atol=2e-2 * want.abs().max().item())
    )
    torch.testing.assert_close(got.float(), want.float(), **tol, msg=msg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("C", [64, 100])
def test_rms_norm_equals_the_module(dtype, C):
    x = rand(3, 7, C, dtype=dtype)
    norm = RMSNorm(C, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(C) + 0.5)
    w = norm.weight.detach().clone().requires_grad_()
    got = rms_norm(x, w, 1e-5)
    want = norm(x)
    assert_close(got, want, dtype)
    for name, a, b in zip(
        ("dx", "dw"), grads(got, (x, w)), grads(want, (x, norm.weight)), strict=True
    ):
        assert_close(a, b.to(a.dtype), dtype, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_the_residual_add_equals_add_then_norm(dtype):
    """norm(x + r) and the sum x + r, in one pass: a post-norm connection's add and norm. The
    sum's own gradient (it is also the next block's input) flows into both inputs."""
    C = 48
    x, r = rand(2, 5, C, dtype=dtype), rand(2, 5, C, dtype=dtype, seed=1)
    w = (torch.rand(C, generator=torch.Generator().manual_seed(2)) + 0.5).requires_grad_()
    y, h = rms_norm(x, w, 1e-6, residual=r)
    ref_h = x + r
    ref_y = (F.rms_norm(ref_h.float(), (C,), eps=1e-6) * w).to(dtype)
    assert_close(h, ref_h, dtype, "h")
    assert_close(y, ref_y, dtype, "y")
    cy, ch = torch.randn(2, 2, 5, C, generator=torch.Generator().manual_seed(4)).to(dtype)
    got = torch.autograd.grad((y * cy).sum() + (h * ch).sum(), (x, r, w))
    want = torch.autograd.grad((ref_y * cy).sum() + (ref_h * ch).sum(), (x, r, w))
    for name, a, b in zip(("dx", "dr", "dw"), got, want, strict=True):
        assert_close(a, b, dtype, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize(("H", "D", "R"), [(3, 16, 16), (2, 24, 8), (1, 12, 12)])
def test_rope_equals_the_torch_pairings(dtype, interleaved, H, D, R):
    """Both pairings, partial rotary (R < D: the rest passes through), one shared key head (MLA's
    rope key), a YaRN-style factor on cos and sin; the backward rotates back."""
    B, T = 2, 9
    x = rand(B, T, H, D, dtype=dtype)
    positions = torch.randint(0, 50, (B, T), generator=torch.Generator().manual_seed(3))
    rot = rope_rotations(positions, base_inv_freq(10000.0, R), 1.2)
    reference = apply_rope_interleaved if interleaved else apply_rope_half
    got, want = rope(x, rot, interleaved), reference(x, rot)
    assert_close(got, want, dtype)
    assert_close(grads(got, (x,))[0], grads(want, (x,))[0], dtype, "dx")


def test_rope_reads_a_strided_head_view():
    """q as the attention layer has it: a (B, T, H, D) view of the projection's output."""
    proj = rand(2, 5, 4 * 16)
    x = proj.view(2, 5, 4, 16)[:, :, 1:3]  # two heads out of four: head stride 16, row stride 64
    rot = rope_rotations(torch.arange(5).expand(2, 5), base_inv_freq(500.0, 16), 1.0)
    torch.testing.assert_close(rope(x, rot, False), apply_rope_half(x, rot), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_equals_silu_times_up(dtype):
    gate, up = rand(3, 1500, dtype=dtype), rand(3, 1500, dtype=dtype, seed=1)  # > one block
    got, want = swiglu(gate, up), F.silu(gate) * up
    assert_close(got, want, dtype)
    for name, a, b in zip(
        ("dgate", "dup"), grads(got, (gate, up)), grads(want, (gate, up)), strict=True
    ):
        assert_close(a, b, dtype, name)


def test_the_kernels_without_cuda_or_the_interpreter_say_so(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="model.kernels.swiglu=triton runs on CUDA"):
        swiglu(torch.zeros(4), torch.zeros(4))


KERNELS_ON = {"kernels.rms_norm": "triton", "kernels.rope": "triton", "kernels.swiglu": "triton"}
SMALL = {"d_model": 64, "n_layers": 2, "vocab_size": 96, "max_seq_len": 64, "loss_chunk_tokens": 64}
MODELS = {  # name -> (preset, overrides)
    "pre-norm gqa, half rope": ("tiny", {}),
    "post-norm (fused add), partial rotary": ("tiny", {"residual": "post", "rope.fraction": 0.5}),
    "mla, interleaved rope": ("tiny_mla", {}),
}


@pytest.mark.parametrize("name", MODELS)
def test_a_model_on_the_fused_kernels_trains_like_torch(name):
    """model.kernels=triton for every op: the same loss and gradients as the torch ops (fp32)."""
    from model.presets import load_preset
    from model.transformer import build_model

    preset, overrides = MODELS[name]
    ref = build_model(load_preset(preset, SMALL | overrides), seed=0)
    fused = build_model(load_preset(preset, SMALL | overrides | KERNELS_ON), seed=0)
    tokens = torch.randint(0, 96, (2, 25), generator=torch.Generator().manual_seed(0))
    losses, all_grads = [], []
    for model in (fused, ref):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        losses.append(loss.detach())
        all_grads.append(torch.autograd.grad(loss, list(model.parameters())))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    for (param, _), got, want in zip(fused.named_parameters(), *all_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=param)
    kinds = {type(m).__name__: m.kernel for m in fused.modules() if hasattr(m, "kernel")}
    assert set(kinds.values()) == {"triton"}, kinds


def test_the_fused_add_under_autocast_adds_an_fp32_stream_and_a_bf16_output():
    """trainer.precision=bf16: a post-norm block's stream is fp32 and its sublayers' outputs
    bf16; the fused add promotes both as the unfused add does."""
    from model.presets import load_preset
    from model.transformer import build_model

    overrides = SMALL | {"residual": "post"}
    ref = build_model(load_preset("tiny", overrides), seed=0)
    fused = build_model(load_preset("tiny", overrides | {"kernels.rms_norm": "triton"}), seed=0)
    tokens = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = [m(tokens[:, :-1], tokens[:, 1:]) for m in (fused, ref)]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-2, atol=1e-2)


def test_unknown_kernel_choices_fail_with_their_key():
    from model.errors import ConfigError
    from model.presets import load_preset

    with pytest.raises(
        ConfigError, match="model.kernels.rope='cuda'; choose one of: torch, triton"
    ):
        load_preset("tiny", {"kernels.rope": "cuda"})
