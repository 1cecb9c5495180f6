"""Norms, FFNs, the FFN width rule, DeepNorm and weight initialization statistics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from model import FFNConfig, ModelConfig, Transformer, build_model
from model.block import Block
from model.mixers.masks import AttentionContext
from model.norms import LayerNorm, RMSNorm
from model.registry import FFNS
from model.residual.stream import deepnorm_alpha, deepnorm_beta
from tests.model.helpers import perturb_norm_weights, tiny_config

# fp32 vs float64 formulas on O(1) values
ATOL = RTOL = 1e-5

# std of a normal(0, s) truncated at +-3 s, divided by s:
# sqrt(1 - 2 * 3 * phi(3) / (2 Phi(3) - 1)) with phi/Phi the standard normal pdf/cdf = 0.98658
TRUNC_STD = math.sqrt(1 - 6 * math.exp(-4.5) / math.sqrt(2 * math.pi) / math.erf(3 / math.sqrt(2)))
# Sampling error of a std estimated from n >= 65536 iid values is ~0.7 / sqrt(n) <= 0.3% (relative)
# for this near-normal distribution; 3% is > 10 standard errors, yet catches any wrong factor
# used here (the smallest, sqrt(2) vs sqrt(2 * 1) for layer 0, is covered by the other layers).
STD_RTOL = 0.03


def test_truncation_factor_constant():
    assert abs(TRUNC_STD - 0.98658) < 1e-5


# ---- norms -------------------------------------------------------------------------------------


def randn(*shape: int, seed: int = 0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("eps", [1e-5, 1e-2])
def test_rms_norm_formula(eps):
    norm = RMSNorm(24, eps)
    with torch.no_grad():
        norm.weight.copy_(randn(24, seed=1))
    x = randn(3, 5, 24) * 3
    xd = x.double()
    want = xd / torch.sqrt(xd.square().mean(-1, keepdim=True) + eps) * norm.weight.double()
    torch.testing.assert_close(norm(x).double(), want, atol=ATOL, rtol=RTOL)
    # bf16 in, bf16 out, computed in fp32: within one bf16 rounding of the exact value
    got = norm(x.bfloat16())
    assert got.dtype == torch.bfloat16
    xb = x.bfloat16().double()
    want_b = xb / torch.sqrt(xb.square().mean(-1, keepdim=True) + eps) * norm.weight.double()
    torch.testing.assert_close(got.double(), want_b, atol=1e-6, rtol=2**-8)


@pytest.mark.parametrize("eps, scale", [(1e-5, 3.0), (1e-2, 0.1)])  # eps matters in the second
def test_rms_norm_gradients_match_autograd_of_the_formula(eps, scale):
    """The closed-form backward (model/norms.py RMSNormFunction, RMSNorm's CPU path) against
    autograd through the plain formula in fp64: gradcheck in fp64; fp32 within fp32 rounding,
    also for a non-contiguous input; a bf16 input (dx comes back in bf16, dw in the weight's
    fp32) within one bf16 rounding at the bf16-rounded input; a bf16 weight gets a bf16 dw."""
    norm = RMSNorm(24, eps).double()
    with torch.no_grad():
        norm.weight.copy_(randn(24, seed=1))
    x = randn(3, 5, 24) * scale
    assert torch.autograd.gradcheck(norm, (x.double().requires_grad_(),))

    def formula_grads(x: Tensor, dy: Tensor, weight: Tensor) -> tuple[Tensor, ...]:
        xd, w = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
        y = xd / torch.sqrt(xd.square().mean(-1, keepdim=True) + eps) * w
        return torch.autograd.grad(y, (xd, w), dy.double())

    norm32 = RMSNorm(24, eps)
    norm32.load_state_dict(norm.state_dict())
    dy = randn(3, 5, 24, seed=3)
    cases = [  # (input, gradient, tolerance relative to the largest entry)
        (x, dy, RTOL),
        (x.transpose(0, 1).contiguous().transpose(0, 1), dy, RTOL),  # non-contiguous
        (x.bfloat16(), dy.bfloat16(), 2**-7),
    ]
    for xi, dyi, rtol in cases:
        xi = xi.detach().requires_grad_()
        got = torch.autograd.grad(norm32(xi), (xi, norm32.weight), dyi)
        assert got[0].dtype == xi.dtype and got[1].dtype == torch.float32
        for g, want in zip(got, formula_grads(xi, dyi, norm32.weight)):
            torch.testing.assert_close(
                g.double(), want, atol=rtol * want.abs().max().item(), rtol=rtol
            )
    norm16 = RMSNorm(24, eps).bfloat16()
    norm16.load_state_dict(norm.state_dict())
    xi = x.requires_grad_()
    grad_w = torch.autograd.grad(norm16(xi), norm16.weight, dy)[0]
    want = formula_grads(xi, dy, norm16.weight)[1]
    assert grad_w.dtype == torch.bfloat16
    torch.testing.assert_close(grad_w.double(), want, atol=0, rtol=2**-8)


def test_rms_norm_refuses_double_backward():
    """rstd is saved as a constant: a second derivative would be wrong, so it is an error."""
    norm = RMSNorm(8, 1e-5)
    x = randn(2, 8).requires_grad_()
    (grad,) = torch.autograd.grad(norm(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        grad.sum().backward()


def test_layer_norm_matches_torch():
    norm = LayerNorm(24, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(randn(24, seed=1))
        norm.bias.copy_(randn(24, seed=2))
    x = randn(3, 5, 24) * 3 + 1
    want = F.layer_norm(x.double(), (24,), norm.weight.double(), norm.bias.double(), 1e-5)
    torch.testing.assert_close(norm(x).double(), want, atol=ATOL, rtol=RTOL)
    norm.init_weights()
    assert torch.equal(norm.weight, torch.ones(24)) and torch.equal(norm.bias, torch.zeros(24))


# ---- FFNs --------------------------------------------------------------------------------------


def exact_gelu(x: Tensor) -> Tensor:
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def tanh_gelu(x: Tensor) -> Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


ACTIVATIONS = {
    "swiglu": lambda x: x * torch.sigmoid(x),
    "geglu": exact_gelu,
    "gelu": exact_gelu,
    "relu": lambda x: x.clamp(min=0),
    "relu2": lambda x: x.clamp(min=0) ** 2,
}


def lin(x: Tensor, layer: torch.nn.Linear) -> Tensor:
    out = x @ layer.weight.double().T
    return out if layer.bias is None else out + layer.bias.double()


@pytest.mark.parametrize("kind", list(ACTIVATIONS))
@pytest.mark.parametrize("bias", [False, True])
def test_ffn_formula(kind, bias):
    torch.manual_seed(0)
    ffn = FFNS.get(kind)(16, 40, bias)
    with torch.no_grad():
        for i, p in enumerate(ffn.parameters()):
            p.copy_(randn(*p.shape, seed=10 + i) * 0.5)
    x = randn(2, 7, 16, seed=3)
    act = ACTIVATIONS[kind]
    xd = x.double()
    if kind in ("swiglu", "geglu"):
        want = lin(act(lin(xd, ffn.gate_proj)) * lin(xd, ffn.up_proj), ffn.down_proj)
        assert ffn.gate_proj.weight.shape == (40, 16)
    else:
        want = lin(act(lin(xd, ffn.up_proj)), ffn.down_proj)
        assert not hasattr(ffn, "gate_proj")
    got = ffn(x)
    torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=RTOL)
    if kind in ("geglu", "gelu"):  # exact erf GELU, not the tanh approximation
        pre = lin(xd, ffn.gate_proj if kind == "geglu" else ffn.up_proj)
        assert (exact_gelu(pre) - tanh_gelu(pre)).abs().max() > 1e-4


@pytest.mark.parametrize(
    ("d_model", "ffn", "hidden"),
    [
        (4096, FFNConfig(kind="swiglu", multiplier=1.3, multiple_of=1024), 14336),  # Llama 3 8B
        (4096, FFNConfig(kind="swiglu", multiple_of=256), 11008),  # Llama 2 7B
        (8192, FFNConfig(kind="swiglu", multiplier=1.3, multiple_of=4096), 28672),  # Llama 2/3 70B
        (4096, FFNConfig(kind="geglu", multiple_of=256), 11008),  # any gated kind: 8/3 d rule
        (768, FFNConfig(kind="gelu", multiple_of=256), 4 * 768),  # plain FFN: 4 d (GPT-2)
        (1000, FFNConfig(kind="relu", multiple_of=256), 4096),  # 4000 rounded up to 256
        (4096, FFNConfig(kind="swiglu", hidden=1234), 1234),  # explicit width wins
    ],
)
def test_ffn_hidden_rule(d_model, ffn, hidden):
    cfg = ModelConfig(d_model=d_model, ffn=ffn, position="none")
    assert cfg.ffn_hidden == hidden


# ---- DeepNorm ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n_layers", [1, 6, 24, 100])
def test_deepnorm_constants(n_layers):
    assert math.isclose(deepnorm_alpha(n_layers), (2 * n_layers) ** 0.25, rel_tol=1e-12)
    assert math.isclose(deepnorm_beta(n_layers), (8 * n_layers) ** -0.25, rel_tol=1e-12)


def rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("residual", ["pre", "post", "deepnorm"])
def test_block_residual_styles(residual):
    """pre: x + f(norm x); post: norm(x + f x); deepnorm: norm(alpha x + f x), alpha = (2L)^(1/4)."""
    cfg = tiny_config(residual=residual, n_layers=6)
    torch.manual_seed(0)
    block = Block(cfg, 0)
    block.init_weights(cfg)
    perturb_norm_weights(block)
    x = randn(2, 5, cfg.d_model) * 2
    ctx = AttentionContext(
        positions=torch.arange(5).expand(2, 5), rope=None, mask=None, is_causal=True, start=0
    )
    a_norm = lambda h: rms(h, block.attn_norm.weight, cfg.norm_eps)  # noqa: E731
    f_norm = lambda h: rms(h, block.ffn_norm.weight, cfg.norm_eps)  # noqa: E731
    attn = lambda h: block.attn(h, ctx)  # noqa: E731
    with torch.no_grad():
        got = block(x, ctx)
        if residual == "pre":
            h = x + attn(a_norm(x))
            want = h + block.ffn(f_norm(h))
        else:
            alpha = (2 * 6) ** 0.25 if residual == "deepnorm" else 1.0
            h = a_norm(alpha * x + attn(x))
            want = f_norm(alpha * h + block.ffn(h))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


# ---- initialization ----------------------------------------------------------------------------

STATS_CFG = dict(
    vocab_size=512,
    d_model=256,
    n_layers=4,
    max_seq_len=256,
    position="learned",
    attention={"n_heads": 4, "bias": True, "qk_norm": True, "output_gate": True},
    ffn={"kind": "swiglu", "hidden": 512, "bias": True},
    init={"std": 0.02},
)


def stats_config(**overrides) -> ModelConfig:
    kw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in STATS_CFG.items()}
    for key, value in overrides.items():
        if isinstance(value, dict):
            kw[key] = kw.get(key, {}) | value
        else:
            kw[key] = value
    return tiny_config(**kw)


def expected_stds(cfg: ModelConfig, gain: float | None = None) -> dict[str, float]:
    """Expected std of every weight matrix by role, written from the rules, before truncation.
    A DeepNorm gain replaces the depth scaling (DeepNet: beta is the depth-dependent factor)."""
    s, L = cfg.init.std, cfg.n_layers
    out = {"embed.weight": s, "head.weight": s, "pos.weight": s}
    for layer in range(L):
        depth = {
            "none": 1.0,
            "total": 1 / math.sqrt(2 * L),
            "layer": 1 / math.sqrt(2 * (layer + 1)),
        }[cfg.init.depth_scaling]
        if gain is not None:
            depth = 1.0
        p = f"layers.{layer}."
        out |= {
            p + "attn.q_proj.weight": s,
            p + "attn.k_proj.weight": s,
            p + "attn.gate_proj.weight": s,
            p + "attn.v_proj.weight": s * (gain or 1.0),
            p + "attn.o_proj.weight": s * depth * (gain or 1.0),
            p + "ffn.gate_proj.weight": s * (gain or 1.0),
            p + "ffn.up_proj.weight": s * (gain or 1.0),
            p + "ffn.down_proj.weight": s * depth * (gain or 1.0),
        }
    return out


def check_init_statistics(model: Transformer, want: dict[str, float]) -> None:
    params = dict(model.named_parameters())
    assert set(want) == {n for n, p in params.items() if p.ndim == 2}  # every matrix has a rule
    for name, std in want.items():
        w = params[name].detach()
        assert w.numel() >= 65536, name  # the tolerance assumes this many samples
        got = w.std().item()
        assert abs(got / (std * TRUNC_STD) - 1) < STD_RTOL, (name, got, std * TRUNC_STD)
        assert abs(w.mean().item()) < 5 * std / math.sqrt(w.numel()), name
        assert w.abs().max().item() <= 3 * std * (1 + 1e-6), name  # truncated at +-3 std
    for name, p in params.items():
        if p.ndim == 1:  # norm weights are ones, biases zeros
            fill = 1.0 if "norm" in name else 0.0
            assert torch.equal(p, torch.full_like(p, fill)), name


@pytest.mark.parametrize("depth_scaling", ["total", "layer", "none"])
def test_init_statistics(depth_scaling):
    cfg = stats_config(init={"std": 0.02, "depth_scaling": depth_scaling})
    torch.manual_seed(0)
    model = Transformer(cfg)
    check_init_statistics(model, expected_stds(cfg))


def test_init_on_meta_then_materialize():
    cfg = stats_config()
    torch.manual_seed(0)
    model = build_model(cfg)  # meta device -> to_empty -> init_weights
    assert all(p.device.type == "cpu" for p in model.parameters())
    check_init_statistics(model, expected_stds(cfg))
    # init_weights overwrites every parameter: poison them all, re-initialize, nothing survives
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    model.init_weights()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    check_init_statistics(model, expected_stds(cfg))


def test_deepnorm_init_gain():
    """DeepNorm initializes v_proj, o_proj and FFN weights with std x beta, beta = (8L)^(-1/4), in
    place of the depth scaling of output projections; q/k keep std."""
    cfg = stats_config(residual="deepnorm")
    beta = (8 * cfg.n_layers) ** -0.25
    assert beta < 0.5  # far enough from 1 that STD_RTOL separates scaled from unscaled
    torch.manual_seed(0)
    deep = Transformer(cfg)
    torch.manual_seed(0)
    post = Transformer(stats_config(residual="post"))
    check_init_statistics(deep, expected_stds(cfg, gain=beta))
    check_init_statistics(post, expected_stds(cfg))
    depth = 1 / math.sqrt(2 * cfg.n_layers)  # post-norm keeps the configured "total" depth scaling
    for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "ffn.down_proj"):
        ratio = (
            deep.get_parameter(f"layers.2.{name}.weight").std()
            / post.get_parameter(f"layers.2.{name}.weight").std()
        )
        expected = {"attn.v_proj": beta, "attn.o_proj": beta / depth, "ffn.down_proj": beta / depth}
        assert abs(ratio.item() / expected.get(name, 1.0) - 1) < STD_RTOL, name


def test_tied_embeddings():
    cfg = tiny_config(tie_embeddings=True)
    torch.manual_seed(0)
    model = Transformer(cfg)
    untied = Transformer(tiny_config())
    assert model.head is None
    assert model.head_weight is model.embed.weight
    n = sum(p.numel() for p in model.parameters())
    assert n == sum(p.numel() for p in untied.parameters()) - cfg.vocab_size * cfg.d_model
    tokens = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(tokens)
        h = model.hidden_states(tokens)
    torch.testing.assert_close(logits, h @ model.embed.weight.T, atol=ATOL, rtol=RTOL)
    # the output head's gradient lands on the embedding matrix (rows of tokens never input too)
    unseen = sorted(set(range(cfg.vocab_size)) - set(tokens.flatten().tolist()))[0]
    model(tokens).sum().backward()
    assert model.embed.weight.grad[unseen].abs().sum() > 0


def test_mla_deepnorm_scales_value_rows_of_the_joint_kv_projection():
    """kv_b_proj stacks [k_nope | v] rows per head: only the value rows take DeepNorm's beta."""
    cfg = stats_config(
        residual="deepnorm",
        position="rope",
        attention={"kind": "mla", "n_heads": 4, "qk_norm": False, "output_gate": False},
        mla={"kv_lora_rank": 256, "qk_nope_head_dim": 64, "qk_rope_head_dim": 8, "v_head_dim": 64},
    )
    beta = (8 * cfg.n_layers) ** -0.25
    weight = Transformer(cfg).layers["1"].attn.kv_b_proj.weight.view(4, 128, 256)
    keys, values = weight[:, :64].std().item(), weight[:, 64:].std().item()
    trunc = 0.98658  # std of a normal truncated at +-3 sigma, relative to sigma
    assert abs(keys / (cfg.init.std * trunc) - 1) < STD_RTOL
    assert abs(values / (cfg.init.std * beta * trunc) - 1) < STD_RTOL
