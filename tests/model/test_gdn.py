"""Gated DeltaNet: the chunked and recurrent forms agree (fp64), documents restart the state and
the conv, gradients match, the layer equals transformers' Qwen3NextGatedDeltaNet with copied
weights, and a hybrid stack prefills and decodes like a full forward."""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch

from model import GDNConfig, ModelConfig, build_model
from model.accounting import kv_cache_size, training_flops_per_token
from model.config import AttentionConfig, FFNConfig
from model.mixers.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from model.mixers.gdn import GatedDeltaNet, l2_normalize
from model.mixers.masks import AttentionContext, document_starts, positions_in_documents
from model.roles import param_roles

F64 = dict(rtol=1e-10, atol=1e-12)
F32_ROPE = dict(rtol=1e-6, atol=1e-7)


def inputs(B=2, H=3, T=37, Dk=8, Dv=6, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(B, H, T, Dk, generator=gen, dtype=dtype)) * Dk**-0.5
    k = l2_normalize(torch.randn(B, H, T, Dk, generator=gen, dtype=dtype))
    v = torch.randn(B, H, T, Dv, generator=gen, dtype=dtype)
    g = -torch.rand(B, H, T, generator=gen, dtype=dtype) * 0.7
    beta = torch.rand(B, H, T, generator=gen, dtype=dtype)
    return q, k, v, g, beta


DOCS = torch.tensor(
    [[0] * 5 + [1] * 11 + [2] * 21, [0] * 9 + [1] * 15 + [2] * 13]
)  # (2, 37): starts at 0, 5, 16 and 0, 9, 24


@pytest.mark.parametrize("chunk", [1, 4, 8, 64])
@pytest.mark.parametrize("docs", [False, True])
def test_chunked_equals_recurrent_whatever_the_chunk(chunk, docs):
    q, k, v, g, beta = inputs()
    starts = document_starts(DOCS) if docs else None
    o_rec, s_rec = recurrent_gated_delta_rule(q, k, v, g, beta, doc_starts=starts)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, doc_starts=starts, chunk=chunk)
    torch.testing.assert_close(o, o_rec, **F64)
    torch.testing.assert_close(s, s_rec, **F64)


def test_documents_equal_separate_runs():
    q, k, v, g, beta = inputs()
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, doc_starts=document_starts(DOCS), chunk=8)
    for row, bounds in enumerate([(0, 5, 16, 37), (0, 9, 24, 37)]):
        for a, b in itertools.pairwise(bounds):
            part = [x[row : row + 1, :, a:b] for x in (q, k, v, g, beta)]
            alone, _ = recurrent_gated_delta_rule(*part)
            torch.testing.assert_close(o[row : row + 1, :, a:b], alone, **F64)


def test_the_state_carries_across_a_split_sequence():
    q, k, v, g, beta = inputs()
    whole, s_whole = chunk_gated_delta_rule(q, k, v, g, beta, chunk=8)
    first, s = chunk_gated_delta_rule(*(x[:, :, :20] for x in (q, k, v, g, beta)), chunk=8)
    second, s = chunk_gated_delta_rule(
        *(x[:, :, 20:] for x in (q, k, v, g, beta)), state=s, chunk=8
    )
    torch.testing.assert_close(torch.cat([first, second], dim=2), whole, **F64)
    torch.testing.assert_close(s, s_whole, **F64)


def test_gradients_of_the_chunked_form_match_autograd_through_the_recurrence():
    leaves = [x.requires_grad_() for x in inputs(B=1, H=2, T=11, Dk=4, Dv=3)]
    starts = document_starts(torch.tensor([[0] * 6 + [1] * 5]))
    grads = {}
    for name, fn in (("chunk", chunk_gated_delta_rule), ("recurrent", recurrent_gated_delta_rule)):
        kwargs = {"chunk": 4} if name == "chunk" else {}
        o, s = fn(*leaves, doc_starts=starts, **kwargs)
        grads[name] = torch.autograd.grad((o.square().sum() + s.sum()), leaves)
    for a, b in zip(grads["chunk"], grads["recurrent"]):
        torch.testing.assert_close(a, b, **F64)
    assert torch.autograd.gradcheck(
        lambda *xs: chunk_gated_delta_rule(*xs, doc_starts=starts, chunk=4)[0],
        tuple(x.detach().requires_grad_() for x in leaves),
    )


