"""Parameter roles: what each parameter is, declared by the module that owns it.

Optimizers and weight decay read the roles (optim/roles.py maps each role to its settings), never
the tensor's rank: a depthwise conv kernel (C, 1, 4) is not an expert stack, and a small mixing
matrix is not a Muon matrix.

A module declares roles with `param_roles() -> {name relative to the module: role}`, also for
parameters of its children (the outermost declaration wins: the model names its output head an
embedding-like table although it is an nn.Linear). Every other parameter takes its owning
module's default (below); a parameter with neither is an error, so a new layer cannot slip a
parameter past the optimizer's rules.
"""

from __future__ import annotations

from torch import nn

MATRIX = "matrix"  # a linear map's (out, in) weight (Muon's matrices; blocks: muon_matrix_blocks)
EXPERT_STACK = "expert_stack"  # (E, in, out) routed-expert weights, one matrix per expert
EMBEDDING = "embedding"  # lookup tables and the output head (read by index, or tied to one)
ROUTER = "router"  # an MoE router's gate: a matrix, but one that must not be orthogonalized
GAIN = "gain"  # norm weights
BIAS = "bias"
CONV = "conv"  # short (depthwise) convolution kernels, e.g. (C, 1, K)
MIXING = "mixing"  # small mixing weights: residual-stream scales and maps, pseudo-queries, gates
DECAY = "decay"  # a recurrent mixer's decay parameters (Gated DeltaNet's A_log, dt_bias)
# Engram's hashed n-gram tables: read a few rows per token, updated row-wise (sparse gradients)
MEMORY = "memory"
ROLES = (MATRIX, EXPERT_STACK, EMBEDDING, ROUTER, GAIN, BIAS, CONV, MIXING, DECAY, MEMORY)

_DEFAULTS: dict[type, dict[str, str]] = {
    nn.Linear: {"weight": MATRIX, "bias": BIAS},
    nn.Embedding: {"weight": EMBEDDING},
    nn.Conv1d: {"weight": CONV, "bias": BIAS},
    nn.LayerNorm: {"weight": GAIN, "bias": BIAS},
    nn.RMSNorm: {"weight": GAIN},
}


def _defaults(module: nn.Module) -> dict[str, str]:
    for kind, roles in _DEFAULTS.items():
        if isinstance(module, kind):
            return roles
    return {}


def param_roles(model: nn.Module) -> dict[str, str]:
    """Full parameter name -> role, for every parameter of `model` (ValueError if one has none)."""
    declared: dict[str, str] = {}
    for prefix, module in model.named_modules():
        hook = getattr(module, "param_roles", None)
        if hook is None or not callable(hook):
            continue
        for local, role in hook().items():
            declared.setdefault(f"{prefix}.{local}" if prefix else local, role)
    roles: dict[str, str] = {}
    for prefix, module in model.named_modules():
        defaults = _defaults(module)
        for local, param in module.named_parameters(recurse=False):
            name = f"{prefix}.{local}" if prefix else local
            role = declared.get(name) or defaults.get(local)
            if role is None:
                raise ValueError(
                    f"parameter {name} {tuple(param.shape)} of {type(module).__name__} has no role: "
                    f"declare it in {type(module).__name__}.param_roles() (one of {', '.join(ROLES)})"
                )
            if role not in ROLES:
                raise ValueError(
                    f"parameter {name}: unknown role {role!r}; one of {', '.join(ROLES)}"
                )
            roles[name] = role
    return roles


def role_owners(model: nn.Module, role: str) -> list[nn.Module]:
    """The modules that own (directly) a parameter of `role`, in module order: how code outside
    model/ finds, say, the `memory` tables (Engram's) without knowing their class."""
    roles = param_roles(model)
    owners = []
    for prefix, module in model.named_modules():
        names = (
            f"{prefix}.{local}" if prefix else local
            for local, _ in module.named_parameters(recurse=False)
        )
        if any(roles[name] == role for name in names):
            owners.append(module)
    return owners
