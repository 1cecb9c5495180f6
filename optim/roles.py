"""The optimizer settings of each parameter role (model/roles.py): which algorithm updates it,
whether it takes weight decay, and its learning-rate multiplier.

Under Muon, `muon=True` roles are orthogonalized (unless optim.muon_exclude names them; they then
join AdamW's decayed group); every other role is updated by AdamW. Under AdamW alone only
`weight_decay` matters. `rows=True` roles (Engram's tables) are updated by row-wise Adam under
either optimizer (optim/row_adam.py), at `optim.memory_lr_multiplier` x AdamW's learning rate.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from model import roles as R


@dataclass(frozen=True)
class RoleSettings:
    muon: bool  # orthogonalized by Muon (optim=muon/muonclip)
    weight_decay: bool  # takes optim.weight_decay (decoupled)
    lr_multiplier: float = 1.0  # x the group's peak lr
    rows: bool = False  # updated row-wise (lazy Adam on the rows a step read), never decayed


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
    # Megatron-LM's Engram constants: Adam, lr x 5 (optim.memory_lr_multiplier), no decay
    R.MEMORY: RoleSettings(muon=False, weight_decay=False, lr_multiplier=5.0, rows=True),
}
assert set(ROLE_SETTINGS) == set(R.ROLES), "every role needs its optimizer settings"


def role_settings(role: str, memory_lr_multiplier: float) -> RoleSettings:
    """The role's settings, with the configured multiplier for row-wise (memory) roles."""
    settings = ROLE_SETTINGS[role]
    if settings.rows:
        return replace(settings, lr_multiplier=memory_lr_multiplier)
    return settings
