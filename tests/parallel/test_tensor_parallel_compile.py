"""Per-block compile (parallel.activation.compile_model) under tensor parallelism: 2 gloo ranks,
tp=2, fp32, the loss and every gradient equal to one eager process, with AOTAutograd's graphs run
eagerly (backend aot_eager) and with Inductor's CPU options (as trainer.compile=true runs it)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from model.presets import load_preset
from model.transformer import build_model
from parallel.activation import compile_model
from tests.parallel.ranks import run_ranks
from tests.parallel.tp_workers import VOCAB, batch, whole

pytestmark = pytest.mark.distributed

DENSE = {"d_model": 64, "n_layers": 2, "attention.n_heads": 4, "attention.n_kv_heads": 2}


def compiled_forward_backward(rank: int, overrides: dict, backend: str) -> tuple:
    """One fp32 forward + backward: split over both ranks and compiled per block, or (without a
    process group) whole and eager. (loss, {name: whole gradient})."""
    from parallel.tensor_parallel import apply_tensor_parallel, tp_mesh_of

    cfg = load_preset("tiny", {"vocab_size": VOCAB, "max_seq_len": 64} | overrides)
    model = build_model(cfg, seed=0)
    if dist.is_initialized():
        apply_tensor_parallel(model, tp_mesh_of(2, 2, "cpu"))
        compile_model(model, "cpu", backend=backend)
    inputs, targets = batch()
    loss = model(inputs, targets)
    loss.backward()
    return loss.detach(), {n: whole(p.grad) for n, p in model.named_parameters()}


# each backend once, with each head: the embedding's weight (tied) and a head of its own; before
# the fix aot_eager failed in backward (the embedding's all-reduce, an AsyncCollectiveTensor, went
# into the compiled block) and Inductor's cpp_wrapper failed on the DeviceMesh graph input
@pytest.mark.parametrize(
    ("backend", "tied"), [("aot_eager", False), ("inductor", True)], ids=["aot_eager", "inductor"]
)
def test_compiled_tensor_parallel_blocks_give_the_eager_gradients(backend, tied):
    overrides = DENSE | {"tie_embeddings": tied}
    want_loss, want = compiled_forward_backward(0, overrides, backend)
    for loss, grads in run_ranks(2, compiled_forward_backward, overrides, backend):
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
        assert set(grads) == set(want)
        for name, grad in want.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