def small_cfg(**kw) -> ModelConfig:
    base = dict(
        vocab_size=64,
        d_model=32,
        n_layers=4,
        max_seq_len=64,
        attention=AttentionConfig(n_heads=4, n_kv_heads=2, output_gate=True),
        gdn=GDNConfig(n_heads=2, n_v_heads=4, head_dim=8, v_head_dim=6, chunk_size=8),
        layer_pattern=["gdn", "gdn", "gdn", "gqa"],
        ffn=FFNConfig(hidden=48),
    )
    return ModelConfig(**(base | kw))


def test_a_packed_row_equals_its_documents_through_the_whole_layer():
    torch.manual_seed(0)
    layer = GatedDeltaNet.build(small_cfg()).double()
    layer.init_weights(__import__("model.init", fromlist=["InitStds"]).InitStds(0.2, 0.2, 0.2))
    x = torch.randn(2, 37, 32, dtype=torch.float64)
    ctx = AttentionContext(
        positions=positions_in_documents(DOCS),
        rope=None,
        mask=None,
        is_causal=True,
        start=0,
        doc_starts=document_starts(DOCS),
    )
    with torch.no_grad():
        packed = layer(x, ctx)
        for row, bounds in enumerate([(0, 5, 16, 37), (0, 9, 24, 37)]):
            for a, b in itertools.pairwise(bounds):
                alone_ctx = AttentionContext(
                    positions=torch.arange(b - a)[None],
                    rope=None,
                    mask=None,
                    is_causal=True,
                    start=0,
                )
                alone = layer(x[row : row + 1, a:b], alone_ctx)
                torch.testing.assert_close(packed[row : row + 1, a:b], alone, **F64)


def test_a_hybrid_stack_prefills_and_decodes_like_a_full_forward():
    model = build_model(small_cfg(), seed=0).double().eval()
    tokens = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(2, 20, dtype=torch.float64)
        # RoPE rotates in fp32 by design (complex64 rotations): fp32-level agreement
        torch.testing.assert_close(model(tokens[:, :13], cache=cache), full[:, :13], **F32_ROPE)
        for t in range(13, 20):
            step = model(tokens[:, t : t + 1], cache=cache)
            torch.testing.assert_close(step[:, 0], full[:, t], **F32_ROPE)


def test_a_hybrid_stack_trains_and_routes_its_parameters():
    from optim.builder import build_optimizer
    from optim.config import OptimConfig

    model = build_model(small_cfg(), seed=0)
    roles = param_roles(model)
    assert roles["layers.0.attn.conv.weight"] == "conv"
    assert roles["layers.0.attn.A_log"] == roles["layers.0.attn.dt_bias"] == "decay"
    optimizer = build_optimizer(OptimConfig(name="muon", lr=0.02), model)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {g["name"]: {names[id(p)] for p in g["params"]} for g in optimizer.param_groups}
    no_decay = next(g for g in optimizer.param_groups if g["name"] == "adamw_vectors")
    assert {"layers.0.attn.conv.weight", "layers.0.attn.A_log", "layers.0.attn.dt_bias"} <= groups[
        "adamw_vectors"
    ] and no_decay["weight_decay"] == 0.0
    assert "layers.0.attn.q_proj.weight" in groups["muon"]
    tokens = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(25):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0]


def test_accounting_counts_a_fixed_state_and_the_chunked_flops():
    cfg = small_cfg()
    model = build_model(cfg, device="meta")
    kv = kv_cache_size(model, "bf16")
    gqa = 2 * 2 * 8  # the one attention layer: 2 x K x D per token
    assert kv.bytes_per_token == gqa * 2
    conv_dim = 2 * 2 * 8 + 4 * 6
    assert kv.fixed_bytes == 3 * (conv_dim * 3 * 2 + 4 * 8 * 6 * 4)  # conv (bf16) + state (fp32)
    layer = model.layers["0"].attn
    # the matmuls of the chunked form, counted by torch, plus the two triangular solves (which
    # the counter does not see: C (Dk + Dv) / 2 multiply-adds per token) and the conv's taps
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v, g, beta = inputs(B=1, H=4, T=32, Dk=8, Dv=6, dtype=torch.float32)
    with FlopCounterMode(display=False) as counter:
        chunk_gated_delta_rule(q, k, v, g, beta, chunk=8)
    solves = 2 * 4 * 32 * 8 * (8 + 6) / 2
    conv = 2 * 32 * conv_dim * 4
    assert 32 * layer.mixing_flops_per_token(32) == counter.get_total_flops() + solves + conv
    flops = training_flops_per_token(model, 32)
    assert flops.attention > 3 * 3 * layer.mixing_flops_per_token(32)  # the GDN layers are in it


