"""mHC against transformers' DeepSeek-V4 modules with copied weights (the maps, the layer update,
the learned collapse), the Sinkhorn recipe, n = 1 with neutral parameters = the plain residual
model, recomputed maps = kept maps, generation, parameter roles, composition with MoE / hybrid."""

from __future__ import annotations

import pytest
import torch

from model import (
    AttentionConfig,
    FFNConfig,
    MHCConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    build_model,
)
from model.residual.mhc import HyperConnection, HyperHead, sinkhorn
from model.roles import param_roles

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (  # noqa: E402
    DeepseekV4HyperConnection,
    DeepseekV4HyperHead,
)

C, N = 32, 4
MLA_SMALL = MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
F32 = dict(rtol=1e-6, atol=1e-6)


def hf_config(**kw):
    return transformers.DeepseekV4Config(
        hidden_size=C, hc_mult=N, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, **kw
    )


def streams(seed=0, n=N):
    return torch.randn(2, 7, n, C, generator=torch.Generator().manual_seed(seed))


def ours_and_theirs(seed=0):
    ours = HyperConnection(C, N, iters=20, eps=1e-6, norm_eps=1e-6, recompute=False)
    theirs = DeepseekV4HyperConnection(hf_config())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("fn", "base", "scale"):
            value = torch.randn(getattr(ours, name).shape, generator=gen) * 0.3
            getattr(ours, name).copy_(value)
            getattr(theirs, name).copy_(value)
    return ours, theirs


def test_the_maps_equal_deepseek_v4_hyper_connection():
    ours, theirs = ours_and_theirs()
    x = streams()
    pre, post, comb = ours.maps(x)
    their_post, their_comb, collapsed = theirs(x)
    torch.testing.assert_close(post, their_post, **F32)
    torch.testing.assert_close(comb, their_comb, **F32)
    torch.testing.assert_close((pre.unsqueeze(-1) * x).sum(2), collapsed, **F32)


def test_the_layer_update_is_deepseek_v4s_with_the_transposed_mix():
    """DeepseekV4DecoderLayer: post * F(norm(collapsed)) + comb^T @ x, with F a stub sublayer."""
    ours, theirs = ours_and_theirs(1)
    x = streams(1)
    weight = torch.randn(C, C, generator=torch.Generator().manual_seed(2))
    norm = torch.nn.RMSNorm(C, eps=1e-6)

    def sublayer(h):
        return torch.tanh(h @ weight)

    post, comb, collapsed = theirs(x)
    expected = post.unsqueeze(-1) * sublayer(norm(collapsed)).unsqueeze(-2) + torch.matmul(
        comb.transpose(-1, -2), x
    )
    torch.testing.assert_close(ours(x, sublayer, norm), expected, **F32)
    mixed_untransposed = post.unsqueeze(-1) * sublayer(norm(collapsed)).unsqueeze(-2) + comb @ x
    assert (ours(x, sublayer, norm) - mixed_untransposed).abs().max() > 1e-3  # orientation matters


def test_the_learned_collapse_equals_deepseek_v4_hyper_head():
    ours = HyperHead(C, N, eps=1e-6, norm_eps=1e-6)
    theirs = DeepseekV4HyperHead(hf_config())
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name in ("hc_fn", "hc_base", "hc_scale"):
            value = torch.randn(getattr(ours, name).shape, generator=gen) * 0.3
            getattr(ours, name).copy_(value)
            getattr(theirs, name).copy_(value)
    x = streams(3)
    torch.testing.assert_close(ours(x), theirs(x), **F32)


def test_the_sinkhorn_recipe_and_how_far_from_doubly_stochastic_it_ends():
    logits = (
        torch.randn(500, N, N, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 2
    )
    got = sinkhorn(logits, 20, 1e-6)
    expected = torch.softmax(logits, -1) + 1e-6  # the recipe written out again
    expected = expected / (expected.sum(-2, keepdim=True) + 1e-6)
    for _ in range(19):
        expected = expected / (expected.sum(-1, keepdim=True) + 1e-6)
        expected = expected / (expected.sum(-2, keepdim=True) + 1e-6)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-15)
    columns, rows = got.sum(-2), got.sum(-1)
    assert (columns - 1).abs().max() < 1e-5  # the last step normalizes the columns
    assert (rows - 1).abs().max() > 1e-4  # the rows are only approximately 1 after 20 steps


def cfg(**kw) -> ModelConfig:
    base = dict(
        vocab_size=64,
        d_model=C,
        n_layers=3,
        residual="mhc",
        attention=AttentionConfig(n_heads=4, n_kv_heads=2),
        ffn=FFNConfig(hidden=48),
    )
    return ModelConfig(**(base | kw))


