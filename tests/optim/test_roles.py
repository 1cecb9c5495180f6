"""Parameter roles, not tensor ranks, decide the optimizer and weight decay of every parameter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from model import roles
from model.presets import load_preset, preset_names
from model.roles import param_roles
from model.transformer import build_model
from optim import roles as optim_roles
from optim.builder import build_optimizer
from optim.config import OptimConfig
from optim.roles import RoleSettings
from optim.schedules import Schedule


class ConvAndMixing(nn.Module):
    """A layer of the kinds the 2026 features bring: a depthwise short conv (C, 1, 4), an n x n
    mixing matrix (mHC-like), and an ordinary projection."""

    def __init__(self, width: int = 8, streams: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv1d(width, width, kernel_size=4, groups=width, bias=False)
        self.mixing = nn.Parameter(torch.eye(streams))
        self.proj = nn.Linear(width, width)

    def param_roles(self) -> dict[str, str]:
        return {"mixing": roles.MIXING}


def groups_by_name(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, dict]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        g["name"]: {
            "params": {names[id(p)] for p in g["params"]},
            "weight_decay": g["weight_decay"],
        }
        for g in optimizer.param_groups
    }


def test_a_conv_kernel_and_a_mixing_matrix_go_to_adamw_without_weight_decay():
    model = ConvAndMixing()
    assert model.conv.weight.ndim == 3 and model.mixing.ndim == 2  # ranks that used to mislead
    assert param_roles(model) == {
        "mixing": "mixing",
        "conv.weight": "conv",
        "proj.weight": "matrix",
        "proj.bias": "bias",
    }
    muon = groups_by_name(build_optimizer(OptimConfig(name="muon", weight_decay=0.1), model), model)
    assert muon["muon"]["params"] == {"proj.weight"}
    assert muon["adamw_vectors"]["params"] == {"conv.weight", "mixing", "proj.bias"}
    assert muon["adamw_vectors"]["weight_decay"] == 0.0 and muon["muon"]["weight_decay"] == 0.1
    adamw = groups_by_name(build_optimizer(OptimConfig(weight_decay=0.1), model), model)
    assert adamw["vectors"] == {
        "params": {"conv.weight", "mixing", "proj.bias"},
        "weight_decay": 0.0,
    }
    assert adamw["matrices"] == {"params": {"proj.weight"}, "weight_decay": 0.1}


def test_a_parameter_without_a_role_is_refused_by_name():
    class Unknown(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.zeros(3, 4))

    with pytest.raises(ValueError, match=r"parameter table \(3, 4\) of Unknown has no role"):
        build_optimizer(OptimConfig(name="muon"), Unknown())


def test_a_role_with_the_wrong_shape_is_refused():
    class Mislabelled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(2, 3, 4))

        def param_roles(self) -> dict[str, str]:
            return {"w": roles.MATRIX}

    with pytest.raises(Exception, match=r"w is declared 'matrix' but has shape \(2, 3, 4\)"):
        build_optimizer(OptimConfig(name="muon"), Mislabelled())


def test_a_role_lr_multiplier_gets_its_own_group(monkeypatch):
    slow = RoleSettings(muon=False, weight_decay=False, lr_multiplier=5.0)
    monkeypatch.setitem(optim_roles.ROLE_SETTINGS, roles.MIXING, slow)
    model = ConvAndMixing()
    cfg = OptimConfig(name="muon", lr=0.02, adamw_lr=1e-3, warmup_steps=0, schedule="constant")
    optimizer = build_optimizer(cfg, model)
    group = next(g for g in optimizer.param_groups if g["name"] == "adamw_vectors_x5")
    assert group["base_lr"] == pytest.approx(5e-3) and group["weight_decay"] == 0.0
    Schedule(cfg, 10).apply(optimizer, 3)
    lrs = {g["name"]: g["lr"] for g in optimizer.param_groups}
    assert lrs == pytest.approx({"muon": 0.02, "adamw_vectors": 1e-3, "adamw_vectors_x5": 5e-3})


@pytest.mark.parametrize("preset", preset_names())
def test_every_parameter_of_every_preset_has_a_role(preset):
    model = build_model(load_preset(preset), device="meta")
    found = param_roles(model)
    assert set(found) == {n for n, _ in model.named_parameters()}
    assert found.get("embed.weight") == "embedding"
    assert all(role != "matrix" or "router" not in name for name, role in found.items())


def _rank_rule_groups(model: nn.Module, muon: bool) -> dict[str, set[str]]:
    """The grouping before roles: decay by ndim >= 2; Muon for matrices except these names."""
    from fnmatch import fnmatch

    adamw_matrices = ("embed.*", "head.*", "pos.*", "*.router.gate.weight")
    out: dict[str, set[str]] = {}
    for name, p in model.named_parameters():
        if not muon:
            key = "matrices" if p.ndim >= 2 else "vectors"
        elif p.ndim >= 2 and not any(fnmatch(name, pat) for pat in adamw_matrices):
            key = "muon"
        else:
            key = "adamw_matrices" if p.ndim >= 2 else "adamw_vectors"
        out.setdefault(key, set()).add(name)
    return out


ATTENTION_ONLY = [  # presets of the layer kinds and residual styles that existed before roles
    n
    for n in preset_names()
    if set(load_preset(n).mixer_kinds()) <= {"gqa", "mla"}
    and load_preset(n).residual in ("pre", "post", "deepnorm")
    and not load_preset(n).engram.enabled  # tables and per-stream norms: roles, tested apart
]


@pytest.mark.parametrize("preset", [*ATTENTION_ONLY, "learned_positions"])
@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_roles_group_every_preset_as_the_rank_rule_did(preset, name):
    """For the layers the rank rule knew, roles change nothing: the same groups and members
    (a Gated DeltaNet's 3-D conv kernel is exactly what the rank rule got wrong)."""
    cfg = load_preset("tiny", {"position": "learned"}) if preset == "learned_positions" else None
    model = build_model(cfg or load_preset(preset), device="meta")
    optimizer = build_optimizer(OptimConfig(name=name), model)
    got = {g: v["params"] for g, v in groups_by_name(optimizer, model).items()}
    assert got == _rank_rule_groups(model, muon=name == "muon")


def test_mhc_maps_are_mixing_weights_not_muon_matrices():
    """mHC's fn ((2 + n) n, n C) is 2-D: the rank rule made it a decayed (or Muon) matrix."""
    model = build_model(load_preset("tiny_mhc"), device="meta")
    groups = groups_by_name(build_optimizer(OptimConfig(name="muon"), model), model)
    fn = "layers.0.attn_residual.fn"
    assert fn not in groups["muon"]["params"]
    assert any(fn in g["params"] and g["weight_decay"] == 0 for g in groups.values())
