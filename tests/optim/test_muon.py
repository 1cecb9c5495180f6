"""Muon against references: the Newton-Schulz output's singular values against the scalar
polynomial applied to the input's, Muon steps against torch.optim.Muon (2-D weights), the AdamW
groups against torch.optim.AdamW, expert stacks against a per-expert loop; and the grouping."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from model.presets import load_preset
from model.transformer import build_model
from optim import newton_schulz
from optim.builder import build_optimizer
from optim.config import OptimConfig
from optim.grouping import muon_param_groups
from optim.muon import Muon
from optim.newton_schulz import WholeMatrix, coefficient_schedule, orthogonalize, orthogonalize_many


def _polynomial(s: torch.Tensor, coefficients) -> torch.Tensor:
    for a, b, c in coefficients:
        s = a * s + b * s**3 + c * s**5
    return s


@pytest.mark.parametrize("iteration", [torch.bfloat16, torch.float32])  # CPUs with / without bf16
@pytest.mark.parametrize("schedule", ["quintic", "polar_express"])
@pytest.mark.parametrize("condition", [1.0, 1e2])
@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (3, 48, 32)])
def test_singular_values_follow_the_iteration_polynomial(
    monkeypatch, iteration, schedule, condition, shape
) -> None:
    monkeypatch.setattr(newton_schulz, "iteration_dtype", lambda device: iteration)
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(*shape, generator=gen, dtype=torch.float64)
    if condition != 1.0:  # ill-conditioned: singular values spread over 2 decades
        u, _, vh = torch.linalg.svd(g, full_matrices=False)
        k = min(shape[-2:])
        s = torch.logspace(0, -2, k, dtype=torch.float64).expand(*shape[:-2], k)
        g = u @ torch.diag_embed(s) @ vh
    coefficients = coefficient_schedule(schedule, 5)
    out = torch.linalg.svdvals(orthogonalize(g, coefficients).double())
    normalized = torch.linalg.svdvals(g) / g.norm(dim=(-2, -1), keepdim=True)[..., 0]
    expected = _polynomial(normalized, coefficients).sort(dim=-1, descending=True).values
    # the bf16 (or fp32) iteration against the exact polynomial (as multisets: p is not monotonic). Over
    # 2 decades bf16's rounding of the input (about 2^-9 of its largest entries) stays small
    # against the smallest singular value; over 3 it would not.
    torch.testing.assert_close(out, expected, atol=0.04, rtol=0.04)
    # the band: the polynomial's range over the input's normalized singular value range
    grid = torch.logspace(normalized.min().log10().item(), normalized.max().log10().item(), 4000)
    band = _polynomial(grid.double(), coefficients)
    assert band.min() - 0.05 <= out.min() and out.max() <= band.max() + 0.05
    if schedule == "polar_express":  # tighter than the quintic's (0.68-1.13 on random input)
        assert out.max() < 1.2 and (condition > 1 or out.min() > 0.8)


def _linear_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64, bias=False), nn.Linear(64, 16, bias=False))


@pytest.mark.parametrize(
    ("scaling", "torch_name"), [("match_adamw", "match_rms_adamw"), ("spectral", "original")]
)
def test_muon_steps_equal_torch_optim_muon(monkeypatch, scaling: str, torch_name: str) -> None:
    # torch's Muon iterates in bf16 on every device; ours too where bf16 is native
    monkeypatch.setattr(newton_schulz, "iteration_dtype", lambda device: torch.bfloat16)
    kwargs = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    _assert_same_training(
        lambda params: Muon([{"params": params, "algorithm": "muon"}], scaling=scaling, **kwargs),
        lambda params: torch.optim.Muon(params, adjust_lr_fn=torch_name, **kwargs),
        steps=3,
    )


def test_adamw_groups_equal_torch_adamw() -> None:
    kwargs = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    _assert_same_training(
        lambda params: Muon([{"params": params, "algorithm": "adamw"}], **kwargs),
        lambda params: torch.optim.AdamW(params, foreach=False, **kwargs),
        steps=4,
    )


def _assert_same_training(ours_fn, reference_fn, steps: int) -> None:
    """The same two-layer model trained by both optimizers ends with the same weights."""
    ours_model, ref_model = _linear_model(), _linear_model()
    ours, ref = ours_fn(list(ours_model.parameters())), reference_fn(list(ref_model.parameters()))
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        for model, opt in ((ours_model, ours), (ref_model, ref)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for a, b in zip(ours_model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_expert_stacks_are_orthogonalized_per_expert() -> None:
    g = torch.randn(4, 24, 40, generator=torch.Generator().manual_seed(0))
    coefficients = coefficient_schedule("quintic", 5)
    stacked = orthogonalize(g, coefficients)
    for e in range(4):
        torch.testing.assert_close(stacked[e], orthogonalize(g[e], coefficients), rtol=0, atol=0)


@pytest.mark.parametrize("batch_elements", [1 << 26, 2 * 16 * 24])  # one batch; pairs of (16, 24)
def test_same_shaped_matrices_are_batched_and_equal_alone(monkeypatch, batch_elements) -> None:
    gen = torch.Generator().manual_seed(0)
    # wide and tall (16, 24) / (24, 16), a stack of (16, 24) experts, another schedule, odd ones
    shapes = [(16, 24), (24, 16), (16, 24), (3, 16, 24), (24, 16), (16, 24), (5, 7), (16, 24)]
    updates = [torch.randn(*shape, generator=gen) for shape in shapes]
    quintic = WholeMatrix(tuple(coefficient_schedule("quintic", 5)))
    polar = WholeMatrix(tuple(coefficient_schedule("polar_express", 5)))
    ns = [quintic] * 5 + [polar, quintic, lambda g: g.bfloat16() * 2]
    calls = []
    monkeypatch.setattr(newton_schulz, "BATCH_ELEMENTS", batch_elements)
    plain = newton_schulz.orthogonalize
    monkeypatch.setattr(
        newton_schulz, "orthogonalize", lambda g, c: calls.append(g.shape) or plain(g, c)
    )
    results = orthogonalize_many(updates, ns)
    monkeypatch.setattr(newton_schulz, "orthogonalize", plain)
    for update, f, result in zip(updates, ns, results):
        expected = plain(update, f.coefficients) if isinstance(f, WholeMatrix) else f(update)
        assert result.shape == update.shape and result.dtype == torch.bfloat16
        assert torch.equal(result, expected)
    if batch_elements == 1 << 26:  # quintic (16, 24) x 2 + 3 experts, (24, 16) x 2, polar, (5, 7)
        assert sorted(calls) == sorted([(5, 16, 24), (2, 24, 16), (1, 16, 24), (1, 5, 7)])
    else:  # at most two (16, 24) matrices per batch: the expert stack is a batch of its own
        assert sorted(calls) == sorted(
            [(2, 16, 24), (3, 16, 24), (2, 24, 16), (1, 16, 24), (1, 5, 7)]
        )


def test_grouping_sends_hidden_matrices_to_muon() -> None:
    model = build_model(load_preset("tiny_moe", {"n_layers": 2, "moe.expert_hidden": 32}), "meta")
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {
        g["name"]: {names[id(p)] for p in g["params"]}
        for g in muon_param_groups(OptimConfig(), model)
    }
    assert "layers.1.ffn.experts.w_gate" in groups["muon"]
    assert (
        "layers.0.attn.q_proj.weight" in groups["muon"]
        and "layers.0.ffn.down_proj.weight" in groups["muon"]
    )
    assert {"embed.weight", "layers.1.ffn.router.gate.weight"} <= groups["adamw_matrices"]
    assert "layers.0.attn_norm.weight" in groups["adamw_vectors"]
    excluded = muon_param_groups(OptimConfig(muon_exclude=["layers.0.*"]), model)
    muon = {names[id(p)] for g in excluded if g["name"] == "muon" for p in g["params"]}
    assert (
        not any(n.startswith("layers.0.") for n in muon) and "layers.1.attn.q_proj.weight" in muon
    )


def test_muon_trains_the_tiny_model() -> None:
    cfg = load_preset(
        "tiny", {"d_model": 64, "n_layers": 2, "vocab_size": 128, "loss_chunk_tokens": 64}
    )
    model = build_model(cfg, seed=0)
    opt = build_optimizer(OptimConfig(name="muon", lr=1e-2), model)
    tokens = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(10):
        opt.zero_grad()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_muon_momentum_warmup_ramps_linearly() -> None:
    from optim.schedules import muon_momentum

    cfg = OptimConfig(name="muon", muon_momentum_warmup=10, muon_momentum_start=0.85)
    values = [muon_momentum(cfg, step) for step in (0, 5, 10, 50)]
    assert values == pytest.approx([0.85, 0.90, 0.95, 0.95])
    assert muon_momentum(OptimConfig(), 0) == 0.95  # off by default


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_a_resumed_optimizer_takes_the_hyperparameters_of_the_config(name: str) -> None:
    from optim.builder import apply_config

    cfg = load_preset("tiny", {"d_model": 64, "n_layers": 1, "vocab_size": 64})
    model = build_model(cfg, seed=0)
    old = build_optimizer(OptimConfig(name=name, lr=1e-2, weight_decay=0.1), model)
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)).backward()
    old.step()
    new_cfg = OptimConfig(name=name, lr=1e-3, weight_decay=0.05, muon_momentum=0.9)
    new = build_optimizer(new_cfg, model)
    new.load_state_dict(old.state_dict())  # brings back lr 1e-2 and weight decay 0.1
    apply_config(new, new_cfg)
    for group in new.param_groups:
        assert group["base_lr"] == 1e-3
        assert group["weight_decay"] in (0.05, 0.0)
        if group.get("algorithm") == "muon":
            assert group["momentum"] == 0.9
