"""Engram against a direct transcription of the official demo (deepseek-ai/Engram:
engram_demo_v1.py): the hash ids bit-exact in int64, the primes, the gate + value + conv fusion with
copied weights (one stream and mHC's four); then causality, per-document resets, generation, the
zero-initialized conv, offload, the compression map and the config errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from model import ModelConfig, build_model
from model.config import ConfigError, EngramConfig, MHCConfig
from model.engram.hashing import (
    is_prime,
    layer_multipliers,
    ngram_rows,
    shifted_tokens,
    table_primes,
)
from model.generate import generate
from model.mixers.masks import AttentionContext

sympy = pytest.importorskip("sympy")
V = 300


def engram_model(layers=(1,), residual="pre", seed=0, **engram) -> torch.nn.Module:
    e = dict(layers=list(layers), heads=2, dim=32, table_sizes=[101, 211]) | engram
    cfg = ModelConfig(
        vocab_size=V,
        d_model=32,
        n_layers=3,
        residual=residual,
        mhc=MHCConfig(streams=4),
        engram=EngramConfig(**e),
    )
    return build_model(cfg, seed=seed)


# ---- the demo's NgramHashMapping, transcribed (numpy, sympy.isprime) ------------------------------


def demo_primes(vocab_sizes, max_ngram, heads, layer_ids):
    seen, out = set(), {}
    for layer_id in layer_ids:
        per_order = []
        for ngram in range(2, max_ngram + 1):
            start, sizes = vocab_sizes[ngram - 2] - 1, []
            for _ in range(heads):
                candidate = start + 1
                while not (sympy.isprime(candidate) and candidate not in seen):
                    candidate += 1
                seen.add(candidate)
                sizes.append(candidate)
                start = candidate
            per_order.append(sizes)
        out[layer_id] = per_order
    return out


def demo_hashes(x, layer_id, vocab, vocab_sizes, max_ngram, heads, layer_ids, pad, seed):
    max_long = np.iinfo(np.int64).max
    half_bound = max(1, int(max_long // vocab) // 2)
    g = np.random.default_rng(int(seed + 10007 * int(layer_id)))
    multipliers = g.integers(low=0, high=half_bound, size=(max_ngram,), dtype=np.int64) * 2 + 1
    primes = demo_primes(vocab_sizes, max_ngram, heads, layer_ids)[layer_id]
    _B, T = x.shape

    def shift_k(k):
        if k == 0:
            return x
        return np.pad(x, ((0, 0), (k, 0)), mode="constant", constant_values=pad)[:, :T]

    shifts = [shift_k(k) for k in range(max_ngram)]
    out = []
    for n in range(2, max_ngram + 1):
        mix = shifts[0] * multipliers[0]
        for k in range(1, n):
            mix = np.bitwise_xor(mix, shifts[k] * multipliers[k])
        for j in range(heads):
            out.append((mix % int(primes[n - 2][j])).astype(np.int64, copy=False))
    return np.stack(out, axis=2)


@pytest.mark.parametrize("max_ngram", [2, 3, 4])
def test_hash_ids_equal_the_demo_bit_for_bit(max_ngram):
    vocab, heads, layers, seed, pad = 129280, 8, [1, 15], 0, 2
    sizes = [vocab * 5] * (max_ngram - 1)
    x = np.random.default_rng(0).integers(0, vocab, size=(2, 40), dtype=np.int64)
    x[0, :5] = vocab - 1  # the largest ids: the products come nearest to overflowing
    primes = table_primes(layers, sizes, heads)
    for layer in layers:
        expected = demo_hashes(x, layer, vocab, sizes, max_ngram, heads, layers, pad, seed)
        ids = torch.from_numpy(x)
        positions = torch.arange(40).expand(2, 40)
        shifted = shifted_tokens(ids, positions, None, max_ngram, pad)
        mult = torch.tensor(layer_multipliers(seed, layer, max_ngram, vocab))
        got = ngram_rows(shifted, mult, torch.tensor(primes[layer]))
        assert got.dtype == torch.int64
        assert np.array_equal(got.numpy(), expected)


def test_primes_are_the_demos_and_never_repeat():
    sizes, layers = [1000, 1000, 5000], [3, 0, 7]
    ours = table_primes(layers, sizes, heads=5)
    assert ours == demo_primes(sizes, 4, 5, sorted(layers))
    flat = [p for layer in ours.values() for order in layer for p in order]
    assert len(flat) == len(set(flat)) == 3 * 3 * 5 and min(flat) >= 1000
    assert all(is_prime(n) == sympy.isprime(n) for n in range(-3, 5000))
    assert all(is_prime(n) == sympy.isprime(n) for n in range(10**12, 10**12 + 300))


# ---- the demo's Engram.forward and ShortConv, transcribed ---------------------------------------


class DemoEngram(nn.Module):
    """engram_demo_v1.py::Engram after the lookup, with the model's norm eps everywhere (the demo
    takes nn.RMSNorm's default for the gate norms and 1e-5 in the conv)."""

    def __init__(self, width_in, C, hc, kernel, dilation, eps):
        super().__init__()
        self.C, self.hc, self.dilation = C, hc, dilation
        self.value_proj = nn.Linear(width_in, C)
        self.key_projs = nn.ModuleList([nn.Linear(width_in, C) for _ in range(hc)])
        self.norm1 = nn.ModuleList([nn.RMSNorm(C, eps=eps) for _ in range(hc)])
        self.norm2 = nn.ModuleList([nn.RMSNorm(C, eps=eps) for _ in range(hc)])
        self.conv_norms = nn.ModuleList([nn.RMSNorm(C, eps=eps) for _ in range(hc)])
        self.conv = nn.Conv1d(
            C * hc,
            C * hc,
            kernel,
            groups=C * hc,
            bias=False,
            padding=(kernel - 1) * dilation,
            dilation=dilation,
        )

    def short_conv(self, x):
        B, T, G, C = x.shape
        normed = torch.cat([self.conv_norms[i](x[:, :, i, :]) for i in range(G)], dim=-1)
        y = self.conv(normed.transpose(1, 2))[..., :T]
        return nn.functional.silu(y).transpose(1, 2).view(B, T, G, C)

    def forward(self, hidden_states, embeddings):
        gates = []
        for i in range(self.hc):
            key = self.norm1[i](self.key_projs[i](embeddings))
            query = self.norm2[i](hidden_states[:, :, i, :])
            gate = (key * query).sum(dim=-1) / math.sqrt(self.C)
            gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
            gates.append(gate.sigmoid().unsqueeze(-1))
        value = torch.stack(gates, dim=2) * self.value_proj(embeddings).unsqueeze(2)
        return value + self.short_conv(value)


