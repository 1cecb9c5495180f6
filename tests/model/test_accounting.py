"""Accounting against published numbers, the standard KV formula and torch's FLOP counter."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from model import AttentionConfig, MLAConfig, ModelConfig, Transformer, build_model
from model.accounting import (
    average_context,
    kv_cache_size,
    param_counts,
    training_flops_per_token,
    training_memory,
)
from model.mixers.masks import build_mask
from model.presets import load_preset

# Published totals (model cards / config.json parameter sums): these must match exactly.
PUBLISHED_PARAMS = {
    "llama2_7b": 6_738_415_616,
    "llama2_70b": 68_976_648_192,
    "llama3_8b": 8_030_261_248,
    "llama3_70b": 70_553_706_496,
    "qwen3_0_6b": 596_049_920,
}


def _meta(name: str) -> Transformer:
    return build_model(load_preset(name), device="meta")


@pytest.mark.parametrize(("name", "expected"), list(PUBLISHED_PARAMS.items()))
def test_parameter_counts_equal_the_published_ones(name, expected):
    counts = param_counts(_meta(name))
    assert counts.total == expected
    assert counts.active == counts.total  # dense
    assert counts.embedding + counts.head + counts.blocks == counts.total


def test_llama3_8b_is_8_03b_within_0_1_percent():
    assert abs(param_counts(_meta("llama3_8b")).total / 8.03e9 - 1) < 1e-3


def kv_formula(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def test_kv_cache_follows_the_standard_formula_gqa_vs_mha():
    # Llama-2-7B is MHA (32 kv heads); Llama-2-70B and Llama-3-70B use GQA with 8 kv heads.
    assert (
        kv_cache_size(_meta("llama2_7b")).bytes_per_token
        == kv_formula(32, 32, 128, 2)
        == 512 * 1024
    )
    for name in ("llama2_70b", "llama3_70b"):
        kv = kv_cache_size(_meta(name))
        assert kv.bytes_per_token == kv_formula(80, 8, 128, 2) == 320 * 1024
        assert kv.mha_bytes_per_token == kv_formula(80, 64, 128, 2)
        assert kv.reduction == 8.0
    # The MHA variant of the same 70B shape stores 8x more.
    mha_70b = build_model(load_preset("llama3_70b", {"attention.n_kv_heads": 64}), device="meta")
    assert (
        kv_cache_size(mha_70b).bytes_per_token
        == 8 * kv_cache_size(_meta("llama3_70b")).bytes_per_token
    )
    assert kv_cache_size(_meta("llama3_8b"), "fp32").bytes_per_token == kv_formula(32, 8, 128, 4)


def test_mla_caches_only_the_latent_and_the_rope_key():
    kv = kv_cache_size(_meta("deepseek_v3"))
    assert kv.bytes_per_token == 61 * (512 + 64) * 2
    assert kv.mha_bytes_per_token == 61 * 128 * ((128 + 64) + 128) * 2
    assert kv.reduction == pytest.approx(71.1, abs=0.05)


@pytest.mark.parametrize("T", [1, 7, 64])
@pytest.mark.parametrize("window", [0, 1, 5, 100])
def test_average_context_counts_the_mask(T, window):
    mask, _ = build_mask(T, 0, window=window or 10**9)
    assert average_context(T, window) == pytest.approx(mask.sum().item() / T)


@pytest.mark.parametrize(
    "attention",
    [
        AttentionConfig(n_heads=4, n_kv_heads=2),
        AttentionConfig(
            kind="mla",
            n_heads=4,
            mla=MLAConfig(
                q_lora_rank=16,
                kv_lora_rank=32,
                qk_nope_head_dim=16,
                qk_rope_head_dim=8,
                v_head_dim=24,
            ),
        ),
    ],
    ids=["gqa", "mla"],
)
@pytest.mark.parametrize("tied", [False, True])
def test_training_flops_match_torch_flop_counter(attention, tied):
    """FlopCounterMode counts every matmul of forward + backward exactly; SDPA's math backend
    computes the full T x T score matrix, so its count is our causal attention term x T / ((T+1)/2)."""
    cfg = ModelConfig(
        vocab_size=128,
        d_model=64,
        n_layers=2,
        attention=attention,
        tie_embeddings=tied,
        loss_chunk_tokens=0,
    )
    model = Transformer(cfg)
    B, T = 2, 32
    tokens = torch.randint(0, 128, (B, T))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens).float().square().mean().backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    flops = training_flops_per_token(model, T)
    assert counts["aten.mm"] == flops.matmul * B * T
    assert counts["aten.bmm"] == pytest.approx(
        flops.attention * B * T * T / ((T + 1) / 2), rel=1e-12
    )


def test_training_memory_bytes_per_parameter():
    assert training_memory(10, "fp32").total == 16 * 10  # 4 weights + 4 grads + 8 Adam
    bf16 = training_memory(10, "bf16", shards=4)
    assert (bf16.weights, bf16.grads, bf16.master, bf16.optimizer) == (20, 20, 40, 80)
    assert bf16.per_device == bf16.total / 4
