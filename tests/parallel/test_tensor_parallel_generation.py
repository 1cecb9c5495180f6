"""Generation under tensor parallelism (parallel/tensor_parallel.py) on gloo ranks against one
process, fp32: greedy prefill + decode with each layer's generation state (model/generate.py)
gives the same tokens and the same logits at every step (to 1e-5; measured differences are
~3e-7) for softmax attention (GQA with tp dividing the kv heads, MQA and GQA with tp a
multiple of them), MLA (its absorbed decode reads this rank's rows of kv_b_proj), Gated
DeltaNet, KDA and Engram (its tables split by rows); each rank's state holds only its own
heads (an MLA latent is whole on every rank). The trainer's sampling through the FSDP2
engine's `full_weights` draws the same text."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.ranks import run_ranks
from tests.parallel.tp_generation_workers import tp_engine_sample, tp_greedy

pytestmark = pytest.mark.distributed

SMALL = {"d_model": 64}
DENSE = SMALL | {"n_layers": 2, "attention.n_heads": 4, "attention.n_kv_heads": 2}
HYBRID = SMALL | {"n_layers": 4, "gdn.head_dim": 16, "gdn.v_head_dim": 16}
KDA = SMALL | {"n_layers": 4, "kda.head_dim": 16}
CAPACITY = 13  # the prompt's 5 tokens and 8 new ones


@pytest.mark.parametrize(
    ("ranks", "preset", "overrides", "state"),
    [
        # one rank's state: (batch, heads, capacity, head dim) kv caches; the recurrent
        # layers' conv inputs (batch, K - 1, channels) and (batch, heads, Dk, Dv) states
        (2, "tiny", DENSE, {"layers.0.k": (2, 1, CAPACITY, 16)}),
        (2, "tiny", DENSE | {"attention.n_kv_heads": 1}, {"layers.0.v": (2, 1, CAPACITY, 16)}),
        (4, "tiny", DENSE, {"layers.1.k": (2, 1, CAPACITY, 16)}),
        (2, "tiny_mla", SMALL | {"n_layers": 2}, {"layers.0.c": (2, CAPACITY, 64)}),
        (
            2,
            "tiny_hybrid",  # 3 GDN layers (2 key heads, 4 value heads) + gated attention
            HYBRID,
            {"layers.0.conv": (2, 3, 64), "layers.0.state": (2, 2, 16, 16)}
            | {"layers.3.k": (2, 1, CAPACITY, 16)},
        ),
        (
            2,
            "tiny_kda",  # 3 KDA layers (4 heads) + MLA without RoPE
            KDA,
            {"layers.2.conv": (2, 3, 96), "layers.2.state": (2, 2, 16, 16)}
            | {"layers.3.c": (2, CAPACITY, 64)},
        ),
        (
            2,
            "tiny_engram",  # Engram in blocks 1 and 3: its tables split by rows over tp
            DENSE | {"n_layers": 4, "engram.table_sizes": [1000, 1000]},
            {"layers.1.memory.tokens": (2, 2), "layers.1.mixer.k": (2, 1, CAPACITY, 16)},
        ),
    ],
    ids=["gqa_tp2_kv2", "mqa_tp2", "gqa_tp4_kv2", "mla", "gdn", "kda", "engram"],
)
def test_greedy_generation_over_tp_ranks_equals_one_process(ranks, preset, overrides, state):
    whole = tp_greedy(0, preset, overrides)
    for got in run_ranks(ranks, tp_greedy, preset, overrides):
        assert torch.equal(got["tokens"], whole["tokens"])
        # the prefill's last logits, then one (B, V) per decoded token
        assert got["logits"].shape == whole["logits"].shape == (8, 2, 128)
        torch.testing.assert_close(got["logits"], whole["logits"], rtol=1e-5, atol=1e-5)
        assert got["state_shapes"].keys() == whole["state_shapes"].keys()
        for name, shape in state.items():
            assert got["state_shapes"][name] == shape, name


def test_trainer_sampling_through_fsdp2_full_weights_equals_one_process():
    """KDA's recurrent states and MLA's absorbed decode on the weights FSDP2 gathers for
    sampling (trainer/evaluate.py sample_text), here over a data mesh of one rank (dp_shard=2
    x tp=2 passes too, in 4 ranks' time): every rank draws the one process's tokens."""
    whole = tp_engine_sample(0, "tiny_kda", KDA, 1)
    assert not whole["sharded"]
    for got in run_ranks(2, tp_engine_sample, "tiny_kda", KDA, 2):
        assert got["sharded"] and got["split"]  # FSDP2 over the data ranks, heads over tp
        assert got["text"] == whole["text"]
