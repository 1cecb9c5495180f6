"""Activation checkpointing per block, and `torch.compile` of every block plus the fused head +
loss (`compile_model`).

Both rewrite a block's `forward` / call in place rather than wrapping the module, so parameter
names (`layers.3.attn.q_proj.weight`) stay the same for checkpoints and export.

- full: keep only each block's input; recompute the block in backward.
- selective: also keep the outputs of matmuls and attention (the expensive ops); recompute the
  cheap elementwise ones (norms, activations, RoPE).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

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


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    # ops under no_grad (QK-clip's max-logit recording) are never worth keeping for backward
    if op in SAVED_OPS and torch.is_grad_enabled():
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
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False, **extra)


def compile_model(model: Transformer) -> None:
    """Compile each block on its own (FSDP2's gather/reduce hooks run between blocks; or its two
    sublayers, for residual streams that ask for it), and the
    fused head + cross-entropy as a function (inside the root's forward, so under FSDP2 too).
    On one CPU process this matches compiling the whole model as one graph (bench/
    train_throughput.py: *_compiled vs *_compiled_whole_model)."""
    whole = model.stream.compile_whole_blocks
    for block in model.blocks():
        assert isinstance(block, nn.Module)
        if whole:
            block.compile()
        else:  # the stream's connections stay eager (model/residual.py: compile_whole_blocks)
            block.attn.compile()
            block.ffn.compile()
    model.loss_fn = torch.compile(model.loss_fn)
