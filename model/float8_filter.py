"""Which matmuls may run in float8 (`trainer.precision=float8`), decided by the modules that own
them; parallel/float8.py converts the ones that qualify with torchao.

A linear map qualifies when its weight's role is `matrix` (model/roles.py: the output head is an
embedding-like table, a router's gate picks experts: both stay in bf16, as in DeepSeek-V3's FP8
recipe), its owner does not exclude it, and both its dims are multiples of the recipe's block
(16 for float8's kernels, 32 for MXFP8's scale blocks). Owners exclude with
`float8_exclusions() -> {child name: reason}`: a recurrent mixer's decay and write-strength gates,
whose error compounds over the recurrence. Routed experts (`GroupedExperts`) qualify when their
C and F are multiples of the block; their grouped GEMMs run through the scaled grouped GEMM the
converter installs.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from model import roles
from model.moe.experts import GroupedExperts

LINEAR, EXPERTS = "linear", "experts"
_ROLE_REASONS = {
    roles.EMBEDDING: "output head (embedding-like table)",
    roles.ROUTER: "router (its scores pick the experts)",
}


@dataclass(frozen=True)
class Float8Candidate:
    """One matmul-owning module and whether it may run in float8."""

    name: str  # module name in the model (Transformer's names)
    kind: str  # LINEAR | EXPERTS
    shape: tuple[int, ...]  # a linear's weight (out, in); experts' w_gate (E, C, F)
    reason: str = ""  # "" when it qualifies, else why it stays in the compute dtype

    @property
    def qualifies(self) -> bool:
        return not self.reason


def _exclusions(model: nn.Module) -> dict[str, str]:
    """Full module name -> reason, from each owner's `float8_exclusions()`."""
    excluded: dict[str, str] = {}
    for prefix, module in model.named_modules():
        hook = getattr(module, "float8_exclusions", None)
        if callable(hook):
            for local, reason in hook().items():
                excluded[f"{prefix}.{local}" if prefix else local] = reason
    return excluded


def _dims_reason(dims: tuple[int, ...], multiple: int, split: int) -> str:
    if all(d % (multiple * split) == 0 for d in dims):
        return ""
    times = f" x tp {split}" if split > 1 else ""
    return f"dims {' x '.join(map(str, dims))} not multiples of {multiple}{times}"


def float8_candidates(
    model: nn.Module, multiple: int = 16, split: int = 1
) -> list[Float8Candidate]:
    """Every linear map and routed-expert stack of `model`, in module order, with the reason it
    stays in the compute dtype ("" when it may run in float8). `multiple`: the recipe's block;
    `split`: the tensor-parallel degree (a rank's GEMM holds 1 / split of one dim, which one
    depends on the layer's plan, so both must split into blocks)."""
    param_roles = roles.param_roles(model)
    excluded = _exclusions(model)
    found = []
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            E, C, F = module.w_gate.shape
            reason = _dims_reason((C, F), multiple, 1)  # (experts split by expert, not by dims)
            found.append(Float8Candidate(name, EXPERTS, (E, C, F), reason))
        elif isinstance(module, nn.Linear):
            shape = tuple(module.weight.shape)
            role = param_roles[f"{name}.weight"]
            if role != roles.MATRIX:
                reason = _ROLE_REASONS.get(role, f"role {role}")
            else:
                reason = excluded.get(name) or _dims_reason(shape, multiple, split)
            found.append(Float8Candidate(name, LINEAR, shape, reason))
    return found
