"""Mixture of experts: router, grouped experts, the MoE FFN layer and the trainer's balance hooks.

from model.moe import MoE, MoEBalance (the training hook), moe_stats, ...
"""

from model.moe.balance import (
    MoEBalance,
    apply_bias_update,
    expert_load,
    moe_balance_hook,
    moe_layers,
    moe_stats,
    pop_aux_loss,
    reset_moe_stats,
)
from model.moe.experts import GroupedExperts, grouped_mm_supported
from model.moe.layer import MoE, local_dispatch
from model.moe.losses import router_z_loss, sequence_balance_loss, switch_balance_loss
from model.moe.router import Router, Routing

__all__ = [
    "GroupedExperts",
    "MoE",
    "MoEBalance",
    "Router",
    "Routing",
    "apply_bias_update",
    "expert_load",
    "grouped_mm_supported",
    "local_dispatch",
    "moe_balance_hook",
    "moe_layers",
    "moe_stats",
    "pop_aux_loss",
    "reset_moe_stats",
    "router_z_loss",
    "sequence_balance_loss",
    "switch_balance_loss",
]
