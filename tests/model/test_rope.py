"""RoPE: rotation properties, the two pairings, every scaling against its formula and against
transformers' own implementation, and ALiBi slopes."""

from __future__ import annotations

import math

import pytest
import torch

from model import RopeConfig
from model.mixers.positions import Rotary, alibi_slopes, build_positions
from model.mixers.rope import (
    base_inv_freq,
    half_to_interleaved,
    interleaved_to_half,
    rope_frequencies,
    rope_rotations,
    softmax_multiplier,
    yarn_mscale,
)
from model.registry import ROPE_PAIRINGS
from tests.model.helpers import (
    perturb_norm_weights,
    ref_alibi_slopes,
    ref_inv_freq,
    ref_rope,
    tiny_config,
    tiny_model,
)

# fp32 rotation of O(1) vectors: scores agree to ~1e-6; 1e-5 leaves room for the angle rounding
ROT_TOL = 1e-5
# inverse frequencies are computed in fp32 by both sides: relative agreement to 1e-6
FREQ_RTOL = 1e-6


def rotate(x: torch.Tensor, pos: int, rotary_dim: int, pairing: str, theta=10000.0):
    """Apply the module's RoPE to x (D,) at one position, as a (1, 1, 1, D) batch."""
    inv_freq = base_inv_freq(theta, rotary_dim)
    rot = rope_rotations(torch.tensor([[pos]]), inv_freq, 1.0)
    return ROPE_PAIRINGS.get(pairing)(x[None, None, None], rot)[0, 0, 0]


