"""optim.muon_split: fused projections and attention heads orthogonalized as separate matrices.
References: each block sliced out and orthogonalized alone; a Muon step on a real model's
attention against that formula."""

from __future__ import annotations

import pytest
import torch

from model.presets import load_preset
from model.transformer import build_model
from optim.builder import build_optimizer
from optim.config import OptimConfig
from optim.errors import OptimConfigError
from optim.matrix_blocks import MatrixBlocks, matrix_blocks, orthogonalize_blocks, update_scale
from optim.newton_schulz import coefficient_schedule, orthogonalize

COEFFICIENTS = coefficient_schedule("quintic", 5)


def _names(preset: str, mode: str) -> set[str]:
    model = build_model(load_preset(preset, {"n_layers": 1}), "meta")
    return set(matrix_blocks(model, mode))


def test_hooks_name_the_fused_and_the_per_head_weights() -> None:
    assert _names("tiny_mla", "fused") == {
        "layers.0.attn.kv_a_proj.weight",
        "layers.0.attn.kv_b_proj.weight",
    }
    assert _names("tiny_mla", "heads") == {
        f"layers.0.attn.{n}.weight" for n in ("q_b_proj", "kv_a_proj", "kv_b_proj", "o_proj")
    }
    assert _names("tiny", "fused") == set()  # separate q/k/v: nothing fused
    assert _names("tiny", "heads") == {
        f"layers.0.attn.{n}_proj.weight" for n in ("q", "k", "v", "o")
    }
    assert _names("tiny_mla", "none") == set()
    with pytest.raises(OptimConfigError, match="muon_split='rows' is not one of"):
        OptimConfig(muon_split="rows")


def _rows(matrix: torch.Tensor, heads: int, parts: tuple[int, ...], head: int, part: int):
    start = head * sum(parts) + sum(parts[:part])
    return slice(start, start + parts[part])


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("per_head", [True, False])
def test_each_block_is_orthogonalized_alone(dim: int, per_head: bool) -> None:
    heads, parts = 3, (8, 4)
    g = torch.randn(heads * 12, 20, generator=torch.Generator().manual_seed(0))
    g = g if dim == 0 else g.T.contiguous()  # dim 1: the blocks are groups of columns
    blocks = MatrixBlocks(dim, heads, parts, per_head)
    out = orthogonalize_blocks(g, COEFFICIENTS, blocks, "spectral")
    x, y = (g, out) if dim == 0 else (g.T, out.T)
    whole = update_scale(*g.shape, "spectral")
    for part in range(len(parts)):
        spans = [_rows(x, heads, parts, h, part) for h in range(heads)]
        groups = [[s] for s in spans] if per_head else [spans]
        for group in groups:
            block = torch.cat([x[s] for s in group])
            shape = tuple(block.shape) if dim == 0 else tuple(block.T.shape)
            ratio = update_scale(*shape, "spectral") / whole
            expected = orthogonalize(block if dim == 0 else block.T, COEFFICIENTS)
            expected = (expected if ratio == 1.0 else expected * ratio).float()
            got = torch.cat([y[s] for s in group]).float()
            # bitwise where Newton-Schulz iterates in bf16; in fp32 (CPUs without bf16) the
            # batched and the single GEMMs may round apart: 2 bf16 ulps of a 5e-5 entry seen
            # (a block given the wrong rows would be off by ~0.1)
            torch.testing.assert_close(
                got, expected if dim == 0 else expected.T, rtol=2**-7, atol=1e-5
            )


def test_split_blocks_keep_the_update_rms_of_the_scaling_rule() -> None:
    # (256, 16) in 4 heads of 64 rows: a head block (64, 16) has match_adamw scale 0.2 x 8,
    # half the whole matrix's 0.2 x 16; after the caller's whole scale its RMS is still ~0.2
    g = torch.randn(256, 16, generator=torch.Generator().manual_seed(1))
    out = orthogonalize_blocks(g, COEFFICIENTS, MatrixBlocks(0, 4, (64,), True), "match_adamw")
    scaled = out.float() * update_scale(256, 16, "match_adamw")
    for head in scaled.split(64):
        rms = head.square().mean().sqrt().item()
        assert 0.2 * 0.68 < rms < 0.2 * 1.13  # the quintic's singular value band, times 0.2


def test_a_muon_step_with_head_split_orthogonalizes_each_head() -> None:
    cfg = load_preset(
        "tiny_mla", {"n_layers": 1, "vocab_size": 128, "d_model": 64, "loss_chunk_tokens": 64}
    )
    model = build_model(cfg, seed=0)
    lr, mu = 1e-2, 0.95
    opt = build_optimizer(
        OptimConfig(name="muon", lr=lr, weight_decay=0.0, muon_split="heads"), model
    )
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    attn = model.layers["0"].attn
    weight = attn.kv_b_proj.weight  # (H * (nope + v), kv_rank): heads x [k_nope | v]
    before, grad = weight.detach().clone(), weight.grad.clone()
    opt.step()
    update = grad.lerp(torch.zeros_like(grad).lerp(grad, 1 - mu), mu)  # Nesterov, first step
    whole = update_scale(*weight.shape, "match_adamw")
    parts = (attn.nope_dim, attn.v_dim)
    for head in range(attn.n_heads):
        for part in range(2):
            rows = _rows(update, attn.n_heads, parts, head, part)
            block = update[rows]
            ratio = update_scale(*block.shape, "match_adamw") / whole
            ortho = orthogonalize(block, COEFFICIENTS)
            expected = (ortho if ratio == 1.0 else ortho * ratio).float() * (-lr * whole)
            torch.testing.assert_close(weight.detach()[rows] - before[rows], expected)
