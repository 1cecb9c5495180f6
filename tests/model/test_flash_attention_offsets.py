"""The Triton FlashAttention kernel with fewer queries than keys (model/kernels/flash_attention.py):
causal attention of Tq queries at the last Tq positions of Tk keys (bottom-right alignment), a
context-parallel chunk, under Triton's interpreter on CPU against SDPA's math backend in fp32
over the equivalent dense bool mask (outputs, dQ/dK/dV, max logits against a masked max): plain
GQA, packed documents (one crossing the chunk's start, one starting inside it) with a sliding
window, MLA's 192 / 128 head dims, a chunk and an offset that are not multiples of the block;
a chunk equal bit for bit to the same rows of the full call; and key blocks that no row sees are
never visited (NaN keys there reach neither the outputs nor the gradients). Both backward
variants (two kernels; one pass with atomic dQ), and unequal row and key blocks as the GPU's
candidates have them."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

from model.mixers.masks import document_starts

triton = pytest.importorskip("triton")
from model.kernels import flash_attention as fa  # noqa: E402
from model.kernels.flash_attention import flash_attention, key_bounds, last_rows  # noqa: E402

CPU = torch.device("cpu")

# (B, Hq, Hkv, Tq, Tk, Dqk, Dv, window, document boundaries per batch row or None)
CASES = {
    "gqa causal": (2, 4, 2, 32, 64, 32, 32, 0, None),
    # chunk [32, 56): documents from 20 (crossing the start) and 45 (inside); the window binds
    # in between (row 44 sees 25.., not 20..)
    "documents + window": (2, 2, 1, 24, 56, 16, 16, 20, [(20, 45), (10, 40)]),
    "mla dims 192/128": (1, 2, 2, 16, 48, 192, 128, 0, [(40,)]),
    "chunk and offset off the block": (2, 2, 1, 21, 50, 24, 40, 9, [(25, 33), (35,)]),
}
# forward and dQ: BLOCK_M twice BLOCK_N; dK/dV the reverse (the interpreter's default: 16 x 16)
UNEQUAL_BLOCKS = {
    "_fwd": (32, 16), "_bwd_kv": (16, 32), "_bwd_kv_atomic": (16, 32), "_bwd_q": (32, 16),
    "_bwd_delta": (32, 0),
}  # fmt: skip


def inputs(B, Hq, Hkv, Tq, Tk, Dqk, Dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Tq, Dqk, generator=g)
    k = torch.randn(B, Hkv, Tk, Dqk, generator=g)
    v = torch.randn(B, Hkv, Tk, Dv, generator=g)
    return [x.requires_grad_() for x in (q, k, v)]


def doc_ids(boundaries, Tk):
    """(B, Tk) document ids: a new document at each boundary."""
    index = torch.arange(Tk)
    return torch.stack([(index[:, None] >= torch.tensor(b)).sum(-1) for b in boundaries])


def chunk_mask(docs, window, Tq, Tk):
    """(B|1, 1, Tq, Tk) bool, from positions alone: row i at position Tk - Tq + i sees the keys
    of its document at most `window - 1` before it (window 0: no limit), none after it."""
    pos = torch.arange(Tk - Tq, Tk)[:, None]
    keys = torch.arange(Tk)[None, :]
    ok = (keys <= pos) & ((pos - keys < window) if window else True)
    ok = ok[None]
    if docs is not None:
        ok = ok & (docs[:, Tk - Tq :, None] == docs[:, None, :])
    return ok[:, None]


def first_keys(docs, window, Tq, Tk):
    starts = document_starts(docs) if docs is not None else None
    return key_bounds(starts, window, Tk, CPU, rows=slice(Tk - Tq, Tk))


@pytest.mark.parametrize("blocks", ["default", "unequal"])
@pytest.mark.parametrize("backward", fa.BACKWARDS)
@pytest.mark.parametrize("case", CASES)
def test_a_chunk_equals_sdpa_with_the_dense_mask(case, backward, blocks, monkeypatch):
    monkeypatch.setenv(fa.BACKWARD_ENV, backward)
    if blocks == "unequal":
        monkeypatch.setattr(fa, "INTERPRETER_BLOCKS", UNEQUAL_BLOCKS)
    B, Hq, Hkv, Tq, Tk, Dqk, Dv, window, boundaries = CASES[case]
    q, k, v = inputs(B, Hq, Hkv, Tq, Tk, Dqk, Dv)
    docs = doc_ids(boundaries, Tk) if boundaries else None
    mask = chunk_mask(docs, window, Tq, Tk)
    first_key = first_keys(docs, window, Tq, Tk)
    if first_key is not None:  # the bounds are the dense mask's first and last visible keys
        rows = mask[:, 0].expand(B, Tq, Tk)
        assert torch.equal(first_key, rows.int().argmax(-1).int())
        seen = rows.any(1)
        last = torch.where(rows, torch.arange(Tq)[:, None], -1).amax(1)
        assert torch.equal(last_rows(first_key, Tk)[seen], last[seen].int())
    out, max_logits = flash_attention(q, k, v, first_key=first_key, return_max_logits=True)
    assert out.shape == (B, Hq, Tq, Dv)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        ref = scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    G = Hq // Hkv
    logits = (q @ k.repeat_interleave(G, 1).transpose(-1, -2)) * Dqk**-0.5
    expected = logits.masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3))
    torch.testing.assert_close(max_logits, expected.detach(), rtol=1e-5, atol=1e-5)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad(out, (q, k, v), cotangent)
    ref_grads = torch.autograd.grad(ref, leaves, cotangent)
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"d{name}")


def test_a_chunk_is_the_same_rows_of_the_full_sequence_bit_for_bit():
    """Queries [32, 48) over keys [0, 48) with documents and a window: the offset is a whole
    number of blocks, so every block sees the same keys in the same order as rows 32.. of the
    Tq == Tk call (whose other rows get a zero cotangent, adding exact zeros to dK, dV)."""
    B, Hq, Hkv, T, D, start, window = 1, 2, 1, 48, 16, 32, 12
    q, k, v = inputs(B, Hq, Hkv, T, T, D, D, seed=1)
    starts = document_starts(doc_ids([(10, 37)], T))
    full = flash_attention(q, k, v, first_key=key_bounds(starts, window, T, CPU))
    chunk_q = q.detach()[:, :, start:].requires_grad_()
    fk = key_bounds(starts, window, T, CPU, rows=slice(start, T))
    chunk = flash_attention(chunk_q, k, v, first_key=fk)
    assert torch.equal(chunk, full[:, :, start:])
    cotangent = torch.randn(chunk.shape, generator=torch.Generator().manual_seed(2))
    dq, dk, dv = torch.autograd.grad(chunk, (chunk_q, k, v), cotangent)
    padded = torch.cat([torch.zeros_like(full[:, :, :start]), cotangent], dim=2)
    full_dq, full_dk, full_dv = torch.autograd.grad(full, (q, k, v), padded)
    assert torch.equal(dq, full_dq[:, :, start:])
    assert torch.equal(dk, full_dk) and torch.equal(dv, full_dv)


@pytest.mark.parametrize("backward", fa.BACKWARDS)
def test_key_blocks_no_row_sees_are_never_visited(backward, monkeypatch):
    """Rows at 48..63 with a window of 8 see keys 41..63: key blocks [0, 16) and [16, 32) hold
    none. NaN there would reach every output and gradient of a kernel that visits them (masking
    turns the scores into -inf, but 0 * NaN is NaN in P V and in dP); the kernel gives the
    outputs of finite keys, and zero dK, dV for those keys."""
    monkeypatch.setenv(fa.BACKWARD_ENV, backward)
    Tq, Tk, window = 16, 64, 8
    q, k, v = inputs(1, 2, 2, Tq, Tk, 16, 16, seed=2)
    fk = key_bounds(None, window, Tk, CPU, rows=slice(Tk - Tq, Tk))
    hidden = torch.arange(Tk) < 32
    poisoned = [x.detach().masked_fill(hidden[:, None], float("nan")) for x in (k, v)]
    poisoned = [x.requires_grad_() for x in poisoned]
    cotangent = torch.randn(1, 2, Tq, 16, generator=torch.Generator().manual_seed(4))
    results = []
    for keys, values in ((k, v), poisoned):
        out, max_logits = flash_attention(q, keys, values, first_key=fk, return_max_logits=True)
        results.append((out, max_logits, *torch.autograd.grad(out, (q, keys, values), cotangent)))
    (out, max_logits, dq, dk, dv), (p_out, p_max, p_dq, p_dk, p_dv) = results
    assert torch.equal(p_out, out) and torch.equal(p_max, max_logits) and torch.equal(p_dq, dq)
    assert not p_dk[:, :, :32].any() and not p_dv[:, :, :32].any()
    assert torch.equal(p_dk, dk) and torch.equal(p_dv, dv)


@pytest.mark.parametrize(
    ("q_rows", "k_rows", "kwargs", "message"),
    [
        (9, 8, {}, "Tk >= Tq"),
        (8, 12, {"causal": False}, "needs causal=True"),
        (8, 12, {"first_key": torch.zeros(1, 12, dtype=torch.int32)}, r"\(B, Tq\)"),
    ],
)
def test_chunks_the_kernel_cannot_take_are_refused(q_rows, k_rows, kwargs, message):
    q, k = torch.zeros(1, 2, q_rows, 16), torch.zeros(1, 2, k_rows, 16)
    with pytest.raises(ValueError, match=message):
        flash_attention(q, k, k, **kwargs)


def test_key_bounds_of_a_chunk_are_those_rows_of_the_whole_sequence():
    starts = document_starts(doc_ids([(3, 11)], 16))
    whole = key_bounds(starts, 5, 16, CPU)
    assert torch.equal(key_bounds(starts, 5, 16, CPU, rows=slice(6, 12)), whole[:, 6:12])
    assert key_bounds(None, 0, 16, CPU, rows=slice(6, 12)) is None
    with pytest.raises(ValueError, match="step 1"):
        key_bounds(starts, 5, 16, CPU, rows=slice(0, 16, 2))