def copy_into_demo(engram, demo):
    C = engram.width
    with torch.no_grad():
        demo.value_proj.weight.copy_(engram.value.weight)
        demo.value_proj.bias.copy_(engram.value.bias)
        for i in range(engram.streams):
            demo.key_projs[i].weight.copy_(engram.keys.weight[i * C : (i + 1) * C])
            demo.key_projs[i].bias.copy_(engram.keys.bias[i * C : (i + 1) * C])
            demo.norm1[i].weight.copy_(engram.key_norm.weight[i])
            demo.norm2[i].weight.copy_(engram.query_norm.weight[i])
            demo.conv_norms[i].weight.copy_(engram.conv_norm.weight[i])
        demo.conv.weight.copy_(engram.conv.weight)


@pytest.mark.parametrize("residual", ["pre", "mhc"])
def test_gate_value_and_conv_equal_the_demo_with_copied_weights(residual):
    model = engram_model(residual=residual)
    engram = model.layers["1"].engram
    with torch.no_grad():  # non-trivial values for every parameter the fusion uses
        for p in (engram.conv.weight, engram.keys.bias, engram.value.bias):
            p.normal_(0, 0.3)
        for norm in (engram.key_norm, engram.query_norm, engram.conv_norm):
            norm.weight.uniform_(0.5, 1.5)
    n = engram.streams
    assert n == (4 if residual == "mhc" else 1)
    tokens = torch.randint(0, V, (2, 17), generator=torch.Generator().manual_seed(1))
    ctx = model._context(tokens, torch.arange(17).expand(2, 17), 0, None, torch.float32)
    state = torch.randn((2, 17, n, 32) if n > 1 else (2, 17, 32))
    embeddings = engram.table(engram.rows(ctx, None)).flatten(-2)
    demo = DemoEngram(embeddings.shape[-1], 32, n, 4, 3, model.cfg.norm_eps)
    copy_into_demo(engram, demo)
    hidden = state if n > 1 else state.unsqueeze(2)
    expected = demo(hidden, embeddings)
    got = engram(state, ctx, None) - state
    torch.testing.assert_close(got.reshape(expected.shape), expected, rtol=1e-5, atol=1e-6)


