"""The numeric rules of config fields, as data: one `Bounds` per field, checked by `broken_rule`.

A value must be finite (nan and inf pass `>` and `<` tests in surprising ways: `inf >= 0`) and
inside its interval. Used by optim.config.OptimConfig and trainer.config.TrainerConfig; each
caller raises its own error type with the message.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Bounds:
    """The interval [low, high] (an end is excluded when its `*_open` is set); `or_zero` also
    allows 0 outside it; `note` says what a special value means ("0 = off")."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    or_zero: bool = False
    note: str = ""

    def holds(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.or_zero and value == 0:
            return True
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self) -> str:
        if self.high == math.inf:
            text = f"{'>' if self.low_open else '>='} {self.low:g}"
        else:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            text = f"in {left}{self.low:g}, {self.high:g}{right}"
        if self.or_zero:
            text = f"0 or {text}"
        return f"{text} ({self.note})" if self.note else text


POSITIVE = Bounds(0, low_open=True)
NON_NEGATIVE = Bounds(0)
AT_LEAST_ONE = Bounds(1)
UNIT = Bounds(0, 1)  # [0, 1]
BELOW_ONE = Bounds(0, 1, high_open=True)  # [0, 1): betas and momenta


def broken_rule(prefix: str, config: object, rules: Mapping[str, Bounds]) -> str | None:
    """The first field of `config` that breaks its rule, as one line naming the field, the value
    and the rule (`optim.weight_decay=inf must be finite and >= 0`); None when all hold."""
    for name, bounds in rules.items():
        value = getattr(config, name)
        if bounds.holds(value):
            continue
        finite = "" if math.isfinite(value) else "finite and "
        return f"{prefix}.{name}={value} must be {finite}{bounds.describe()}"
    return None