@pytest.mark.skipif(
    importlib.util.find_spec("fla") is not None,
    reason="transformers dispatches to fla's Triton kernels when fla is importable (no CPU backend)",
)
def test_the_layer_equals_transformers_qwen3_next_gated_deltanet():
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    nk, nv, dk, dv, C = 2, 4, 8, 6, 32
    hf_cfg = transformers.Qwen3NextConfig(
        hidden_size=C,
        linear_num_key_heads=nk,
        linear_num_value_heads=nv,
        linear_key_head_dim=dk,
        linear_value_head_dim=dv,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    torch.manual_seed(0)
    theirs = Qwen3NextGatedDeltaNet(hf_cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    # our chunks of 8 (theirs: 64): the result must not depend on the chunk size
    gdn = GDNConfig(n_heads=nk, n_v_heads=nv, head_dim=dk, v_head_dim=dv, chunk_size=8)
    ours = GatedDeltaNet.build(small_cfg(norm_eps=1e-6, gdn=gdn))
    group = nv // nk
    qkvz = theirs.in_proj_qkvz.weight.view(nk, 2 * dk + 2 * group * dv, C)
    q, k, v, z = qkvz.split([dk, dk, group * dv, group * dv], dim=1)
    b, a = theirs.in_proj_ba.weight.view(nk, 2 * group, C).split([group, group], dim=1)
    with torch.no_grad():
        for mine, w in (
            ("q_proj", q),
            ("k_proj", k),
            ("v_proj", v),
            ("z_proj", z),
            ("b_proj", b),
            ("a_proj", a),
        ):
            getattr(ours, mine).weight.copy_(w.reshape(-1, C))
        ours.conv.weight.copy_(theirs.conv1d.weight)
        ours.A_log.copy_(theirs.A_log)
        ours.dt_bias.copy_(theirs.dt_bias)
        ours.norm.weight.copy_(theirs.norm.weight)
        ours.o_proj.weight.copy_(theirs.out_proj.weight)
    x = torch.randn(2, 21, C, generator=torch.Generator().manual_seed(3))
    ctx = AttentionContext(
        positions=torch.arange(21)[None], rope=None, mask=None, is_causal=True, start=0
    )
    with torch.no_grad():
        torch.testing.assert_close(ours(x, ctx), theirs(x), rtol=1e-5, atol=1e-5)


def test_inspect_compares_the_hybrid_with_its_all_attention_twin(capsys):
    from model.inspect import main

    assert main(["model=tiny_hybrid", "format=json"]) == 0
    row = __import__("json").loads(capsys.readouterr().out)["tiny_hybrid"]
    kv_per_token = 2 * (2 * 2 * 64) * 2  # 2 GQA layers: K x D keys and values, bf16
    gdn_fixed = 6 * ((2 * 128 + 256) * 3 * 2 + 4 * 64 * 64 * 4)  # conv inputs (bf16), state (fp32)
    for tokens, name in ((32768, "32k"), (131072, "128k")):
        assert row[f"state_bytes_{name}"] == kv_per_token * tokens + gdn_fixed
        assert row[f"attention_twin_state_bytes_{name}"] == 8 * (2 * 2 * 64) * 2 * tokens


# ---- Kimi Delta Attention: the same rule with a decay per key channel --------------------------


@pytest.mark.parametrize("chunk", [1, 8, 64])
@pytest.mark.parametrize("docs", [False, True])
def test_per_channel_decay_chunked_equals_recurrent(chunk, docs):
    q, k, v, _, beta = inputs()
    g = -torch.rand(*q.shape, generator=torch.Generator().manual_seed(4), dtype=q.dtype) * 0.7
    starts = document_starts(DOCS) if docs else None
    o_rec, s_rec = recurrent_gated_delta_rule(q, k, v, g, beta, doc_starts=starts)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, doc_starts=starts, chunk=chunk)
    torch.testing.assert_close(o, o_rec, **F64)
    torch.testing.assert_close(s, s_rec, **F64)


def kda_cfg(**kw) -> ModelConfig:
    from model import KDAConfig

    return small_cfg(
        layer_pattern=["kda", "kda", "kda", "gqa"],
        kda=KDAConfig(n_heads=2, head_dim=8, chunk_size=8),
        **kw,
    )


def test_a_kda_stack_prefills_decodes_and_keeps_documents_apart():
    model = build_model(kda_cfg(), seed=0).double().eval()
    assert [b.attn.kind for b in model.layers.values()] == ["kda", "kda", "kda", "gqa"]
    tokens = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(2, 20, dtype=torch.float64)
        torch.testing.assert_close(model(tokens[:, :11], cache=cache), full[:, :11], **F32_ROPE)
        for t in range(11, 20):
            torch.testing.assert_close(
                model(tokens[:, t : t + 1], cache=cache)[:, 0], full[:, t], **F32_ROPE
            )
        docs = torch.tensor([[0] * 7 + [1] * 13] * 2)
        packed = model(tokens, doc_ids=docs)
        torch.testing.assert_close(packed[:, :7], model(tokens[:, :7]), **F32_ROPE)
        torch.testing.assert_close(packed[:, 7:], model(tokens[:, 7:]), **F32_ROPE)
    roles = param_roles(model)
    assert roles["layers.0.attn.dt_bias"] == roles["layers.0.attn.A_log"] == "decay"


@pytest.mark.skipif(
    importlib.util.find_spec("fla") is not None,
    reason="transformers dispatches to fla's Triton kernels when fla is importable (no CPU backend)",
)
def test_the_kda_layer_equals_transformers_kimi_linear_delta_attention():
    transformers = pytest.importorskip("transformers")
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    from model import KDAConfig
    from model.mixers.kda import KimiDeltaAttention

    H, D, C = 2, 8, 32
    hf_cfg = transformers.KimiLinearConfig(
        hidden_size=C,
        linear_attn_config={
            "num_heads": H,
            "head_dim": D,
            "short_conv_kernel_size": 4,
            "kda_layers": [1],
            "full_attn_layers": [],
        },
        rms_norm_eps=1e-6,
        num_hidden_layers=1,
    )
    torch.manual_seed(0)
    theirs = KimiLinearDeltaAttention(hf_cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    ours = KimiDeltaAttention.build(  # our chunks of 8 (theirs: 64)
        small_cfg(norm_eps=1e-6, kda=KDAConfig(n_heads=H, head_dim=D, chunk_size=8))
    )
    gate = theirs.forget_gate
    with torch.no_grad():
        for mine, w in (
            ("q_proj", theirs.q_proj),
            ("k_proj", theirs.k_proj),
            ("v_proj", theirs.v_proj),
            ("b_proj", theirs.b_proj),
            ("g_a_proj", theirs.g_a_proj),
            ("g_b_proj", theirs.g_b_proj),
            ("f_a_proj", gate.f_a_proj),
            ("f_b_proj", gate.f_b_proj),
            ("o_proj", theirs.o_proj),
        ):
            getattr(ours, mine).weight.copy_(w.weight)
        ours.conv.weight.copy_(theirs.conv1d.weight)
        ours.A_log.copy_(gate.A_log.flatten())
        ours.dt_bias.copy_(gate.dt_bias)
        ours.norm.weight.copy_(theirs.o_norm.weight)
    x = torch.randn(2, 21, C, generator=torch.Generator().manual_seed(3))
    ctx = AttentionContext(
        positions=torch.arange(21)[None], rope=None, mask=None, is_causal=True, start=0
    )
    with torch.no_grad():
        torch.testing.assert_close(ours(x, ctx), theirs(x), rtol=1e-5, atol=1e-5)


def test_tiny_kda_uses_mla_without_rope_and_decodes_like_a_full_forward():
    from model.presets import load_preset

    cfg = load_preset(
        "tiny_kda",
        {
            "d_model": 64,
            "kda.head_dim": 16,
            "kda.chunk_size": 8,
            "ffn.hidden": 96,
            "vocab_size": 64,
        },
    )
    model = build_model(cfg, seed=0).double().eval()
    assert model.rotary_dims == [] and "MLA (NoPE)" in model.layers["3"].attn.describe()
    tokens = torch.randint(0, 64, (2, 18), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(2, 18, dtype=torch.float64)
        torch.testing.assert_close(model(tokens[:, :10], cache=cache), full[:, :10], **F64)
        for t in range(10, 18):  # MLA decodes through its absorbed path
            torch.testing.assert_close(
                model(tokens[:, t : t + 1], cache=cache)[:, 0], full[:, t], rtol=1e-9, atol=1e-10
            )


def test_a_layer_continues_a_prefill_in_pieces_shorter_than_its_conv():
    """Prefill 5, then 2 (fewer than the conv's K-1 = 3), then 6 tokens, then decode: the state
    (conv inputs and delta state) carries, equal to one pass over all of them."""
    from model.mixers.kv_cache import RecurrentState  # noqa: F401  (the state under test)

    layer = GatedDeltaNet.build(small_cfg()).double()
    layer.init_weights(__import__("model.init", fromlist=["InitStds"]).InitStds(0.2, 0.2, 0.2))
    x = torch.randn(2, 16, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(6))

    def ctx(start: int, T: int) -> AttentionContext:
        return AttentionContext(
            positions=torch.arange(start, start + T)[None],
            rope=None,
            mask=None,
            is_causal=True,
            start=start,
        )

    with torch.no_grad():
        whole = layer(x, ctx(0, 16))
        state = layer.new_state(2, 16, torch.float64, torch.device("cpu"))
        pieces, start = [], 0
        for T in (5, 2, 6, 1, 1, 1):
            pieces.append(layer(x[:, start : start + T], ctx(start, T), state))
            start += T
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, **F64)


def test_under_bf16_autocast_the_rule_still_runs_in_fp32(monkeypatch):
    """Autocast would turn the rule's matmuls and solves into bf16 (errors of 1e-2 in the state);
    the layers keep it in fp32, so prefill (chunked) and decode (recurrent) agree."""
    import model.mixers.gdn as gdn

    seen = []
    original = gdn.chunk_gated_delta_rule

    def recording(*args, **kwargs):
        o, s = original(*args, **kwargs)
        seen.append((o.dtype, s.dtype))
        return o, s

    monkeypatch.setattr(gdn, "chunk_gated_delta_rule", recording)
    model = build_model(small_cfg(), seed=0)
    tokens = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(7))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens)
    assert seen and set(seen) == {(torch.float32, torch.float32)}


