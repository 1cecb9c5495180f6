"""Per-block compile (parallel.activation.compile_model) under tensor parallelism: 2 gloo ranks,
tp=2, fp32, the loss and every gradient equal to one eager process, with AOTAutograd's graphs run
eagerly (backend aot_eager) and with Inductor's CPU options (as trainer.compile=true runs it)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from model.presets import load_preset
from model.transformer import build_model
from parallel.activation import apply_activation_checkpointing, compile_model
from tests.parallel.ranks import run_ranks
from tests.parallel.tp_workers import VOCAB, batch, whole

pytestmark = pytest.mark.distributed

DENSE = {"d_model": 64, "n_layers": 2, "attention.n_heads": 4, "attention.n_kv_heads": 2}


def compiled_forward_backward(
    rank: int, overrides: dict, backend: str, checkpointed: bool = False
) -> tuple:
    """One fp32 forward + backward: split over both ranks and compiled per block (with
    `checkpointed`: full activation checkpointing and sequence parallelism too), or (without a
    process group) whole and eager. (loss, {name: whole gradient})."""
    from parallel.sequence_parallel import sum_partial_gradients
    from parallel.tensor_parallel import split_over_tp, tp_mesh_of

    cfg = load_preset("tiny", {"vocab_size": VOCAB, "max_seq_len": 64} | overrides)
    model = build_model(cfg, seed=0)
    if dist.is_initialized():
        split_over_tp(model, tp_mesh_of(2, 2, "cpu"), checkpointed)
        apply_activation_checkpointing(model, "full" if checkpointed else "none")
        compile_model(model, "cpu", backend=backend)
    inputs, targets = batch()
    loss = model(inputs, targets)
    loss.backward()
    if dist.is_initialized():
        sum_partial_gradients(model)
    return loss.detach(), {n: whole(p.grad) for n, p in model.named_parameters()}


# each backend once, with each head: the embedding's weight (tied) and a head of its own; before
# the fix aot_eager failed in backward (the embedding's all-reduce, an AsyncCollectiveTensor, went
# into the compiled block) and Inductor's cpp_wrapper failed on the DeviceMesh graph input
# (with full checkpointing + sequence parallelism: before the fix a checkpoint traced inside a
# tensor-parallel graph failed in AOTAutograd, "expected all tensors_saved_with_vc_check to be
# Tensors ... DeviceMesh")
@pytest.mark.parametrize(
    ("backend", "tied", "checkpointed"),
    [("aot_eager", False, False), ("inductor", True, False), ("aot_eager", True, True)],
    ids=["aot_eager", "inductor", "aot_eager_checkpointed_sequence_parallel"],
)
def test_compiled_tensor_parallel_blocks_give_the_eager_gradients(backend, tied, checkpointed):
    overrides = DENSE | {"tie_embeddings": tied}
    want_loss, want = compiled_forward_backward(0, overrides, backend)
    for loss, grads in run_ranks(2, compiled_forward_backward, overrides, backend, checkpointed):
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
        assert set(grads) == set(want)
        for name, grad in want.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