# ---- rotation properties -----------------------------------------------------------------------


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_score_depends_only_on_relative_position(pairing, fraction):
    D = 16
    R = int(D * fraction)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(D, generator=g), torch.randn(D, generator=g)
    q, k = q / q.norm(), k / k.norm()  # unit vectors: the score error is the angle error

    def score(m: int, n: int) -> float:
        return float(rotate(q, m, R, pairing) @ rotate(k, n, R, pairing))

    for offset in (0, 1, 5, -3):
        # fp32 angles m * w carry a rounding error ~ m * 6e-8 rad: keep m <= 60 for ROT_TOL
        pairs = [(m, m - offset) for m in (7, 20, 41, 60)]
        scores = torch.tensor([score(m, n) for m, n in pairs])
        assert torch.allclose(scores, scores[0].expand_as(scores), atol=ROT_TOL, rtol=0), (
            offset,
            scores,
        )
    # ... and it does depend on the offset (otherwise the test above would be vacuous)
    assert abs(score(10, 10) - score(10, 7)) > 1e-3

    # rotation preserves norms; partial rotary leaves the tail dims untouched
    rq = rotate(q, 37, R, pairing)
    assert torch.allclose(rq.norm(), q.norm(), atol=ROT_TOL)
    assert torch.equal(rq[R:], q[R:])
    assert not torch.allclose(rq[:R], q[:R], atol=1e-2)


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_rope_matches_reference_implementation(pairing, fraction):
    """Against HF's rotate_half form (half) and Meta's complex form (interleaved), in float64."""
    B, T, H, D = 2, 9, 3, 16
    R = int(D * fraction)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, H, D, generator=g)
    positions = torch.randint(0, 500, (B, T), generator=g)
    inv_freq = base_inv_freq(500.0, R)
    rot = rope_rotations(positions, inv_freq, 1.3)
    got = ROPE_PAIRINGS.get(pairing)(x, rot)
    want = ref_rope(x, positions, ref_inv_freq(500.0, R), pairing, factor=1.3)
    # positions up to 500 rad: fp32 angle rounding ~ 500 * 6e-8 = 3e-5 rad
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_half_pairing_is_bitwise_the_per_half_rotation(dtype, fraction):
    """The paired-halves form (each head as (2, R/2): x cos + swap(x) (-sin, sin)) gives bitwise
    the per-half formula (x1 cos - x2 sin, x2 cos + x1 sin) in fp32 arithmetic, outputs and
    input gradients."""
    B, T, H, D = 2, 9, 3, 16
    R = int(D * fraction)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(B, T, H, D, generator=g).to(dtype)
    grad = torch.randn(B, T, H, D, generator=g).to(dtype)
    rot = rope_rotations(torch.randint(0, 500, (B, T), generator=g), base_inv_freq(500.0, R), 1.3)

    def per_half(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        cos, sin = torch.view_as_real(rot)[:, :, None].unbind(-1)  # (B, T, 1, R/2) each
        x1, x2 = x[..., : R // 2].float(), x[..., R // 2 : R].float()
        a, b = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        return torch.cat([a.to(x.dtype), b.to(x.dtype), x[..., R:]], dim=-1)

    results = []
    for apply in (ROPE_PAIRINGS.get("half"), per_half):
        leaf = x.clone().requires_grad_()
        out = apply(leaf, rot)
        out.backward(grad)
        results.append((out.detach(), leaf.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_pairing_conversion_by_permutation(fraction):
    """rope_half(P x) == P rope_interleaved(x) with P = interleaved_to_half; the inverse undoes P."""
    B, T, H, D = 2, 6, 3, 16
    R = int(D * fraction)
    perm = interleaved_to_half(R, D)
    inv = half_to_interleaved(R, D)
    assert sorted(perm.tolist()) == list(range(D))
    assert perm[: R // 2].tolist() == list(range(0, R, 2))  # explicit: evens, then odds, then tail
    assert perm[R // 2 : R].tolist() == list(range(1, R, 2))
    assert torch.equal(perm[inv], torch.arange(D))
    assert torch.equal(inv[perm], torch.arange(D))

    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, T, H, D, generator=g)
    k = torch.randn(B, T, H, D, generator=g)
    positions = torch.arange(T).expand(B, T) * 3
    rot = rope_rotations(positions, base_inv_freq(10000.0, R), 1.0)
    half, inter = ROPE_PAIRINGS.get("half"), ROPE_PAIRINGS.get("interleaved")
    for x in (q, k):
        torch.testing.assert_close(
            half(x[..., perm], rot), inter(x, rot)[..., perm], atol=ROT_TOL, rtol=0
        )
        torch.testing.assert_close(
            half(x[..., perm], rot)[..., inv], inter(x, rot), atol=ROT_TOL, rtol=0
        )
    # the two pairings really differ without the permutation
    assert not torch.allclose(half(q, rot), inter(q, rot), atol=1e-2)
    # and scores agree: q.k is invariant under the same permutation of both
    s_inter = torch.einsum("bthd,bshd->bhts", inter(q, rot), inter(k, rot))
    s_half = torch.einsum("bthd,bshd->bhts", half(q[..., perm], rot), half(k[..., perm], rot))
    torch.testing.assert_close(s_half, s_inter, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_interleaved_model_equals_half_model_with_permuted_qk_rows(fraction, qk_norm):
    attention = {"qk_norm": qk_norm, "n_kv_heads": 2}
    cfg_i = tiny_config(attention=attention, rope={"fraction": fraction, "pairing": "interleaved"})
    cfg_h = tiny_config(attention=attention, rope={"fraction": fraction, "pairing": "half"})
    inter = tiny_model(cfg_i)
    # q/k norm weights start at 1: make them random so their permutation matters
    perturb_norm_weights(inter)
    half = tiny_model(cfg_h, seed=123)
    D, R = cfg_i.head_dim, cfg_i.rotary_dim
    perm = interleaved_to_half(R, D)
    state = {}
    for name, w in inter.state_dict().items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = w.shape[0] // D
            w = w.view(heads, D, -1)[:, perm].reshape_as(w)  # permute each head's rows
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            w = w[perm]  # the per-dim norm weight follows its dim
        state[name] = w
    half.load_state_dict(state)
    unpermuted = tiny_model(cfg_h)
    unpermuted.load_state_dict(inter.state_dict())  # same weights as `inter`, other pairing
    tokens = torch.randint(0, cfg_i.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got, wrong = inter(tokens), half(tokens), unpermuted(tokens)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (wrong - want).abs().max() > 1e-3


# ---- scalings against their formulas -----------------------------------------------------------

R, THETA, L0 = 32, 10000.0, 64


def freqs(scaling: str, length: int = L0, original: int = L0, **kw):
    cfg = RopeConfig(scaling=scaling, theta=kw.pop("theta", THETA), **kw)
    return rope_frequencies(cfg, R, original, length)


def test_plain_frequencies():
    inv, factor = freqs("none")
    want = torch.tensor([THETA ** (-2 * i / R) for i in range(R // 2)], dtype=torch.float64)
    torch.testing.assert_close(inv.double(), want, rtol=FREQ_RTOL, atol=0)
    assert factor == 1.0


def test_linear_scaling():
    inv, factor = freqs("linear", factor=4.0)
    torch.testing.assert_close(inv.double(), ref_inv_freq(THETA, R) / 4, rtol=FREQ_RTOL, atol=0)
    assert factor == 1.0


def test_ntk_scaling():
    s = 4.0
    inv, factor = freqs("ntk", factor=s)
    want = ref_inv_freq(THETA * s ** (R / (R - 2)), R)
    torch.testing.assert_close(inv.double(), want, rtol=FREQ_RTOL, atol=0)
    # the NTK-aware property: highest frequency kept, lowest divided by exactly s
    assert inv[0] == 1.0
    assert math.isclose(float(inv[-1]), float(ref_inv_freq(THETA, R)[-1]) / s, rel_tol=1e-5)
    assert factor == 1.0


def test_dynamic_ntk_scaling():
    s = 2.0
    for length in (1, L0 // 2, L0):  # at or below the original length: plain RoPE
        inv, _ = freqs("dynamic_ntk", length=length, factor=s)
        torch.testing.assert_close(inv.double(), ref_inv_freq(THETA, R), rtol=FREQ_RTOL, atol=0)
    for length in (L0 + 1, 3 * L0):
        inv, factor = freqs("dynamic_ntk", length=length, factor=s)
        base = THETA * (s * length / L0 - (s - 1)) ** (R / (R - 2))
        torch.testing.assert_close(inv.double(), ref_inv_freq(base, R), rtol=FREQ_RTOL, atol=0)
        assert factor == 1.0


def test_dynamic_ntk_in_the_position_module():
    """The Rotary module uses the current total length: plain up to L0, rescaled beyond."""
    cfg = tiny_config(max_seq_len=16, rope={"scaling": "dynamic_ntk", "factor": 2.0})
    rot = Rotary(cfg)
    plain = ref_inv_freq(cfg.rope.theta, cfg.rotary_dim)
    torch.testing.assert_close(
        rot.frequencies(torch.device("cpu"), 16, cfg.rotary_dim)[0].double(),
        plain,
        rtol=1e-6,
        atol=0,
    )
    base = cfg.rope.theta * (2.0 * 40 / 16 - 1) ** (cfg.rotary_dim / (cfg.rotary_dim - 2))
    torch.testing.assert_close(
        rot.frequencies(torch.device("cpu"), 40, cfg.rotary_dim)[0].double(),
        ref_inv_freq(base, cfg.rotary_dim),
        rtol=1e-6,
        atol=0,
    )


def ref_yarn(s, beta_fast=32.0, beta_slow=1.0, theta=THETA, dim=R, original=L0):
    """YaRN (Peng et al. 2023), written out: dim index d whose wavelength 2 pi theta^(2d/R) makes
    r rotations over the original context L0 solves L0 / (2 pi theta^(2d/R)) = r."""

    def dim_for(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_for(beta_fast)), 0)
    high = min(math.ceil(dim_for(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i in range(dim // 2):
        w = theta ** (-2 * i / dim)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: extrapolate, 1: interpolate
        out.append(w * (1 - ramp) + (w / s) * ramp)
    return torch.tensor(out, dtype=torch.float64)


def mscale(s, m=1.0):
    return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0


@pytest.mark.parametrize("s", [4.0, 40.0])
@pytest.mark.parametrize(("beta_fast", "beta_slow"), [(32.0, 1.0), (16.0, 2.0)])
def test_yarn_scaling(s, beta_fast, beta_slow):
    inv, factor = freqs("yarn", factor=s, beta_fast=beta_fast, beta_slow=beta_slow)
    want = ref_yarn(s, beta_fast, beta_slow)
    torch.testing.assert_close(inv.double(), want, rtol=FREQ_RTOL, atol=0)
    # the fastest dim is extrapolated (kept), the slowest interpolated (divided by s)
    assert inv[0] == 1.0
    assert math.isclose(float(inv[-1]), float(ref_inv_freq(THETA, R)[-1]) / s, rel_tol=1e-5)
    # a real ramp: some dims strictly between the two
    assert (
        (inv < ref_inv_freq(THETA, R) * 0.999) & (inv > ref_inv_freq(THETA, R) / s * 1.001)
    ).any()
    assert math.isclose(factor, 0.1 * math.log(s) + 1, rel_tol=1e-12)
    assert softmax_multiplier(RopeConfig(scaling="yarn", factor=s)) == 1.0


def test_yarn_scaling_with_clamped_ramp():
    """Small theta, long original context: beta_slow's dim index lies beyond R - 1 and is clamped
    to R - 1 (not R/2 - 1), so even the slowest dim is only partly interpolated."""
    theta, original, s = 100.0, 4096, 4.0
    inv, _ = freqs("yarn", factor=s, theta=theta, original=original)
    want = ref_yarn(s, theta=theta, original=original)
    torch.testing.assert_close(inv.double(), want, rtol=FREQ_RTOL, atol=0)
    assert float(inv[-1]) > float(ref_inv_freq(theta, R)[-1]) / s * 1.01


def test_yarn_deepseek_mscale_form():
    s, m, m_all = 40.0, 1.0, 0.8
    cfg = RopeConfig(scaling="yarn", factor=s, mscale=m, mscale_all_dim=m_all)
    _, factor = rope_frequencies(cfg, R, L0, L0)
    assert math.isclose(factor, mscale(s, m) / mscale(s, m_all), rel_tol=1e-12)
    assert math.isclose(softmax_multiplier(cfg), mscale(s, m_all) ** 2, rel_tol=1e-12)
    assert math.isclose(yarn_mscale(s, m_all), mscale(s, m_all), rel_tol=1e-12)
    # DeepSeek-V3's shipped values (mscale == mscale_all_dim == 0.707): cos/sin factor exactly 1
    cfg = RopeConfig(scaling="yarn", factor=s, mscale=0.707, mscale_all_dim=0.707)
    assert rope_frequencies(cfg, R, L0, L0)[1] == 1.0
    assert math.isclose(softmax_multiplier(cfg), (0.0707 * math.log(s) + 1) ** 2, rel_tol=1e-12)
    # an explicit attention_factor wins
    cfg = RopeConfig(scaling="yarn", factor=s, attention_factor=1.25)
    assert rope_frequencies(cfg, R, L0, L0)[1] == 1.25
    # softmax multiplier is only a yarn thing
    assert softmax_multiplier(RopeConfig(scaling="linear", factor=s, mscale_all_dim=1.0)) == 1.0


def ref_llama3(s, low_ff=1.0, high_ff=4.0, theta=THETA, dim=R, original=L0):
    """Llama 3.1: wavelength < L0/high kept, > L0/low divided by s, smooth blend in between."""
    out = []
    for i in range(dim // 2):
        w = theta ** (-2 * i / dim)
        wavelen = 2 * math.pi / w
        if wavelen < original / high_ff:
            out.append(w)
        elif wavelen > original / low_ff:
            out.append(w / s)
        else:
            smooth = (original / wavelen - low_ff) / (high_ff - low_ff)
            out.append((1 - smooth) * w / s + smooth * w)
    return torch.tensor(out, dtype=torch.float64)


def test_llama3_scaling():
    s = 8.0
    inv, factor = freqs("llama3", factor=s)
    want = ref_llama3(s)
    torch.testing.assert_close(inv.double(), want, rtol=FREQ_RTOL, atol=0)
    assert factor == 1.0
    # all three bands are present for these sizes (so the test covers each branch)
    wavelen = 2 * math.pi / ref_inv_freq(THETA, R)
    assert (wavelen < L0 / 4).any() and (wavelen > L0).any()
    assert ((wavelen >= L0 / 4) & (wavelen <= L0)).any()


# ---- scalings against transformers -------------------------------------------------------------


def hf_freqs(rope_type: str, params: dict, max_pos: int, seq_len: int | None = None):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.LlamaConfig(
        hidden_size=R * 4,
        num_attention_heads=4,
        head_dim=R,
        max_position_embeddings=max_pos,
        rope_parameters={"rope_type": rope_type, "rope_theta": THETA, **params},
    )
    inv, factor = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, "cpu", seq_len=seq_len)
    return inv, factor


HF_CASES = [
    # (our scaling, our kwargs, hf type, hf params, hf max_position_embeddings, length)
    ("linear", {"factor": 4.0}, "linear", {"factor": 4.0}, L0, L0),
    ("dynamic_ntk", {"factor": 2.0}, "dynamic", {"factor": 2.0}, L0, 3 * L0),
    ("dynamic_ntk", {"factor": 2.0}, "dynamic", {"factor": 2.0}, L0, L0 // 2),
    # static NTK is dynamic NTK at the length where s L / L0 - (s - 1) = s, i.e. L = L0 (2s - 1) / s
    ("ntk", {"factor": 2.0}, "dynamic", {"factor": 2.0}, L0, L0 * 3 // 2),
    (
        "yarn",
        {"factor": 4.0},
        "yarn",
        {"factor": 4.0, "original_max_position_embeddings": L0},
        4 * L0,
        L0,
    ),
    (
        "yarn",
        {"factor": 40.0, "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.8},
        "yarn",
        {
            "factor": 40.0,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
            "original_max_position_embeddings": L0,
        },
        40 * L0,
        L0,
    ),
    (
        "yarn",
        {"factor": 4.0, "theta": 100.0, "original": 4096},
        "yarn",
        {"factor": 4.0, "rope_theta": 100.0, "original_max_position_embeddings": 4096},
        4 * 4096,
        4096,
    ),
    (
        "llama3",
        {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        "llama3",
        {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": L0,
        },
        8 * L0,
        L0,
    ),
]


@pytest.mark.parametrize(
    ("scaling", "ours", "hf_type", "hf_params", "max_pos", "length"),
    HF_CASES,
    ids=[f"{c[0]}-{i}" for i, c in enumerate(HF_CASES)],
)
def test_scalings_match_transformers(scaling, ours, hf_type, hf_params, max_pos, length):
    inv, factor = freqs(scaling, length=length, **ours)
    hf_inv, hf_factor = hf_freqs(hf_type, hf_params, max_pos, seq_len=length)
    torch.testing.assert_close(inv, hf_inv.float(), rtol=FREQ_RTOL, atol=0)
    assert math.isclose(factor, hf_factor, rel_tol=FREQ_RTOL)


# ---- additive position encodings ---------------------------------------------------------------


@pytest.mark.parametrize("d_model", [32, 30])
def test_sinusoidal_positions_formula(d_model):
    """Vaswani et al.: PE(p, 2i) = sin(p / 10000^(2i/C)), PE(p, 2i+1) = cos(p / 10000^(2i/C))."""
    cfg = tiny_config(d_model=d_model, position="sinusoidal", attention={"n_heads": 2})
    pos = torch.tensor([[0, 1, 5, 17], [3, 3, 0, 31]])
    got = build_positions(cfg).additive(pos)
    want = torch.zeros(2, 4, d_model, dtype=torch.float64)
    for b in range(2):
        for t in range(4):
            p = float(pos[b, t])
            for i in range(0, d_model, 2):
                want[b, t, i] = math.sin(p / 10000 ** (i / d_model))
                want[b, t, i + 1] = math.cos(p / 10000 ** (i / d_model))
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("position", ["sinusoidal", "learned"])
def test_additive_positions_enter_the_embedding(position):
    """The first block's input is embed(tokens) + PE(positions)."""
    model = tiny_model(tiny_config(position=position))
    tokens = torch.tensor([[3, 3, 3, 3]])
    seen = {}
    hook = model.layers["0"].register_forward_pre_hook(lambda m, a: seen.update(h=a[0]))
    with torch.no_grad():
        model(tokens)
    hook.remove()
    pe = model.pos.additive(torch.arange(4)[None])
    if position == "learned":
        torch.testing.assert_close(pe[0], model.pos.weight[:4], atol=0, rtol=0)
    torch.testing.assert_close(seen["h"], model.embed.weight[tokens] + pe, atol=1e-6, rtol=0)
    assert (seen["h"][0, 1] - seen["h"][0, 0]).abs().max() > 1e-3  # same token, new position


# ---- ALiBi -------------------------------------------------------------------------------------


def test_alibi_slopes_power_of_two():
    got = alibi_slopes(8)
    assert got.tolist() == [2.0**-i for i in range(1, 9)]  # exact: 2^-1 .. 2^-8


def test_alibi_slopes_non_power_of_two():
    got = alibi_slopes(12)
    # 8 heads of the n=8 ladder, then the odd powers of the n=16 ladder: 2^-0.5, 2^-1.5, ...
    want = [2.0**-i for i in range(1, 9)] + [2.0 ** -(i / 2) for i in (1, 3, 5, 7)]
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=0)
    for n in (1, 2, 3, 5, 6, 12, 16, 20):
        torch.testing.assert_close(
            alibi_slopes(n), torch.tensor(ref_alibi_slopes(n)), rtol=1e-6, atol=0
        )
