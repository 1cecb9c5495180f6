"""MLA against an independent implementation: transformers' DeepseekV3 with every layer dense.

Our parameter names map one-to-one onto DeepseekV3's; with the same weights the logits must agree
to 1e-5 in fp32, for both RoPE pairings, with and without the query low-rank path and with YaRN.
"""

from __future__ import annotations

import re

import pytest
import torch

from model import (
    AttentionConfig,
    FFNConfig,
    InitConfig,
    MLAConfig,
    ModelConfig,
    RopeConfig,
    Transformer,
)

transformers = pytest.importorskip("transformers")

OURS_TO_DEEPSEEK = [
    (r"embed\.", "model.embed_tokens."),
    (r"^norm\.", "model.norm."),
    (r"^head\.", "lm_head."),
    (r"^layers\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^layers\.(\d+)\.ffn_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^layers\.(\d+)\.ffn\.", r"model.layers.\1.mlp."),
    (r"^layers\.(\d+)\.attn\.q_a_norm\.", r"model.layers.\1.self_attn.q_a_layernorm."),
    (r"^layers\.(\d+)\.attn\.kv_a_norm\.", r"model.layers.\1.self_attn.kv_a_layernorm."),
    (r"^layers\.(\d+)\.attn\.kv_a_proj\.", r"model.layers.\1.self_attn.kv_a_proj_with_mqa."),
    (r"^layers\.(\d+)\.attn\.", r"model.layers.\1.self_attn."),
]


def _deepseek_name(name: str) -> str:
    for pattern, replacement in OURS_TO_DEEPSEEK:
        if re.search(pattern, name):
            return re.sub(pattern, replacement, name)
    raise KeyError(name)


@pytest.mark.parametrize("pairing", ["interleaved", "half"])
@pytest.mark.parametrize("q_lora_rank", [0, 24])
@pytest.mark.parametrize("yarn", [False, True])
def test_mla_logits_match_deepseek_v3(pairing, q_lora_rank, yarn):
    torch.manual_seed(0)
    rope = RopeConfig(theta=10000.0, pairing=pairing)
    if yarn:
        rope = RopeConfig(
            pairing=pairing,
            scaling="yarn",
            factor=4.0,
            original_max_seq_len=32,
            mscale=1.0,
            mscale_all_dim=1.0,
        )
    mla = MLAConfig(
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=12,
    )
    cfg = ModelConfig(
        vocab_size=61,
        d_model=48,
        n_layers=2,
        max_seq_len=128,
        norm_eps=1e-6,
        rope=rope,
        attention=AttentionConfig(kind="mla", n_heads=4, mla=mla),
        ffn=FFNConfig(hidden=80),
        init=InitConfig(std=0.1),
    )
    ours = Transformer(cfg).eval()
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:
        rope_parameters = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        }
    hf_cfg = transformers.DeepseekV3Config(
        vocab_size=61,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank or None,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=12,
        first_k_dense_replace=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_interleave=pairing == "interleaved",
        rope_parameters=rope_parameters,
        tie_word_embeddings=False,
        attention_bias=False,
    )
    hf_cfg._attn_implementation = "eager"
    theirs = transformers.DeepseekV3ForCausalLM(hf_cfg).eval()
    state = {_deepseek_name(k): v for k, v in ours.state_dict().items()}
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    tokens = torch.randint(0, 61, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, atol=1e-5, rtol=0)
