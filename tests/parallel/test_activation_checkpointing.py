"""Activation checkpointing really recomputes (issue 13, item 22): the ops that run during
backward show what was kept. Without checkpointing no forward op runs again; `full` reruns each
block's forward (its matmuls and attention too); `selective` reruns only the cheap ops (norms,
activations) and takes matmul and attention outputs from what it kept. Turning either mode into
a no-op, or selective into full, fails here."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model.presets import load_preset
from model.transformer import build_model
from parallel.activation import apply_activation_checkpointing

LAYERS = 2
SDPA = "_scaled_dot_product_flash_attention_for_cpu"


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that actually execute (ops served from a checkpoint cache do not
    reach a mode entered outside it)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def backward_ops(mode: str) -> Counter[str]:
    overrides = {"d_model": 64, "n_layers": LAYERS, "attention.n_heads": 4}
    overrides |= {"attention.n_kv_heads": 2, "vocab_size": 128, "max_seq_len": 64}
    model = build_model(load_preset("tiny", overrides), seed=0)
    apply_activation_checkpointing(model, mode)
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    with OpCounter() as counter:
        loss.backward()
    return counter.calls


@pytest.fixture(scope="module")
def ops() -> dict[str, Counter[str]]:
    return {mode: backward_ops(mode) for mode in ("none", "full", "selective")}


def test_without_checkpointing_no_forward_op_runs_in_backward(ops):
    assert ops["none"][SDPA] == 0 and ops["none"]["silu"] == 0 and ops["none"]["rsqrt"] == 0


def test_full_checkpointing_recomputes_every_block(ops):
    assert ops["full"][SDPA] == LAYERS and ops["full"]["silu"] == LAYERS
    assert ops["full"]["mm"] > ops["none"]["mm"]  # the blocks' projections again


def test_selective_checkpointing_recomputes_only_the_cheap_ops(ops):
    assert ops["selective"]["silu"] == LAYERS and ops["selective"]["rsqrt"] > 0
    assert ops["selective"][SDPA] == 0  # attention output kept
    assert ops["selective"]["mm"] == ops["none"]["mm"]  # matmul outputs kept


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_moe_model_checkpointed_from_its_first_step_equals_no_checkpointing(mode):
    """The grouped-GEMM probe (model/moe/experts.py) runs at the first MoE forward, inside the
    first checkpointed block: under selective checkpointing its ops went into the checkpoint's
    cache and the recompute took the probe's tensors for the experts' ("size of tensor a (16)
    must match ... (256)"). Fresh probes here, as in a new process."""
    from model.moe.experts import _grouped_mm_meta_probe, _grouped_mm_probe

    overrides = {"d_model": 64, "n_layers": LAYERS, "vocab_size": 128, "max_seq_len": 64}
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    grads = {}
    for checkpointing in ("none", mode):
        _grouped_mm_probe.cache_clear()
        _grouped_mm_meta_probe.cache_clear()
        model = build_model(load_preset("tiny_moe", overrides), seed=0)
        apply_activation_checkpointing(model, checkpointing)
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        grads[checkpointing] = {n: p.grad for n, p in model.named_parameters()}
    for name, grad in grads["none"].items():
        torch.testing.assert_close(grads[mode][name], grad, msg=name)
