"""Tensor parallelism over a `tp` mesh, with DTensor's styles (torch.distributed.tensor.parallel).

Each layer kind declares its own plan where it lives: a module with
`tensor_parallel_plan(tp) -> {child module or parameter: style}`, a style being a name in STYLES
or (name, *plain arguments) (softmax attention and MLA: their heads, model/mixers/attention.py
and mla.py; Gated DeltaNet and KDA: their heads, gdn.py and kda.py; dense FFNs and MoE shared
experts: their hidden units, model/ffn.py; model/ never imports torch.distributed, so the plans
name the styles this file maps to DTensor's). This file applies the plans, with no branch on
kinds, telling each planned module the degree it was split by (`tensor_parallel_degree`: the
mixers size their generation states by the heads a rank holds) and its rank in the split
(`tensor_parallel_rank`: where its heads' max logits go for QK-clip), and splits the model's own
parts:

- the embedding over the vocabulary (RowwiseParallel: each rank looks up the ids it holds, an
  all-reduce sums them), and an untied head's weight the same way;
- the head's uses swapped for vocab-parallel ones (parallel/vocab_parallel.py): the chunked
  cross-entropy and the scoring log-probabilities never gather the logits; sampling's logits are
  gathered (one position per sequence).

Between the layers the activations are whole on every rank of the tp group, or split along the
sequence with parallel/sequence_parallel.py. The styles beyond DTensor's live in
parallel/tensor_parallel_styles.py. A module whose kind declares no plan yet runs replicated: every rank holds its
whole weights and computes the same output from the same input, which is exact but saves nothing;
`apply_tensor_parallel` returns their names so the caller can say so.

Shapes: a plan's column-wise projection (C -> H) holds (H / tp, C) per rank and outputs the
rank's H / tp features; a row-wise one (H -> C) holds (C, H / tp) and all-reduces its output.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from model.transformer import Transformer
from parallel.float8 import float8_tp_style
from parallel.tensor_parallel_styles import PARAMETER_STYLES, STYLES
from parallel.vocab_parallel import (
    vocab_parallel_cross_entropy,
    vocab_parallel_target_log_probs,
    vocab_shard,
)


def split_over_tp(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool) -> list[str]:
    """Everything tensor parallelism does to `model` (on the meta device, before checkpointing,
    compile and FSDP2): the layers' plans, (sequence_parallel) the stream split along the
    sequence, the MoE layers' routed work shared by positions; returns the weight-holding modules
    left whole (`apply_tensor_parallel`)."""
    from parallel.routed_work import share_routed_work
    from parallel.sequence_parallel import apply_sequence_parallel

    replicated = apply_tensor_parallel(model, tp_mesh)
    if sequence_parallel:
        apply_sequence_parallel(model, tp_mesh)
    share_routed_work(model, tp_mesh, sequence_parallel)
    return replicated


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh) -> list[str]:
    """Split `model` over `tp_mesh` in place (before FSDP2, which then shards over the data
    ranks); returns the names of the weight-holding modules left replicated (no plan yet)."""
    tp = tp_mesh.size()
    planned: set[str] = set()
    for name, module in list(model.named_modules()):
        plan_of = getattr(module, "tensor_parallel_plan", None)
        if plan_of is None or any(name.startswith(f"{p}.") for p in planned):
            continue
        _apply_plan(module, plan_of(tp), tp_mesh)
        module.tensor_parallel_degree = tp  # what generation states size themselves by
        module.tensor_parallel_rank = tp_mesh.get_local_rank()  # which heads (QK-clip's logits)
        planned.add(name)
    top = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
    if model.head is not None:
        top["head"] = ColwiseParallel()  # its weight only: the forward never calls the module
    parallelize_module(model, tp_mesh, top)
    _swap_head_functions(model, tp_mesh)
    return _replicated_modules(model, planned)


def _apply_plan(module: nn.Module, plan: dict[str, object], tp_mesh: DeviceMesh) -> None:
    """A module's plan: {child module or parameter: style name or (name, *arguments)}."""
    parameters = {name for name, _ in module.named_parameters()}
    for target, entry in plan.items():
        name, *args = (entry,) if isinstance(entry, str) else entry
        if target in parameters:
            if STYLES[name] not in PARAMETER_STYLES:
                raise ValueError(f"the plan gives parameter {target!r} a module style {name!r}")
            parallelize_module(module, tp_mesh, STYLES[name](*args, params=(target,)))
        else:  # a float8 linear takes the style's float8 version (parallel/float8.py)
            style = float8_tp_style(STYLES[name], module.get_submodule(target))
            parallelize_module(module, tp_mesh, {target: style(*args)})


def _swap_head_functions(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """The loss, the scoring log-probabilities and the logits from each rank's vocabulary rows."""
    group, rank, tp = tp_mesh.get_group(), tp_mesh.get_local_rank(), tp_mesh.size()
    start = vocab_shard(model.cfg.vocab_size, rank, tp)[0]  # DTensor's Shard(0) rows

    def local_rows(w: Tensor) -> tuple[Tensor, int]:
        local = w.to_local() if isinstance(w, DTensor) else w  # (~V / tp, C), grads flow back
        return local, start

    def loss(h: Tensor, w: Tensor, targets: Tensor, chunk_tokens: int) -> Tensor:
        local, start = local_rows(w)
        return vocab_parallel_cross_entropy(h, local, targets, chunk_tokens, start, group)

    def log_probs(h: Tensor, w: Tensor, targets: Tensor, chunk_tokens: int) -> Tensor:
        local, start = local_rows(w)
        return vocab_parallel_target_log_probs(h, local, targets, chunk_tokens, start, group)

    def logits(h: Tensor, w: Tensor) -> Tensor:
        local, _ = local_rows(w)
        part = F.linear(h, local)  # (..., ~V / tp): shards may differ by a row (uneven V)
        shape = (*part.shape[:-1], model.cfg.vocab_size)
        whole = DTensor.from_local(
            part, tp_mesh, [Shard(part.dim() - 1)], shape=shape, stride=_contiguous(shape)
        )
        return whole.full_tensor()

    model.loss_fn, model.log_probs_fn, model.logits_fn = loss, log_probs, logits


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _replicated_modules(model: nn.Module, planned: set[str]) -> list[str]:
    """Modules holding weights of their own that no plan split (norms aside: replicated by
    design, they are small and act on whole activations)."""
    names = []
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if not isinstance(p, DTensor)]
        inside_plan = any(name == p or name.startswith(f"{p}.") for p in planned)
        if own and not inside_plan and not _is_norm(module):
            names.append(name)
    return names


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def tp_mesh_of(world: int, tp: int, device_type: str) -> DeviceMesh:
    """A (dp, tp) mesh's tp dimension: consecutive ranks form a tp group (they share a node)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    return mesh["tp"]
