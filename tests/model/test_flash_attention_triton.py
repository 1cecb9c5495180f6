"""The Triton FlashAttention kernel (model/kernels/flash_attention.py) against SDPA and the
chunked max-logit recomputation (model/qk_logits.py), forward and backward, fp32, under Triton's
interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA): causal and full
attention, MHA and GQA, lengths that are not a multiple of the block. Skipped where triton is not
installed (`pip install -e ".[triton]"`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model.qk_logits import max_logits_per_head

triton = pytest.importorskip("triton")
from model.kernels.flash_attention import flash_attention  # noqa: E402

CASES = [  # (B, Hq, Hkv, T, D, causal)
    (2, 4, 2, 50, 32, True),  # GQA, T not a multiple of 16
    (1, 2, 2, 33, 64, True),  # MHA
    (2, 4, 1, 24, 16, False),  # MQA, full attention
]


def inputs(B, Hq, Hkv, T, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, T, D, generator=g, requires_grad=True) for h in (Hq, Hkv, Hkv)]


@pytest.mark.parametrize(("B", "Hq", "Hkv", "T", "D", "causal"), CASES)
def test_forward_backward_and_max_logits_equal_the_references(B, Hq, Hkv, T, D, causal):
    q, k, v = inputs(B, Hq, Hkv, T, D)
    out, max_logits = flash_attention(q, k, v, causal=causal, return_max_logits=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-6)
    expected = max_logits_per_head(q, k, D**-0.5, None, causal, 0)
    torch.testing.assert_close(max_logits, expected, rtol=1e-6, atol=2e-6)
    cotangent = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (q, k, v), cotangent)
    ref_grads = torch.autograd.grad(ref, (q, k, v), cotangent)
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-6, msg=f"d{name}")


def test_the_max_is_not_the_log_sum_exp():
    """What the kernel returns is the max logit, which the LSE overestimates by up to log(keys)."""
    q, k, v = inputs(1, 2, 2, 40, 32, seed=1)
    _, max_logits = flash_attention(q, k, v, return_max_logits=True)
    logits = (q @ k.transpose(-1, -2)) / 32**0.5
    logits = logits.masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1), float("-inf"))
    lse = logits.logsumexp(-1).amax(dim=(0, 2))
    assert (lse > max_logits + 0.1).all()


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        (((1, 3, 8, 32), (1, 2, 8, 32)), "not a multiple"),
        (((1, 2, 8, 24), (1, 2, 8, 24)), "power of two"),
        (((1, 2, 8, 32), (1, 2, 9, 32)), "takes q"),
    ],
)
def test_bad_shapes_are_refused_with_the_reason(shapes, message):
    q, k = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        flash_attention(q, k, k)
