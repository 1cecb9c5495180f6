"""The optimizer settings of each parameter role (model/roles.py): which algorithm updates it,
whether it takes weight decay, and its learning-rate multiplier.

Under Muon, `muon=True` roles are orthogonalized (unless optim.muon_exclude names them; they then
join AdamW's decayed group); every other role is updated by AdamW. Under AdamW alone only
`weight_decay` matters.
"""

from __future__ import annotations

from dataclasses import dataclass

from model import roles as R


@dataclass(frozen=True)
class RoleSettings:
    muon: bool  # orthogonalized by Muon (optim=muon/muonclip)
    weight_decay: bool  # takes optim.weight_decay (decoupled)
    lr_multiplier: float = 1.0  # x the group's peak lr


ROLE_SETTINGS: dict[str, RoleSettings] = {
    R.MATRIX: RoleSettings(muon=True, weight_decay=True),
    R.EXPERT_STACK: RoleSettings(muon=True, weight_decay=True),
    R.EMBEDDING: RoleSettings(muon=False, weight_decay=True),
    R.ROUTER: RoleSettings(muon=False, weight_decay=True),
    R.GAIN: RoleSettings(muon=False, weight_decay=False),
    R.BIAS: RoleSettings(muon=False, weight_decay=False),
    R.CONV: RoleSettings(muon=False, weight_decay=False),
    R.MIXING: RoleSettings(muon=False, weight_decay=False),
    R.DECAY: RoleSettings(muon=False, weight_decay=False),
}
assert set(ROLE_SETTINGS) == set(R.ROLES), "every role needs its optimizer settings"
