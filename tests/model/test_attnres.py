"""Attention Residuals: the depth aggregation and its custom backward against autograd through
the obvious form (fp64 gradcheck), the block bookkeeping against a literal transcription of the
reference rule, the zero-query identity with the pre-norm model, generation, parameter roles."""

from __future__ import annotations

import pytest
import torch

from model import (
    AttentionConfig,
    AttnResConfig,
    FFNConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    build_model,
)
from model.residual.attnres import depth_attention, head_sources, reference_depth_attention
from model.roles import param_roles

F64 = dict(rtol=1e-10, atol=1e-12)
MLA_SMALL = MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)


def sources(n=4, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 5, 16, generator=gen, dtype=dtype) * (1 + i) for i in range(n)]


def test_the_aggregation_equals_the_direct_form_and_gradchecks():
    vs = [v.requires_grad_() for v in sources()]
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(16, generator=gen, dtype=torch.float64, requires_grad=True)
    gain = (1 + 0.3 * torch.randn(16, generator=gen, dtype=torch.float64)).requires_grad_()
    got, ref = (
        depth_attention(vs, query, gain, 1e-6),
        reference_depth_attention(vs, query, gain, 1e-6),
    )
    torch.testing.assert_close(got, ref, **F64)
    weight = torch.randn_like(got)
    grads = torch.autograd.grad((got * weight).sum(), [query, gain, *vs])
    expected = torch.autograd.grad((ref * weight).sum(), [query, gain, *vs])
    for a, b in zip(grads, expected, strict=True):
        torch.testing.assert_close(a, b, **F64)
    assert torch.autograd.gradcheck(
        lambda q, g, *v: depth_attention(list(v), q, g, 1e-6), (query, gain, *vs)
    )


def test_the_aggregation_runs_in_fp32_for_bf16_sources_under_autocast():
    vs = sources(dtype=torch.float32)
    query, gain = torch.randn(16), torch.ones(16)
    ref = reference_depth_attention(vs, query, gain, 1e-6)
    low = [v.bfloat16() for v in vs]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = depth_attention(low, query, gain, 1e-6)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(
        got.float(), reference_depth_attention(low, query, gain, 1e-6).float()
    )
    assert (got.float() - ref).abs().max() < 0.1  # bf16 rounding of the inputs only


def cfg(block_layers: int, n_layers: int = 5, **kw) -> ModelConfig:
    base = dict(
        vocab_size=64,
        d_model=32,
        n_layers=n_layers,
        residual="attnres",
        attnres=AttnResConfig(block_layers=block_layers),
        attention=AttentionConfig(n_heads=4, n_kv_heads=2),
        ffn=FFNConfig(hidden=48),
    )
    return ModelConfig(**(base | kw))


def literal(model, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """The reference bookkeeping with explicit lists (Megatron-LM's rule, 1-based layer l):
    layer l starts a block iff (l - 1) % k == 0, appending the running sum (the embedding for
    l = 1); Full AttnRes makes every sublayer output its own source."""
    h = model.embed(tokens)
    ctx = model._context(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), 0, None, h.dtype)
    blocks, partial = [], h
    seen = []  # sources per aggregation, in order

    def aggregate(depth, srcs):
        seen.append(len(srcs))
        return reference_depth_attention(srcs, depth.query, depth.gain, depth.eps)

    for number, block in enumerate(model.layers.values(), start=1):
        for name, run in (("attn", lambda x, b=block: b.attn(x, ctx)), ("ffn", block.ffn)):
            connection, norm = getattr(block, f"{name}_residual"), getattr(block, f"{name}_norm")
            if k == 0 or (name == "attn" and (number - 1) % k == 0):
                blocks.append(partial)
                partial = None
            x = aggregate(connection.depth, blocks + ([] if partial is None else [partial]))
            out = run(norm(x))
            partial = out if partial is None else partial + out
    final = [*blocks, partial]
    assert len(final) == head_sources(len(model.layers), k)
    out = model.norm(aggregate(model.stream.head, final))
    assert seen == model.stream.source_counts()  # what inspect's FLOPs count
    return out


@pytest.mark.parametrize(("n_layers", "k"), [(5, 0), (5, 1), (5, 2), (6, 2), (7, 3), (4, 4)])
def test_block_bookkeeping_equals_the_literal_rule(n_layers, k):
    model = build_model(cfg(k, n_layers), seed=0).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".query", "depth.gain", "head.gain")):
                p.copy_(torch.randn_like(p))  # trained-looking queries: the weights matter
    tokens = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        h = model.norm(
            model.stream.collapse(_run_blocks(model, tokens))
        )  # the model's own path, before the head
        torch.testing.assert_close(h, literal(model, tokens, k), **F64)


def _run_blocks(model, tokens):
    h = model.embed(tokens)
    ctx = model._context(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), 0, None, h.dtype)
    state = model.stream.expand(h)
    for block in model.layers.values():
        state = block(state, ctx)
    return state