def test_zero_initialized_conv_gives_the_gated_value():
    model = engram_model()
    engram = model.layers["1"].engram
    assert torch.count_nonzero(engram.conv.weight) == 0
    tokens = torch.randint(0, V, (1, 9))
    ctx = model._context(tokens, torch.arange(9).expand(1, 9), 0, None, torch.float32)
    state = torch.randn(1, 9, 32)
    e = engram.table(engram.rows(ctx, None)).flatten(-2)
    key = engram.key_norm(engram.keys(e)[:, :, None])
    score = (key * engram.query_norm(state[:, :, None])).sum(-1) / math.sqrt(32)
    gate = torch.sigmoid(score.sign() * score.abs().clamp_min(1e-6).sqrt())
    expected = gate[..., None] * engram.value(e)[:, :, None]
    torch.testing.assert_close(engram(state, ctx, None) - state, expected[:, :, 0])


# ---- causality, documents, generation -----------------------------------------------------------


@pytest.mark.parametrize("residual", ["pre", "mhc"])
def test_future_tokens_leave_earlier_outputs_unchanged(residual):
    model = engram_model(layers=(0, 2), residual=residual)
    with torch.no_grad():
        for block in model.layers.values():
            if block.engram is not None:
                block.engram.conv.weight.normal_(0, 0.5)
    tokens = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(2))
    changed = tokens.clone()
    changed[:, 15:] = (changed[:, 15:] + 7) % V
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :15], b[:, :15], rtol=0, atol=0)
    assert not torch.allclose(a[:, 15:], b[:, 15:])


def test_each_packed_document_hashes_and_convolves_as_if_alone():
    model = engram_model(layers=(0, 1))
    with torch.no_grad():
        for block in model.layers.values():
            if block.engram is not None:
                block.engram.conv.weight.normal_(0, 0.5)
    g = torch.Generator().manual_seed(3)
    first, second = (
        torch.randint(0, V, (1, 11), generator=g),
        torch.randint(0, V, (1, 13), generator=g),
    )
    packed = torch.cat([first, second], dim=1)
    doc_ids = torch.tensor([[0] * 11 + [1] * 13])
    together = model(packed, doc_ids=doc_ids)
    torch.testing.assert_close(together[:, 11:], model(second), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(together[:, :11], model(first), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("residual", ["pre", "mhc"])
def test_generation_with_the_cache_equals_full_forwards(residual):
    model = engram_model(layers=(0, 2), residual=residual).eval()
    with torch.no_grad():
        for block in model.layers.values():
            if block.engram is not None:
                block.engram.conv.weight.normal_(0, 0.5)
    prompt = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(4))
    out = generate(model, prompt, 9, temperature=0)
    cache = model.new_cache(2, 14)
    steps = [model.last_logits(out[:, :5], cache=cache)]
    for t in range(5, 13):
        steps.append(model.last_logits(out[:, t : t + 1], cache=cache))
    full = model(out[:, :13])
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 4:13], rtol=1e-4, atol=1e-5)
    assert torch.equal(out[:, 5:], full[:, 4:13].argmax(-1))


# ---- tables: gradients, offload, dtype --------------------------------------------------------


