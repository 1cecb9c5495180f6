"""Streamed conversion (a sharded import, an export from a sharded checkpoint) converts the
weights part by part: the embedding, final norm and head, then one layer at a time (MTP module k
as layer n_layers + k). For every family's test cases it must give exactly what the whole-model
conversion gives, in both directions."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from model.config import ModelConfig, MTPConfig
from model.hf import (
    GLOBALS,
    HFWeights,
    from_hf_parts,
    from_hf_state_dict,
    our_part,
    read_hf_state_dict,
    save_hf,
    to_hf_parts,
    to_hf_state_dict,
)
from model.hf.expert_stack import ExpertStack, materialize
from model.hf.family import family_for_hf, hf_part
from tests.model import test_hf, test_hf_deepseek_v3, test_hf_hybrid, test_hf_moe
from tests.model.hf_helpers import Unreadable, perturbed


def _cases() -> dict[str, ModelConfig]:
    cases = {f"llama/{n}": c for n, c in test_hf.CASES.items()}
    cases |= {f"deepseek_v3/{n}": c for n, c in test_hf_deepseek_v3.CASES.items()}
    for module in (test_hf_moe, test_hf_hybrid):
        cases |= {
            f"{module.__name__.rsplit('_', 1)[-1]}/{n}": c for n, (_, c) in module.CASES.items()
        }
    mtp = MTPConfig(depth=2)
    cases["llama/mtp"] = dataclasses.replace(test_hf.CASES["gqa_untied"], mtp=mtp)
    cases["hybrid/kimi_mtp"] = dataclasses.replace(
        test_hf_hybrid.CASES["kimi_linear_moe"][1], mtp=mtp
    )
    return cases


CASES = _cases()


def _by_part(state: dict[str, torch.Tensor], n_layers: int) -> list[tuple[int, dict]]:
    parts: dict[int, dict] = {}
    for name, tensor in state.items():
        parts.setdefault(our_part(name, n_layers), {})[name] = tensor
    return sorted(parts.items(), key=lambda item: item[0])


def _assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.mark.parametrize("name", list(CASES))
def test_part_by_part_conversion_equals_the_whole(name, tmp_path):
    cfg = CASES[name]
    model = perturbed(cfg)
    whole = to_hf_state_dict(model)
    streamed: dict[str, torch.Tensor] = {}
    parts = _by_part(dict(model.state_dict()), cfg.n_layers)
    assert [p for p, _ in parts] == [GLOBALS, *range(cfg.n_layers + cfg.mtp.depth)]
    for converted in to_hf_parts(parts, cfg):
        assert not streamed.keys() & converted.keys()
        streamed |= converted
    _assert_same(streamed, whole)

    save_hf(model, tmp_path / "hf")
    weights = HFWeights(tmp_path / "hf")
    family = family_for_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
    read_whole = from_hf_state_dict(read_hf_state_dict(tmp_path / "hf"), cfg, family)
    read_parts: dict[str, torch.Tensor] = {}
    for converted in from_hf_parts(weights, cfg, family):
        read_parts |= {n: materialize(t).clone() for n, t in converted.items()}
    _assert_same(read_parts, read_whole)


def test_parts_are_the_decoder_layers_and_the_rest():
    assert hf_part("model.layers.12.mlp.experts.3.up_proj.weight") == 12
    assert hf_part("model.language_model.layers.2.linear_attn.A_log") == 2
    assert hf_part("model.embed_tokens.weight") == GLOBALS
    assert hf_part("mtp.layers.0.fc.weight") == GLOBALS  # Qwen3-Next's MTP head: dropped
    assert our_part("layers.3.attn.q_proj.weight", 4) == 3
    assert our_part("mtp.layers.1.block.ffn.w_up", 4) == 5
    assert our_part("head.weight", 4) == GLOBALS


def test_a_part_with_a_foreign_tensor_is_refused_by_name(tmp_path):
    from safetensors.torch import save_file

    from model.errors import ConfigError

    cfg = CASES["hybrid/kimi_linear_moe"]
    save_hf(perturbed(cfg), tmp_path / "hf")
    state = read_hf_state_dict(tmp_path / "hf")
    state["model.layers.1.self_attn.made_up.weight"] = torch.zeros(2)
    save_file({n: t.contiguous() for n, t in state.items()}, tmp_path / "hf" / "model.safetensors")
    family = family_for_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
    with pytest.raises(ConfigError, match="made_up"):
        for _ in from_hf_parts(HFWeights(tmp_path / "hf"), cfg, family):
            pass


def test_a_checkpoint_missing_a_layer_is_refused_by_name(tmp_path):
    from safetensors.torch import save_file

    from model.errors import ConfigError

    cfg = CASES["llama/gqa_untied"]
    save_hf(perturbed(cfg), tmp_path / "hf")
    last = f"model.layers.{cfg.n_layers - 1}."
    state = {n: t for n, t in read_hf_state_dict(tmp_path / "hf").items() if not n.startswith(last)}
    save_file(state, tmp_path / "hf" / "model.safetensors")
    family = family_for_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
    with pytest.raises(ConfigError, match=f"no tensor of layer {cfg.n_layers - 1} "):
        next(from_hf_parts(HFWeights(tmp_path / "hf"), cfg, family))


@pytest.mark.parametrize(
    "index",
    [
        (slice(None),),
        (slice(2, 5),),
        (slice(1, 3), slice(4, 9)),
        (slice(0, 6), slice(None), slice(3, 7)),
        (slice(6, 6),),  # no expert here (more shards than experts)
    ],
)
def test_an_expert_stack_reads_the_experts_asked_for(index):
    """Our (E, in, out) stack over per-expert (out, in) matrices: any cut equals the cut of the
    stacked tensor, and only the experts in it are touched."""
    matrices = [torch.randn(12, 10) for _ in range(6)]
    stacked = torch.stack([m.T for m in matrices])
    stack = ExpertStack(matrices)
    assert stack.shape == stacked.shape and stack.dtype == stacked.dtype
    assert torch.equal(stack[index], stacked[index])
    assert torch.equal(stack.materialize(), stacked)
    chosen = range(6)[index[0]]
    untouchable = [m if j in chosen else Unreadable(m) for j, m in enumerate(matrices)]
    assert torch.equal(ExpertStack(untouchable)[index], stacked[index])
