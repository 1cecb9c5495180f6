"""MTP modules in Hugging Face directories, DeepSeek-V3's layout (model.layers.{L + k}.enorm,
hnorm, eh_proj, shared_head.norm and the family's decoder-layer names), for a dense Llama model,
a Qwen3-Next MoE hybrid and a Kimi-Linear MLA MoE hybrid: transformers ignores them and gives the
main model's logits; our import reads them back bitwise, DeepSeek-V3's repeated embedding and
head copies included; Engram models are refused by name."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from model import ModelConfig, build_model
from model.config import ConfigError, EngramConfig, MTPConfig
from model.hf import load_hf, save_hf
from tests.model.hf_helpers import perturbed, token_batch, transformers_model
from tests.model.test_hf_hybrid import CASES, SEQ, VOCAB

transformers = pytest.importorskip("transformers")
FLA = importlib.util.find_spec("fla") is not None
LLAMA = ModelConfig(vocab_size=97, d_model=64, n_layers=2, tie_embeddings=False)
FAMILIES = {
    "llama": LLAMA,
    "qwen3_next_moe": CASES["qwen3_next_moe"][1],
    "kimi_linear_moe": CASES["kimi_linear_moe"][1],
}


def with_mtp(cfg: ModelConfig, depth: int = 2) -> ModelConfig:
    return dataclasses.replace(cfg, mtp=MTPConfig(depth=depth))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_mtp_layers_export_in_deepseek_v3_layout_and_come_back_bitwise(name, tmp_path):
    if FLA and name != "llama":
        pytest.skip("transformers dispatches hybrid layers to fla's Triton kernels")
    cfg = with_mtp(FAMILIES[name])
    model = perturbed(cfg)
    save_hf(model, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 2
    names = set(load_file(tmp_path / "hf" / "model.safetensors"))
    L = cfg.n_layers
    for k in range(2):
        for key in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
            assert f"model.layers.{L + k}.{key}" in names
        assert f"model.layers.{L + k}.input_layernorm.weight" in names  # the block, as a layer
    with torch.no_grad():  # transformers: the main model, the MTP layers ignored
        torch.testing.assert_close(
            model(token_batch(VOCAB, SEQ)),
            transformers_model(tmp_path / "hf")(token_batch(VOCAB, SEQ)).logits,
            atol=2e-5,
            rtol=0,
        )
    back = load_hf(tmp_path / "hf", rope_pairing=cfg.rope.pairing)
    assert back.cfg.mtp.depth == 2
    ours, theirs = model.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    for key, tensor in ours.items():
        assert torch.equal(theirs[key], tensor), key


def test_deepseek_v3s_repeated_embedding_and_head_are_accepted(tmp_path):
    model = perturbed(with_mtp(LLAMA, depth=1))
    save_hf(model, tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    state = load_file(path)
    state["model.layers.2.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    state["model.layers.2.shared_head.head.weight"] = state["lm_head.weight"].clone()
    save_file(state, path)
    back = load_hf(tmp_path / "hf")
    assert torch.equal(back.mtp.layers[0].eh_proj.weight, model.mtp.layers[0].eh_proj.weight)


def test_engram_models_are_refused_by_name(tmp_path):
    cfg = dataclasses.replace(
        LLAMA, engram=EngramConfig(layers=[0], heads=2, dim=16, table_sizes=[11, 13])
    )
    with pytest.raises(ConfigError, match=r"model.engram.layers=\[0\]"):
        save_hf(build_model(cfg, seed=0), tmp_path / "hf")
