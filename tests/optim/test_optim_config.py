"""OptimConfig's rules (issue 52, bug 9): every numeric field must be finite and in its range, and
a refusal is one line naming the field, the value and the rule."""

from __future__ import annotations

import dataclasses
import math

import pytest

from optim.bounds import Bounds, broken_rule
from optim.config import NUMBER_RULES, OptimConfig
from optim.errors import OptimConfigError

INF, NAN = math.inf, math.nan
BAD_NUMBERS = [
    ("lr", NAN, "must be finite and > 0"),
    ("lr", INF, "must be finite and > 0"),
    ("lr", 0.0, "must be > 0"),
    ("weight_decay", INF, "must be finite and >= 0"),
    ("weight_decay", NAN, "must be finite and >= 0"),
    ("weight_decay", -0.1, "must be >= 0"),
    ("weight_decay", 1000.0, "lr x weight_decay < 1"),
    ("beta1", 1.0, "must be in [0, 1)"),
    ("beta1", -0.1, "must be in [0, 1)"),
    ("beta2", NAN, "must be finite and in [0, 1)"),
    ("eps", 0.0, "must be > 0"),
    ("eps", -1e-8, "must be > 0"),
    ("eps", INF, "must be finite and > 0"),
    ("min_lr_ratio", 1.5, "must be in [0, 1]"),
    ("min_lr_ratio", NAN, "must be finite and in [0, 1]"),
    ("decay_fraction", 0.0, "must be in (0, 1]"),
    ("decay_fraction", INF, "must be finite and in (0, 1]"),
    ("warmup_steps", -1, "must be >= 0"),
    ("muon_momentum", 1.0, "must be in [0, 1)"),
    ("muon_momentum", NAN, "must be finite and in [0, 1)"),
    ("muon_momentum_start", -INF, "must be finite and in [0, 1)"),
    ("muon_momentum_warmup", -5, "must be >= 0"),
    ("ns_steps", 0, "must be in [1, 20]"),
    ("ns_steps", 21, "must be in [1, 20]"),
    ("adamw_lr", -1e-3, "must be >= 0 (0 = optim.lr)"),
    ("adamw_lr", INF, "must be finite and >= 0"),
    ("qk_clip_tau", INF, "must be finite and >= 0 (0 = off)"),
    ("qk_clip_tau", -1.0, "must be >= 0 (0 = off)"),
    ("memory_lr_multiplier", 0.0, "must be > 0"),
    ("memory_lr_multiplier", NAN, "must be finite and > 0"),
]


@pytest.mark.parametrize(("key", "value", "rule"), BAD_NUMBERS)
def test_a_bad_optimizer_number_is_refused_naming_the_field(key, value, rule):
    with pytest.raises(OptimConfigError) as refused:
        OptimConfig(**{key: value})
    message = str(refused.value)
    assert message.startswith(f"optim.{key}={value}"), message
    assert rule in message and "\n" not in message


def test_every_numeric_field_has_a_rule():
    numeric = {
        f.name for f in dataclasses.fields(OptimConfig) if f.type in ("int", "float", int, float)
    }
    assert numeric == set(NUMBER_RULES)


def test_the_defaults_and_the_edges_of_the_ranges_are_accepted():
    OptimConfig()
    OptimConfig(beta1=0.0, weight_decay=0.0, min_lr_ratio=1.0, decay_fraction=1.0, ns_steps=20)
    OptimConfig(name="muonclip", qk_clip_tau=100.0, adamw_lr=1e-3, muon_momentum=0.0)


def test_bounds_describe_their_rule():
    assert Bounds(1, low_open=True, or_zero=True, note="0 = off").describe() == "0 or > 1 (0 = off)"
    assert not Bounds(0).holds(math.inf) and Bounds(1, or_zero=True).holds(0)
    assert broken_rule("x", OptimConfig(), NUMBER_RULES) is None