def test_inspect_counts_the_aggregation_flops():
    from model.accounting import training_flops_per_token

    model = build_model(cfg(2, 5), device="meta")
    flops = training_flops_per_token(model, 64)
    counts = model.stream.source_counts()  # [1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4]
    assert sum(counts) == 29 and flops.residual == 3 * 6 * 32 * 29
    pre = ModelConfig(**{**vars(cfg(2, 5)), "residual": "pre"})
    plain = training_flops_per_token(build_model(pre, device="meta"), 64)
    assert flops.total == plain.total + flops.residual and plain.residual == 0


def test_the_head_sees_the_reference_number_of_sources():
    assert [head_sources(8, k) for k in (0, 1, 2, 3, 4, 8)] == [17, 9, 5, 4, 3, 2]
    # blocks start at layers 1, 4, 7 (k=3 of 8): embedding + 3 block sums; and so on
    assert [head_sources(L, k) for L, k in ((8, 3), (9, 4), (12, 4))] == [4, 4, 4]


@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"moe": MoEConfig(n_routed_experts=4, top_k=2, expert_hidden=16, first_k_dense=1)},
        {"layer_pattern": ["gdn", "gqa"]},
        {"attention": AttentionConfig(kind="mla", n_heads=4, mla=MLA_SMALL)},
    ],
    ids=["dense", "moe", "hybrid", "mla"],
)
def test_zero_queries_compute_the_pre_norm_model(k, extra):
    """At initialization every alpha is 1/N: h = the pre-norm stream / N, which RMSNorm undoes
    (an eps of 1e-30 keeps its scale invariance exact in fp64)."""
    attnres = build_model(cfg(k, 4, norm_eps=1e-30, **extra), seed=0).double().eval()
    plain = build_model(
        ModelConfig(**{**vars(cfg(k, 4, norm_eps=1e-30, **extra)), "residual": "pre"}), seed=0
    ).double()
    plain.load_state_dict(
        {n: t for n, t in attnres.state_dict().items() if n in plain.state_dict()}
    )
    tokens = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(attnres(tokens), plain(tokens), rtol=0, atol=1e-12)


def test_generation_with_a_kv_cache_equals_the_full_forward():
    """The depth aggregation is per token: prefill + decode equals one forward."""
    model = build_model(cfg(2), seed=0).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".query"):
                p.copy_(torch.randn_like(p))
        tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(4))
        full = model(tokens)
        cache = model.new_cache(2, 12, dtype=torch.float64)
        torch.testing.assert_close(model(tokens[:, :7], cache=cache), full[:, :7], **F64)
        for t in range(7, 12):
            torch.testing.assert_close(
                model(tokens[:, t : t + 1], cache=cache)[:, 0], full[:, t], **F64
            )


def test_queries_and_key_gains_take_adamw_without_decay():
    from optim.roles import ROLE_SETTINGS

    roles = param_roles(build_model(cfg(2), seed=0))
    assert roles["layers.0.attn_residual.depth.query"] == "mixing"
    assert roles["layers.0.ffn_residual.depth.gain"] == "gain"
    assert roles["stream.head.query"] == "mixing"
    for role in ("mixing", "gain"):
        assert not ROLE_SETTINGS[role].muon and not ROLE_SETTINGS[role].weight_decay


def test_bad_block_size_names_the_field():
    from model import ConfigError

    with pytest.raises(ConfigError, match="model.attnres.block_layers=-1"):
        AttnResConfig(block_layers=-1)


def test_compiled_sublayers_match_eager_with_more_blocks_than_dynamos_recompile_limit():
    """parallel.activation.compile_model compiles the sublayers for AttnRes (each block sees
    another number of sources; whole blocks would recompile per block and fall back to eager
    after 8): 10 layers, one graph per sublayer kind, no recompile-limit hit; the stream's
    metrics survive (its connections stay eager)."""
    import torch._dynamo

    from parallel.activation import compile_model

    small = dict(d_model=16, attention=AttentionConfig(n_heads=2), ffn=FFNConfig(hidden=16))
    config = ModelConfig(**{**vars(cfg(1, 10)), **small})
    eager, compiled = (build_model(config, seed=0) for _ in range(2))
    with torch.no_grad():
        for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
            if name.endswith(".query"):
                p.copy_(torch.randn_like(p))
                q.copy_(p)
    compile_model(compiled, "cpu")
    gen = torch.Generator().manual_seed(5)
    tokens, targets = (torch.randint(0, 64, (2, 16), generator=gen) for _ in range(2))
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
        b = compiled(tokens, targets)
    a = eager(tokens, targets)
    a.backward()
    b.backward()
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for p, q in zip(eager.parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5)
    assert "attnres/layer9/entropy" in compiled.stream.stats(compiled)


def test_block_sums_stay_in_the_streams_dtype_under_autocast():
    """Under bf16 autocast the sublayers return bf16; a block's running sum starts in the
    embedding's dtype (fp32), as the pre-norm residual stays fp32."""
    model = build_model(cfg(2, 5), seed=0)
    tokens = torch.randint(0, 64, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        completed, partial = _run_blocks(model, tokens)
    assert [t.dtype for t in completed.tensors] == [
        torch.float32
    ] * 3 and partial.dtype == torch.float32