def test_table_gradients_are_sparse_rows_and_equal_the_dense_ones():
    tokens = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(5))
    grads = {}
    for sparse in (True, False):
        model = engram_model(sparse_grad=sparse)
        model(tokens, tokens).backward()
        grads[sparse] = model.layers["1"].engram.table.weight.grad
    assert grads[True].is_sparse and not grads[False].is_sparse
    assert grads[True].coalesce().indices().shape[1] <= 2 * 16 * 4  # rows read: B T heads
    torch.testing.assert_close(grads[True].to_dense(), grads[False], rtol=1e-6, atol=1e-7)


def test_offloaded_tables_stay_in_host_memory_and_fp32():
    model = engram_model(offload=True)
    table = model.layers["1"].engram.table
    model.to(torch.bfloat16)
    assert table.weight.dtype == torch.float32 and table.weight.device.type == "cpu"
    assert model.layers["1"].engram.keys.weight.dtype == torch.bfloat16
    model.float()
    reference = engram_model(offload=False).to(torch.bfloat16).float()  # the same rounding
    tokens = torch.randint(0, V, (2, 10))
    torch.testing.assert_close(model(tokens), reference(tokens), rtol=0, atol=0)
    meta = build_model(model.cfg, device="meta")
    meta.to_empty(device="cpu")
    assert meta.layers["1"].engram.table.weight.device.type == "cpu"


# ---- config ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "engram", "message"),
    [
        (dict(residual="attnres"), dict(layers=[0]), "model.residual='attnres'"),
        ({}, dict(layers=[5]), r"\[5\] outside 0..2"),
        ({}, dict(layers=[0], dim=30, heads=4), "not divisible"),
        ({}, dict(layers=[0], table_sizes=[10]), "one per n-gram order"),
        ({}, dict(layers=[0], pad_id=V), "pad_id"),
        ({}, dict(layers=[0, 0]), "twice"),
        ({}, dict(layers=[2, 0]), "increasing order"),
        ({}, dict(layers=[0], pad_id=-2), "pad_id=-2"),
    ],
)
def test_bad_engram_settings_fail_with_the_key(model, engram, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(vocab_size=V, d_model=32, n_layers=3, engram=EngramConfig(**engram), **model)


def test_compression_changes_the_multipliers_and_is_saved_in_the_state():
    model = engram_model()
    before = model.layers["1"].engram.multipliers.clone()
    canonical = torch.arange(V) // 2  # 150 canonical ids
    model.set_token_compression(canonical)
    engram = model.layers["1"].engram
    # 150 canonical ids + the reserved pad id
    assert torch.equal(engram.multipliers, torch.tensor(layer_multipliers(0, 1, 3, 151)))
    assert int(model.memory_ids.pad) == 150
    assert not torch.equal(engram.multipliers, before)
    state = model.state_dict()
    assert torch.equal(state["memory_ids.canonical"], canonical)
    fresh = engram_model(seed=1)
    fresh.load_state_dict(state)
    tokens = torch.randint(0, V, (1, 8))
    torch.testing.assert_close(fresh(tokens), model(tokens), rtol=0, atol=0)
    # tokens with one canonical id hash alike
    ctx = model._context(torch.tensor([[4, 6]]), torch.arange(2)[None], 0, None, torch.float32)
    twin = model._context(torch.tensor([[5, 7]]), torch.arange(2)[None], 0, None, torch.float32)
    assert torch.equal(engram.rows(ctx, None), engram.rows(twin, None))


def test_context_without_ids_is_refused():
    engram = engram_model().layers["1"].engram
    ctx = AttentionContext(
        positions=torch.zeros(1, 1), rope=None, mask=None, is_causal=True, start=0
    )
    with pytest.raises(ValueError, match="token ids"):
        engram(torch.zeros(1, 1, 32), ctx, None)


def _dense(grad):
    return grad.to_dense() if grad.is_sparse else grad


def test_compiled_blocks_match_eager_with_sparse_table_gradients():
    """The block compiles whole around the table lookup (kept out of the graph: a lookup with
    sparse gradients), with no graph break from the hashing (the pad id stays a tensor)."""
    from parallel.activation import compile_model

    eager, compiled = engram_model(), engram_model()
    compile_model(compiled, "cpu")
    tokens = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(6))
    a, b = eager(tokens, tokens), compiled(tokens, tokens)
    a.backward()
    b.backward()
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(_dense(q.grad), _dense(p.grad), rtol=1e-4, atol=1e-5, msg=name)
    assert compiled.layers["1"].engram.table.weight.grad.is_sparse


