"""Activation checkpointing per block, and `torch.compile` of every block plus the fused head +
loss (`compile_model`).

Both rewrite a block's `forward` / call in place rather than wrapping the module, so parameter
names (`layers.3.attn.q_proj.weight`) stay the same for checkpoints and export.

- full: keep only each block's input; recompute the block in backward.
- selective: also keep the outputs of matmuls and attention (the expensive ops); recompute the
  cheap elementwise ones (norms, activations, RoPE). Ops inside an autograd Function's forward
  run without grad mode and are recomputed: the matmul attention backend's logits GEMM
  (model.mixers.attention_backend.BiasedScores; its probabilities' GEMM with v is kept).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from model.loss import chunked_cross_entropy, loss_chunk_fusable
from model.transformer import Transformer

_aten = torch.ops.aten
# ops whose outputs selective checkpointing keeps (recomputing them is what costs)
SAVED_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}
for _name in ("_grouped_mm", "_scaled_dot_product_cudnn_attention"):
    if hasattr(_aten, _name):
        SAVED_OPS.add(getattr(_aten, _name).default)
# expert-parallel token exchange: recomputing it would repeat the all-to-all in backward
_c10d = torch.ops._c10d_functional
SAVED_OPS |= {_c10d.all_to_all_single.default, _c10d.wait_tensor.default}
# collectives kept whatever the grad mode: context parallelism's all-gathers (keys/values, state
# maps, conv halos) run inside funcol's autograd function, whose forward runs without grad
COLLECTIVES = {_c10d.all_gather_into_tensor.default, _c10d.all_to_all_single.default}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    # ops under no_grad (QK-clip's max-logit recording) are never worth keeping for backward
    if op in COLLECTIVES or (op in SAVED_OPS and torch.is_grad_enabled()):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _context_fn():
    return create_selective_checkpoint_contexts(_selective_policy)


def apply_activation_checkpointing(model: Transformer, mode: str) -> None:
    """mode: none | full | selective."""
    if mode == "none":
        return
    extra = {"context_fn": _context_fn} if mode == "selective" else {}
    for block in model.blocks():
        block.forward = _checkpointed(block.forward, extra)
        _mark_checkpointed(block, True)


def _mark_checkpointed(block: nn.Module, rerun_in_backward: bool) -> None:
    """Tell the block's layers that keep statistics once per forward (MoE: `checkpointed`)
    whether their Python forward may run again in backward."""
    for module in block.modules():
        if hasattr(module, "checkpointed"):
            module.checkpointed = rerun_in_backward


def _checkpointed(forward: Callable, extra: dict) -> Callable:
    """forward run under non-reentrant checkpointing. A plain function, not a functools.partial
    of `checkpoint`: dynamo traces this one into its checkpoint operator inside a compiled
    block, where it skipped the partial's frame altogether (AC + trainer.compile=true ran every
    block eagerly, torch 2.11-2.13)."""

    def checkpointed_forward(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    return checkpointed_forward


def _checkpoint_inside_the_graphs(model: Transformer) -> None:
    """A whole block compiled around its checkpoint recomputes inside the compiled backward: its
    Python forward never runs again, so layers that keep statistics once per forward (MoE) may
    answer "not a recompute" while compiling (one graph, no break inside the checkpoint, which
    would send the block back to eager), and dynamo keeps their side effects (the balance loss,
    the token counts) out of the recompute. A checkpoint dynamo cannot trace runs eagerly,
    where the layers check autograd's task id as before."""
    dynamo_config = torch._dynamo.config
    if hasattr(dynamo_config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        dynamo_config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for block in model.blocks():
        _mark_checkpointed(block, False)


def is_checkpointed(block: nn.Module) -> bool:
    return getattr(block.forward, "__name__", "") == "checkpointed_forward"


# Inductor's settings for CPU graphs, which it builds with the C++ compiler. Measured on the
# README's 2-core CPU, tiny preset, empty caches (bench/compile_cost.py): 73-90 s to the first
# compiled step by default, 32-34 s with all three, 22-28 s with the loss compiled per chunk
# (below); the same step time within the noise.
CPU_INDUCTOR_OPTIONS = {
    # one C++ file per graph (its kernels and the code that calls them) instead of a file per
    # kernel and a Python caller: 3 compiler runs for the tiny model (block forward and
    # backward, a loss chunk) instead of 33 kernel files, their header and 6 ISA probes
    "cpp_wrapper": True,
    # with that few files, precompiling the common header (6-7 s) saves less than it costs
    "cpp_cache_precompile_headers": False,
    # take the CPU's vector extensions from its feature flags instead of compiling a test
    # program for each (AVX2, AVX512: 8 s on a fresh cache; any g++ since 4.9 builds AVX512)
    "cpp.vec_isa_ok": True,
}


def quiet_complex_rope_warning() -> None:
    """The RoPE rotations enter each compiled block as one complex tensor (model/mixers/rope.py: so
    that FSDP2's input casting leaves them fp32), which the block splits into real cos/sin with
    view_as_real. Inductor runs that one view eagerly and warns once per graph; nothing else in
    the block is affected (the numbers are eager's), so the warning says nothing to act on."""
    warnings.filterwarnings(  # an identical filter replaces itself: calling again adds none
        "ignore", message="Torchinductor does not support code generation for complex operators"
    )


def _tensor_parallel(model: nn.Module) -> bool:
    """Whether parallel.tensor_parallel split `model` (DTensor weights on a mesh with a "tp"
    dimension)."""
    return any(
        isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ())
        for p in model.parameters()
    )