def test_one_stream_with_neutral_parameters_is_the_plain_residual_model():
    """n = 1, eps = 0, scales 0, pre's base large (sigmoid = 1 in fp64), post's 0 (2 sigmoid = 1):
    every update is x + F(norm(x)) and the collapse is the identity."""
    model = build_model(cfg(mhc=MHCConfig(streams=1, eps=0.0)), seed=0).double().eval()
    plain = build_model(ModelConfig(**{**vars(cfg()), "residual": "pre"}), seed=0).double()
    plain.load_state_dict({n: t for n, t in model.state_dict().items() if n in plain.state_dict()})
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, HyperConnection):
                module.scale.zero_()
                module.base.copy_(torch.tensor([40.0, 0.0, 0.0], dtype=torch.float64))
            if isinstance(module, HyperHead):
                module.hc_scale.zero_()
                module.hc_base.fill_(40.0)
    tokens = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), plain(tokens), rtol=0, atol=1e-12)


def test_recomputed_maps_give_the_same_gradients():
    kept = build_model(cfg(mhc=MHCConfig(recompute_maps=False)), seed=0)
    recomputed = build_model(cfg(mhc=MHCConfig(recompute_maps=True)), seed=0)
    tokens, targets = (
        torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(s)) for s in (6, 7)
    )
    kept(tokens, targets).backward()
    recomputed(tokens, targets).backward()
    for (name, p), q in zip(kept.named_parameters(), recomputed.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-8, msg=name)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"moe": MoEConfig(n_routed_experts=4, top_k=2, expert_hidden=16, first_k_dense=1)},
        {"layer_pattern": ["gdn", "gqa"], "mhc": MHCConfig(collapse="mean")},
        {"attention": AttentionConfig(kind="mla", n_heads=4, mla=MLA_SMALL)},
    ],
    ids=["dense", "moe", "hybrid_mean_collapse", "mla"],
)
def test_generation_equals_the_full_forward(extra):
    model = build_model(cfg(**extra), seed=0).double().eval()
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(2, 12, dtype=torch.float64)
        torch.testing.assert_close(
            model(tokens[:, :7], cache=cache), full[:, :7], rtol=1e-10, atol=1e-12
        )
        for t in range(7, 12):
            step = model(tokens[:, t : t + 1], cache=cache)[:, 0]
            torch.testing.assert_close(step, full[:, t], rtol=1e-10, atol=1e-12)


def test_mhc_parameters_take_adamw_without_decay_and_inspect_counts_them():
    from model.accounting import param_counts, training_flops_per_token

    model = build_model(cfg(), seed=0)
    roles = param_roles(model)
    assert {roles[f"layers.0.attn_residual.{n}"] for n in ("fn", "base", "scale")} == {"mixing"}
    assert roles["stream.head.hc_fn"] == "mixing"
    plain = build_model(ModelConfig(**{**vars(cfg()), "residual": "pre"}), device="meta")
    per_map = (2 + N) * N * (N * C + 1) + 3
    extra = 2 * 3 * per_map + N * (N * C + 1) + 1  # 2 maps per layer and the head
    assert param_counts(model).total - param_counts(plain).total == extra
    flops = training_flops_per_token(model, 16)
    assert flops.residual == 3 * model.stream.flops_per_token() > 0


def test_compiled_blocks_match_eager_and_keep_the_metrics():
    """mHC's state is one (B, T, n, C) tensor: compile_model compiles whole blocks (the stream's
    elementwise work fuses), and the metrics, written in place into buffers, survive."""
    from parallel.activation import compile_model

    eager, compiled = (build_model(cfg(n_layers=2), seed=0) for _ in range(2))
    compile_model(compiled, "cpu")
    gen = torch.Generator().manual_seed(9)
    tokens, targets = (torch.randint(0, 64, (2, 16), generator=gen) for _ in range(2))
    a, b = eager(tokens, targets), compiled(tokens, targets)
    a.backward()
    b.backward()
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for p, q in zip(eager.parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5)
    stats = compiled.stream.stats(compiled)
    assert stats["mhc/layer1/res_diag"] == pytest.approx(
        eager.stream.stats(eager)["mhc/layer1/res_diag"]
    )
    assert build_model(cfg(), seed=0).stream.stats(build_model(cfg(), seed=0)) == {}  # not trained


def test_the_stream_metrics_stay_fp32_when_the_model_is_cast():
    """bf16_master casts the model: the maps' parameters and their metric buffers keep fp32."""
    model = build_model(cfg(n_layers=2), seed=0).to(torch.bfloat16)
    hc = model.layers["0"].attn_residual
    assert hc.fn.dtype == hc.last_rms.dtype == hc.last_diag.dtype == torch.float32
    assert model.layers["0"].attn.q_proj.weight.dtype == torch.bfloat16
