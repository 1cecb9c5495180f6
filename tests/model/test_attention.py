"""Attention against a slow explicit reference, GQA/MQA/MHA equivalences, document masking and
sliding windows."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import Tensor

from model.mixers.attention import Attention
from model.mixers.masks import AttentionContext, build_mask, positions_in_documents
from model.mixers.mla import MultiHeadLatentAttention
from model.mixers.positions import alibi_slopes, build_positions
from model.mixers.rope import rope_frequencies
from tests.model.helpers import (
    ref_alibi_slopes,
    ref_allowed,
    ref_attention,
    ref_inv_freq,
    ref_positions_in_documents,
    ref_rms_norm,
    ref_rope,
    tiny_config,
    tiny_model,
)

# fp32 SDPA vs the float64 reference on O(1) activations: observed ~1e-6; 1e-5 abs and rel
ATOL = RTOL = 1e-5


def linear(x: Tensor, layer: torch.nn.Linear) -> Tensor:
    out = x @ layer.weight.T
    return out if layer.bias is None else out + layer.bias


def make_context(cfg, T: int, doc_ids: Tensor | None, B: int) -> AttentionContext:
    """The same context the Transformer builds, from the public pieces."""
    pos_module = build_positions(cfg)
    if doc_ids is not None:
        positions = positions_in_documents(doc_ids)
    else:
        positions = torch.arange(T).expand(B, T)
    mask, is_causal = build_mask(
        T,
        0,
        window=cfg.attention.sliding_window,
        doc_ids=doc_ids,
        alibi_slopes=pos_module.alibi_slopes(),
    )
    rope = {cfg.rotary_dim: pos_module.rotary(positions, T, cfg.rotary_dim)}
    return AttentionContext(positions=positions, rope=rope, mask=mask, is_causal=is_causal, start=0)


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Random weights everywhere, including norm weights and biases (which init to 1 / 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim > 1 else 0.5))


def ref_rope_params(cfg, rotary_dim: int, T: int) -> tuple[Tensor, float, float]:
    """(inv_freq, cos/sin factor, softmax multiplier) for the configured RoPE.

    The scaled frequency ladders are checked against their formulas and transformers in
    test_rope.py, so they are taken from model.mixers.rope here; the YaRN temperatures are written out.
    """
    r = cfg.rope
    if r.scaling == "none":
        return ref_inv_freq(r.theta, rotary_dim), 1.0, 1.0
    inv_freq = rope_frequencies(r, rotary_dim, cfg.rope_original_max_seq_len, T)[0].double()
    if r.scaling != "yarn":
        return inv_freq, 1.0, 1.0

    def mscale(m: float) -> float:  # sqrt(1/t) = 0.1 m ln(s) + 1
        return 0.1 * m * math.log(r.factor) + 1

    if r.mscale and r.mscale_all_dim:  # DeepSeek: cos/sin by ratio, softmax by mscale_all^2
        return inv_freq, mscale(r.mscale) / mscale(r.mscale_all_dim), mscale(r.mscale_all_dim) ** 2
    return inv_freq, mscale(1.0), 1.0


def ref_gqa(att: Attention, cfg, x: Tensor, doc_ids: Tensor | None) -> Tensor:
    """Slow reference of one attention layer, from its weights."""
    B, T, _ = x.shape
    H, K, D = cfg.attention.n_heads, cfg.n_kv_heads, cfg.head_dim
    q = linear(x, att.q_proj).view(B, T, H, D)
    k = linear(x, att.k_proj).view(B, T, K, D)
    v = linear(x, att.v_proj).view(B, T, K, D)
    if cfg.attention.qk_norm:
        q = ref_rms_norm(q, att.q_norm.weight, cfg.norm_eps)
        k = ref_rms_norm(k, att.k_norm.weight, cfg.norm_eps)
    positions = (
        torch.arange(T).expand(B, T) if doc_ids is None else ref_positions_in_documents(doc_ids)
    )
    bias, multiplier = None, 1.0
    if cfg.position == "rope":
        inv_freq, factor, multiplier = ref_rope_params(cfg, cfg.rotary_dim, T)
        q = ref_rope(q, positions, inv_freq, cfg.rope.pairing, factor)
        k = ref_rope(k, positions, inv_freq, cfg.rope.pairing, factor)
    elif cfg.position == "alibi":
        slopes = torch.tensor(ref_alibi_slopes(H), dtype=torch.float64)
        i = torch.arange(T)[:, None]
        j = torch.arange(T)[None, :]
        bias = -slopes[:, None, None] * (i - j).double()  # (H, T, T)
    scale = (cfg.attention.softmax_scale or D**-0.5) * multiplier
    allowed = ref_allowed(T, window=cfg.attention.sliding_window, doc_ids=doc_ids)
    y = ref_attention(q, k, v, scale, allowed, bias).reshape(B, T, H * D)
    if cfg.attention.output_gate:
        y = y * torch.sigmoid(linear(x, att.gate_proj))
    return linear(y, att.o_proj)


DOCS = torch.tensor([[0] * 4 + [1] * 5 + [2] * 3, [0] * 7 + [1] * 5])  # (2, 12), two packings

CASES = {
    "mha": dict(),
    "gqa": dict(attention={"n_kv_heads": 2}),
    "mqa": dict(attention={"n_kv_heads": 1}),
    "window": dict(attention={"n_kv_heads": 2, "sliding_window": 3}),
    "qk_norm": dict(attention={"n_kv_heads": 2, "qk_norm": True}),
    "output_gate": dict(attention={"output_gate": True}),
    "bias_and_scale": dict(attention={"bias": True, "softmax_scale": 0.2}),
    "alibi": dict(position="alibi", attention={"n_kv_heads": 2}),
    "alibi_6_heads": dict(
        position="alibi", attention={"n_heads": 6, "n_kv_heads": 3, "head_dim": 8}
    ),
    "interleaved_partial": dict(
        attention={"head_dim": 12}, rope={"pairing": "interleaved", "fraction": 0.5}
    ),
    "yarn": dict(attention={"n_kv_heads": 2}, rope={"scaling": "yarn", "factor": 8.0}),
    "yarn_deepseek": dict(
        rope={"scaling": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.8}
    ),
    "llama3": dict(rope={"scaling": "llama3", "factor": 8.0, "original_max_seq_len": 8}),
    "nope": dict(position="none", attention={"n_kv_heads": 2}),
    "docs": dict(attention={"n_kv_heads": 2}, docs=True),
    "docs_window_alibi": dict(
        position="alibi", attention={"sliding_window": 4, "qk_norm": True}, docs=True
    ),
    "docs_all": dict(
        attention={"n_kv_heads": 1, "sliding_window": 4, "qk_norm": True, "output_gate": True},
        docs=True,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_attention_matches_reference(case):
    kw = dict(CASES[case])
    docs = kw.pop("docs", False)
    cfg = tiny_config(**kw)
    torch.manual_seed(0)
    att = Attention.build(cfg)
    randomize(att, seed=1)
    B, T = 2, 12
    x = torch.randn(B, T, cfg.d_model, generator=torch.Generator().manual_seed(2))
    doc_ids = DOCS if docs else None
    with torch.no_grad():
        got = att(x, make_context(cfg, T, doc_ids, B))
        want = ref_gqa(att, cfg, x, doc_ids)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_positions_in_documents_matches_loop():
    docs = torch.tensor([[3, 3, 3, 1, 1, 7, 7, 7, 7, 2], [0, 1, 1, 0, 0, 0, 5, 5, 5, 5]])
    assert torch.equal(positions_in_documents(docs), ref_positions_in_documents(docs))
    assert positions_in_documents(docs)[0].tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 0]


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("start", [0, 5])
def test_build_mask_matches_loop(window, start):
    T = 4 if start else 9
    slopes = alibi_slopes(4)
    mask, is_causal = build_mask(T, start, window=window, alibi_slopes=slopes)
    allowed = ref_allowed(T, start, window)[0]
    assert not is_causal
    assert torch.equal(torch.isfinite(mask[0]), allowed.expand(4, T, start + T))
    i = torch.arange(start, start + T)[:, None]
    j = torch.arange(start + T)[None, :]
    want = -slopes[:, None, None] * (i - j)
    assert torch.equal(mask[0][:, allowed], want[:, allowed])
    mask, _ = build_mask(T, start, window=window or 2)
    assert torch.equal(mask[0, 0], ref_allowed(T, start, window or 2)[0])


def ref_mla(att: MultiHeadLatentAttention, cfg, x: Tensor) -> Tensor:
    """DeepSeek-V2 MLA written out with per-head keys and a shared rope key."""
    m, H = cfg.attention.mla, cfg.attention.n_heads
    B, T, _ = x.shape
    if m.q_lora_rank:
        cq = ref_rms_norm(linear(x, att.q_a_proj), att.q_a_norm.weight, cfg.norm_eps)
        q = linear(cq, att.q_b_proj)
    else:
        q = linear(x, att.q_proj)
    q = q.view(B, T, H, m.qk_nope_head_dim + m.qk_rope_head_dim)
    q_nope, q_rope = q[..., : m.qk_nope_head_dim], q[..., m.qk_nope_head_dim :]
    kv_a = linear(x, att.kv_a_proj)
    c = ref_rms_norm(kv_a[..., : m.kv_lora_rank], att.kv_a_norm.weight, cfg.norm_eps)
    k_rope = kv_a[..., m.kv_lora_rank :][:, :, None, :]  # (B, T, 1, Dr)
    kv = linear(c, att.kv_b_proj).view(B, T, H, m.qk_nope_head_dim + m.v_head_dim)
    k_nope, v = kv[..., : m.qk_nope_head_dim], kv[..., m.qk_nope_head_dim :]
    positions = torch.arange(T).expand(B, T)
    inv_freq, factor, multiplier = ref_rope_params(cfg, m.qk_rope_head_dim, T)
    q_rope = ref_rope(q_rope, positions, inv_freq, cfg.rope.pairing, factor)
    k_rope = ref_rope(k_rope, positions, inv_freq, cfg.rope.pairing, factor).expand(B, T, H, -1)
    q = torch.cat([q_nope, q_rope], -1)
    k = torch.cat([k_nope, k_rope], -1)
    scale = (m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5 * multiplier
    allowed = ref_allowed(T, window=cfg.attention.sliding_window)
    y = ref_attention(q, k, v, scale, allowed).reshape(B, T, H * m.v_head_dim)
    return linear(y, att.o_proj)


MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)


YARN_DS = {"scaling": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.8}


@pytest.mark.parametrize("q_lora_rank", [0, 12])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize(
    "rope",
    [{"pairing": "half"}, {"pairing": "interleaved"}, YARN_DS],
    ids=["half", "inter", "yarn"],
)
def test_mla_matches_reference(q_lora_rank, window, rope):
    cfg = tiny_config(
        attention={"kind": "mla", "sliding_window": window},
        mla=MLA | {"q_lora_rank": q_lora_rank},
        rope=rope,
    )
    torch.manual_seed(0)
    att = MultiHeadLatentAttention.build(cfg)
    randomize(att, seed=1)
    B, T = 2, 10
    x = torch.randn(B, T, cfg.d_model, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = att(x, make_context(cfg, T, None, B))
        want = ref_mla(att, cfg, x)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


# ---- MHA / GQA / MQA equivalences --------------------------------------------------------------

TOKENS = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(5))


def test_gqa_with_all_kv_heads_is_mha():
    mha = tiny_model(tiny_config())
    gqa = tiny_model(tiny_config(attention={"n_kv_heads": 4}))
    assert {k: v.shape for k, v in mha.state_dict().items()} == {
        k: v.shape for k, v in gqa.state_dict().items()
    }
    with torch.no_grad():
        torch.testing.assert_close(gqa(TOKENS), mha(TOKENS), atol=0, rtol=0)


def repeat_kv_heads(state: dict, K: int, H: int, D: int, tile: bool = False) -> dict:
    """k/v projection rows (K*D, ...) -> (H*D, ...), kv head k serving query heads k*G..k*G+G-1."""
    out = {}
    for name, w in state.items():
        if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            heads = w.reshape(K, D, *w.shape[1:])
            if tile:  # kv heads 0..K-1, 0..K-1, ... (the wrong grouping)
                heads = heads.repeat(H // K, *[1] * (heads.ndim - 1))
            else:  # kv heads 0,0,..,1,1,..: query head h uses kv head h // (H / K)
                heads = heads.repeat_interleave(H // K, dim=0)
            w = heads.reshape(H * D, *w.shape[1:])
        out[name] = w
    return out


@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_gqa_equals_mha_with_repeated_kv_weights(K, bias):
    """GQA(K) (MQA for K=1) == MHA whose k/v rows are the GQA rows repeated per group."""
    cfg = tiny_config(attention={"n_kv_heads": K, "bias": bias, "qk_norm": True})
    gqa = tiny_model(cfg)
    with torch.no_grad():
        for name, p in gqa.named_parameters():
            if p.ndim == 1:  # biases and norm weights: random, so the test sees them
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    mha = tiny_model(tiny_config(attention={"bias": bias, "qk_norm": True}), seed=7)
    H, D = cfg.attention.n_heads, cfg.head_dim
    mha.load_state_dict(repeat_kv_heads(gqa.state_dict(), K, H, D))
    with torch.no_grad():
        want = gqa(TOKENS)
        torch.testing.assert_close(mha(TOKENS), want, atol=ATOL, rtol=RTOL)
        if 1 < K < H:  # the grouping is contiguous: tiling the kv heads instead is different
            mha.load_state_dict(repeat_kv_heads(gqa.state_dict(), K, H, D, tile=True))
            assert (mha(TOKENS) - want).abs().max() > 1e-3


# ---- document masking --------------------------------------------------------------------------


@pytest.mark.parametrize("position", ["rope", "learned", "alibi", "sinusoidal"])
@pytest.mark.parametrize("window", [0, 4])
def test_documents_are_isolated(position, window):
    cfg = tiny_config(position=position, attention={"n_kv_heads": 2, "sliding_window": window})
    model = tiny_model(cfg)
    g = torch.Generator().manual_seed(3)
    doc1, doc2, doc3 = (torch.randint(0, 61, (1, n), generator=g) for n in (5, 6, 4))
    doc_ids = torch.tensor([[0] * 5 + [1] * 6 + [2] * 4])
    packed = torch.cat([doc1, doc2, doc3], dim=1)
    other = torch.cat([torch.randint(0, 61, (1, 5), generator=g), doc2, doc3], dim=1)
    d2 = slice(5, 11)
    with torch.no_grad():
        logits = model(packed, doc_ids=doc_ids)
        changed = model(other, doc_ids=doc_ids)
        alone = model(doc2)
        unmasked = model(other)
        unmasked_ref = model(packed)
    # changing document 1 leaves documents 2 and 3 untouched (exactly: masked keys get weight 0)
    torch.testing.assert_close(changed[:, 5:], logits[:, 5:], atol=1e-6, rtol=0)
    assert (changed[:, :5] - logits[:, :5]).abs().max() > 1e-3
    # document 2 in the pack == document 2 alone (positions restart at 0)
    torch.testing.assert_close(logits[:, d2], alone, atol=ATOL, rtol=RTOL)
    # without doc_ids, document 1 leaks into document 2: the isolation above is not vacuous
    assert (unmasked[:, d2] - unmasked_ref[:, d2]).abs().max() > 1e-3


def test_a_reused_document_id_starts_a_new_document():
    """Loaders may reuse ids (e.g. per-row 0/1 alternation): the third run [0, 0] must not see the
    first run [0, 0], exactly as its positions restart at 0."""
    model = tiny_model(tiny_config(attention={"n_kv_heads": 2}))
    tokens = torch.randint(0, 61, (1, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        packed = model(tokens, doc_ids=torch.tensor([[0, 0, 1, 1, 0, 0]]))
        alone = model(tokens[:, 4:])
    torch.testing.assert_close(packed[:, 4:], alone, atol=ATOL, rtol=RTOL)


def test_documents_in_a_batch_with_different_boundaries():
    cfg = tiny_config(attention={"n_kv_heads": 2})
    model = tiny_model(cfg)
    tokens = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        packed = model(tokens, doc_ids=DOCS)
        for b, bounds in enumerate([(0, 4, 9, 12), (0, 7, 12)]):
            for lo, hi in itertools.pairwise(bounds):
                alone = model(tokens[b : b + 1, lo:hi])
                torch.testing.assert_close(packed[b : b + 1, lo:hi], alone, atol=ATOL, rtol=RTOL)


# ---- sliding window ----------------------------------------------------------------------------


@pytest.mark.parametrize("n_layers", [1, 2])
@pytest.mark.parametrize("position", ["rope", "alibi"])
def test_sliding_window_receptive_field(n_layers, position):
    """With window W, one layer sees W tokens (self included); L layers reach back L (W - 1)."""
    W, T, t = 4, 14, 13
    cfg = tiny_config(n_layers=n_layers, position=position, attention={"sliding_window": W})
    model = tiny_model(cfg)
    tokens = torch.randint(0, 61, (1, T), generator=torch.Generator().manual_seed(6))
    reach = n_layers * (W - 1)

    def with_changed(i: int) -> Tensor:
        changed = tokens.clone()
        changed[0, i] = (changed[0, i] + 1) % 61
        return changed

    with torch.no_grad():
        base = model(tokens)[0, t]
        for i in range(t - reach):  # every token beyond the reach: no effect at all
            torch.testing.assert_close(model(with_changed(i))[0, t], base, atol=1e-6, rtol=0)
        # the furthest token inside the reach does change the output
        assert (model(with_changed(t - reach))[0, t] - base).abs().max() > 1e-4
        # and without the window, a token beyond the reach would too
        full = tiny_model(tiny_config(n_layers=n_layers, position=position))
        delta = full(with_changed(t - reach - 1))[0, t] - full(tokens)[0, t]
        assert delta.abs().max() > 1e-4