def test_fusion_equals_transformers_qwen4_exp_ple_layer():
    """An independent implementation of the same fusion (transformers' Qwen4-Exp PLE layer: one
    fused key projection, grouped (1 + w) norms, the dilated conv), fed our table rows; with mHC's
    4 streams (Qwen4-Exp requires more than one), no biases (it has none), norm weights = ours - 1."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextPLELayer

    model = engram_model(residual="mhc", bias=False)
    engram = model.layers["1"].engram
    n = engram.streams
    with torch.no_grad():
        engram.conv.weight.normal_(0, 0.3)
        for norm in (engram.key_norm, engram.query_norm, engram.conv_norm):
            norm.weight.uniform_(0.5, 1.5)
    hf_cfg = transformers.models.qwen4_exp.configuration_qwen4_exp.Qwen4ExpTextConfig(
        hidden_size=32,
        hc_count=n,
        ple_embed_dim=64,
        ple_conv_kernel_size=4,
        ngram_size=3,
        rms_norm_eps=model.cfg.norm_eps,
        heads_per_ngram=2,
        ngram_vocab_size_base=101,
        vocab_size=V,
        ple_layer_ids=[2],
        eos_token_id=1,
    )
    ple = Qwen4ExpTextPLELayer(hf_cfg, 1, 0)
    with torch.no_grad():
        ple.key_proj.weight.copy_(engram.keys.weight)
        ple.value_proj.weight.copy_(engram.value.weight)
        ple.norm_key.weight.copy_(engram.key_norm.weight.flatten() - 1)
        ple.norm_query.weight.copy_(engram.query_norm.weight.flatten() - 1)
        ple.norm_conv.weight.copy_(engram.conv_norm.weight.flatten() - 1)
        ple.conv1d.weight.copy_(engram.conv.weight)
    tokens = torch.randint(0, V, (2, 15), generator=torch.Generator().manual_seed(7))
    ctx = model._context(tokens, torch.arange(15).expand(2, 15), 0, None, torch.float32)
    rows = engram.table(engram.rows(ctx, None)).flatten(-2)
    ple.ple_embedding.forward = lambda ids, cache: rows  # the same memory read
    state = torch.randn((2, 15, n, 32) if n > 1 else (2, 15, 32))
    expected = ple(state.reshape(2, 15, n * 32), tokens, None)
    got = (engram(state, ctx, None) - state).reshape(2, 15, n * 32)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("pad_id", "collide"), [(-1, False), (0, True)])
def test_the_default_pad_is_an_id_of_its_own(pad_id, collide):
    """A document's first bigram (pad, x) reads other rows than (token 0, x) unless pad_id names
    token 0 (as a demo-style pad_id would name a real token)."""
    model = engram_model(pad_id=pad_id)
    engram = model.layers["1"].engram
    start = model._context(
        torch.tensor([[5]]), torch.zeros(1, 1, dtype=torch.long), 0, None, torch.float32
    )
    after = model._context(torch.tensor([[0, 5]]), torch.arange(2)[None], 0, None, torch.float32)
    first, second = engram.rows(start, None)[0, 0], engram.rows(after, None)[0, 1]
    assert torch.equal(first, second) == collide


def test_mtp_metric_sums_stay_fp32_when_the_model_is_cast():
    from model.config import MTPConfig

    model = build_model(ModelConfig(vocab_size=V, d_model=32, n_layers=2, mtp=MTPConfig(depth=1)))
    model.to(torch.bfloat16)
    assert model.mtp.loss_sums.dtype == torch.float32
    assert model.embed.weight.dtype == torch.bfloat16
