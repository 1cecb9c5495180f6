"""compile_model's fused head + loss: compiled per chunk, one graph for every chunk and every
number of chunks, the forward's gradients equal to the eager loss's."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from model.loss import chunked_cross_entropy
from model.presets import load_preset
from model.transformer import build_model
from parallel.activation import compile_model

CHUNK = 16


def loss_and_grads(loss_fn, h, weight, targets):
    h, weight = h.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = loss_fn(h, weight, targets, CHUNK)
    return (loss, *torch.autograd.grad(loss * 3.0, (h, weight)))  # a scale flows back in


def compiled_model():
    overrides = {"d_model": 32, "n_layers": 1, "attention.n_heads": 2, "attention.n_kv_heads": 1}
    model = build_model(load_preset("tiny", overrides | {"vocab_size": 96}), seed=0)
    compile_model(model, "cpu")
    return model


def test_the_loss_compiles_one_graph_for_every_chunk_and_batch():
    """2, 4 and 5 chunks (the last one whole) through one graph, no backward graph; loss and
    gradients (scaled by the incoming gradient) match the eager function in fp32."""
    model = compiled_model()
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 32, generator=gen)
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        for chunks in (2, 4, 5):
            h = torch.randn(chunks * CHUNK, 32, generator=gen)
            targets = torch.randint(0, 96, (chunks * CHUNK,), generator=gen)
            targets[3] = -100  # ignored
            got = loss_and_grads(model.loss_fn, h, weight, targets)
            want = loss_and_grads(chunked_cross_entropy, h, weight, targets)
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1


def test_a_shorter_last_chunk_adds_at_most_one_graph():
    """40 tokens in chunks of 16: the last 8 make Dynamo recompile once (then dynamic), values
    still equal to eager."""
    model = compiled_model()
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 32, generator=gen)
    torch._dynamo.reset()
    counters.clear()
    for tokens in (40, 56):
        h = torch.randn(tokens, 32, generator=gen)
        targets = torch.randint(0, 96, (tokens,), generator=gen)
        got = loss_and_grads(model.loss_fn, h, weight, targets)
        want = loss_and_grads(chunked_cross_entropy, h, weight, targets)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] <= 2


@pytest.mark.parametrize(
    "preset,mode", [("tiny", "full"), ("tiny", "selective"), ("tiny_mhc", "full")]
)
def test_checkpointed_blocks_compile_and_keep_their_gradients(preset, mode):
    """Activation checkpointing + trainer.compile=true: the blocks compile (a graph besides the
    loss chunk's: dynamo skipped a functools.partial of `checkpoint`, which left every block
    eager), mHC's too (without cpp_wrapper, whose code generation rejects the checkpoint's RNG
    bookkeeping), and the loss and gradients equal the eager checkpointed model's (fp32)."""
    from parallel.activation import apply_activation_checkpointing

    overrides = {"d_model": 32, "n_layers": 2, "attention.n_heads": 2, "attention.n_kv_heads": 1}
    tokens = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(0))
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        model = build_model(load_preset(preset, overrides | {"vocab_size": 96}), seed=0)
        apply_activation_checkpointing(model, mode)
        if compiled:
            compile_model(model, "cpu")
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        results.append([loss.detach(), *(p.grad for p in model.parameters())])
    assert counters["stats"]["unique_graphs"] >= 2  # a block's graph and the loss chunk's
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_checkpointed_moe_block_compiles_whole_and_counts_once():
    """MoE under activation checkpointing + compile, on the route GPUs take (grouped GEMMs, the
    gather combine): no graph break (the statistics' recompute check is a constant: the
    checkpoint recomputes inside the compiled backward), each slot counted once, one balance
    loss per forward, and loss, balance loss and gradients as the eager checkpointed model's
    (bf16 autocast: 3% of each tensor's scale)."""
    from model.moe import grouped_mm_supported, pop_aux_loss, slots
    from parallel.activation import apply_activation_checkpointing

    if not grouped_mm_supported("cpu", torch.bfloat16):
        pytest.skip("machine: no grouped GEMM in this torch on this CPU")
    overrides = {"d_model": 64, "n_layers": 1, "attention.n_heads": 2, "attention.n_kv_heads": 1}
    overrides |= {
        "vocab_size": 96,
        "moe.n_routed_experts": 4,
        "moe.top_k": 2,
        "moe.first_k_dense": 0,
    }
    overrides |= {"moe.expert_hidden": 32, "ffn.hidden": 128, "moe.aux_loss_coef": 0.01}
    tokens = torch.randint(0, 96, (2, 33), generator=torch.Generator().manual_seed(0))
    results = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(slots, "embedding_bag_combines", lambda device_type: False)
        for compiled in (False, True):
            torch._dynamo.reset()
            counters.clear()
            model = build_model(load_preset("tiny_moe", overrides), seed=0)
            for module in model.modules():
                if hasattr(module, "impl"):
                    module.impl = "grouped_mm"
            apply_activation_checkpointing(model, "full")
            if compiled:
                compile_model(model, "cpu")
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(tokens[:, :-1], tokens[:, 1:])
            aux = pop_aux_loss(model)
            (loss + aux).backward()
            moe = model.layers["0"].ffn
            assert moe.tokens_per_expert.sum() == 2 * 32 * 2  # every slot once, none recomputed
            results.append([loss.detach(), aux.detach(), *(p.grad for p in model.parameters())])
    assert not counters["graph_break"], list(counters["graph_break"])
    for got, want in zip(results[1], results[0], strict=True):
        assert (got - want).abs().max() <= 3e-2 * want.abs().max()


def test_compiling_rope_says_nothing_about_complex_operators():
    """RoPE's complex rotations made Inductor warn on every compiled block ("does not support
    code generation for complex operators": one eager view, harmless): silenced by name."""
    import warnings

    torch._dynamo.reset()
    model = compiled_model()
    tokens = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(0))
    no_cache = {"fx_graph_cache": False, "autotune_local_cache": False}  # lower the graphs now
    with warnings.catch_warnings(record=True) as caught, torch._inductor.config.patch(no_cache):
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    assert not [w for w in caught if "complex operators" in str(w.message)]