@pytest.mark.parametrize("C", [64, 48, 16, 8])
def test_per_channel_pair_products_by_sub_chunks_equal_the_direct_form(C):
    """The sub-chunked per-channel decay products equal the (C, C, Dk) direct form, also for
    decays strong enough that a direct factorization exp(gamma_r) exp(-gamma_s) would overflow."""
    from model.mixers.delta_rule import _channel_pair_products

    gen = torch.Generator().manual_seed(7)
    a, b = (torch.randn(2, 3, C, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    for scale in (0.3, 40.0):  # per-token log-decays down to -40: gamma spans -2500 in a chunk
        g = -torch.rand(2, 3, C, 8, generator=gen, dtype=torch.float64) * scale
        gamma = g.cumsum(-2)
        diff = gamma[..., :, None, :] - gamma[..., None, :, :]
        lower = torch.ones(C, C, dtype=torch.bool).tril()
        decay = torch.exp(diff.masked_fill(~lower[..., None], -torch.inf))
        direct = torch.einsum("...rd,...sd,...rsd->...rs", a, b, decay)
        got = _channel_pair_products(a, b, gamma)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, direct, **F64)
    gamma = (-torch.rand(1, 1, C, 8, generator=gen) * 40).cumsum(-2).requires_grad_()
    _channel_pair_products(a[:1, :1].float(), b[:1, :1].float(), gamma).sum().backward()
    assert torch.isfinite(gamma.grad).all()  # fp32 gradients stay finite under strong decay