def _wait_for_embeddings(model: Transformer) -> None:
    """Under tensor parallelism the embedding's output is an AsyncCollectiveTensor (DTensor's
    RowwiseParallel all-reduces it with async_op=True and hands on the local tensor). Passed
    into a compiled block as it is, AOTAutograd unwraps it without the autograd of DTensor's
    to_local, so backward gives the embedding's Redistribute a plain gradient: "AttributeError:
    'Tensor' object has no attribute '_local_tensor'" (torch 2.13, any backend; the trainer,
    whose blocks FSDP2 wraps, did not show it). A clone outside the graphs waits for the
    all-reduce and passes on a plain tensor: one (B, T, C) copy per forward."""
    model.embed.register_forward_hook(_awaited)


def _awaited(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output


def compile_model(model: Transformer, device_type: str, backend: str = "inductor") -> None:
    """Compile each block on its own (FSDP2's gather/reduce hooks run between blocks; or its two
    sublayers, for residual streams that ask for it), and each chunk of the fused head +
    cross-entropy (model.loss.loss_chunk_fusable: inside the root's forward, so under FSDP2 too).
    On one CPU process this matched compiling the whole model as one graph (bench/
    train_throughput.py: *_compiled vs *_compiled_whole_model, with Inductor's default options).
    device_type: where the model
    will run ("cpu" takes CPU_INDUCTOR_OPTIONS). backend: torch.compile's (tests take
    "aot_eager", AOTAutograd's graphs run eagerly, to tell its problems from Inductor's)."""
    quiet_complex_rope_warning()
    options = CPU_INDUCTOR_OPTIONS if device_type == "cpu" and backend == "inductor" else None
    if _tensor_parallel(model):
        _wait_for_embeddings(model)
        if options:
            # a tensor-parallel block's graph takes the tp DeviceMesh as an input (torch >= 2.13
            # passes it as an opaque object, the mesh its styles' hooks hold), and cpp_wrapper's
            # Python caller turns every non-tensor input into a tensor: "TypeError: object of
            # type 'DeviceMesh' has no len()" (torch 2.13). Inductor's own caller passes it on
            options = {k: v for k, v in options.items() if k != "cpp_wrapper"}
    if options and getattr(model, "context_split", None) is not None:
        # context parallelism's autograd all-gather (funcol's) is a fallback op whose argument
        # types cpp_wrapper's code generation rejects ("arg type Any is not yet supported by
        # custom_op_wrapper", torch 2.13): Inductor's Python caller runs it
        options = {k: v for k, v in options.items() if k != "cpp_wrapper"}
    whole = model.stream.compile_whole_blocks
    checkpointed = any(is_checkpointed(block) for block in model.blocks())
    if checkpointed and _tensor_parallel(model):
        # a checkpoint traced inside a tensor-parallel graph saves the tp DeviceMesh (an opaque
        # graph input) for its recompute, which AOTAutograd refuses ("expected all
        # tensors_saved_with_vc_check to be Tensors", torch 2.13, any backend): the checkpoint
        # stays eager around the compiled sublayers, which it recomputes as they are
        whole = False
    if whole and checkpointed:
        _checkpoint_inside_the_graphs(model)
        if options:
            # checkpointed blocks compile with their RNG-state bookkeeping, whose op cpp_wrapper's
            # code generation rejects (an AssertionError in Inductor for mHC's blocks, torch 2.13)
            options = {k: v for k, v in options.items() if k != "cpp_wrapper"}
    for block in model.blocks():
        assert isinstance(block, nn.Module)
        if whole:
            block.compile(backend=backend, options=options)
        else:  # the stream's connections stay eager (model/residual/stream.py: compile_whole_blocks)
            block.attn.compile(backend=backend, options=options)
            block.ffn.compile(backend=backend, options=options)
    # the loss compiles per chunk (under no_grad, inside its autograd Function: no backward
    # graph), one graph for every chunk and batch size instead of one per number of chunks;
    # in the form Inductor fuses into one pass over the logits (model.loss.loss_chunk_fusable)
    if model.loss_fn is not chunked_cross_entropy:
        return  # another loss took its place (vocab-parallel under tensor parallelism): eager
    compiled_chunk = torch.compile(loss_chunk_fusable, backend=backend, options=options)
    model.loss_fn = functools.partial(chunked_cross_entropy, chunk_fn=compiled_chunk)
