"""KV-cache generation: prefill + decode equals the full forward; greedy generate equals a naive
loop; cache sizes follow the per-token formulas; overflowing the cache is a clear error."""

from __future__ import annotations

import pytest
import torch

from model import generate
from tests.model.helpers import perturb_norm_weights, tiny_config, tiny_model

# fp32: the cached path differs from the full forward only by op order (and, for MLA, by the
# absorbed W_uk / W_uv matmuls); logits are O(1), observed differences ~1e-6
ATOL = RTOL = 1e-5

MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)

CASES = {
    "mha": dict(),
    "gqa": dict(attention={"n_kv_heads": 2}),
    "mqa": dict(attention={"n_kv_heads": 1}),
    "mla_q_lora": dict(attention={"kind": "mla"}, mla=MLA | {"q_lora_rank": 12}),
    "mla_no_q_lora": dict(attention={"kind": "mla"}, mla=MLA | {"q_lora_rank": 0}),
    "mla_window_yarn": dict(
        attention={"kind": "mla", "sliding_window": 3},
        mla=MLA,
        rope={"scaling": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.8},
    ),
    "sliding_window": dict(attention={"n_kv_heads": 2, "sliding_window": 3}),
    "alibi": dict(position="alibi", attention={"n_kv_heads": 2}),
    "alibi_window": dict(position="alibi", attention={"sliding_window": 4}),
    "qk_norm_gate": dict(attention={"n_kv_heads": 2, "qk_norm": True, "output_gate": True}),
    "learned": dict(position="learned"),
    "sinusoidal": dict(position="sinusoidal", norm="layer", ffn={"kind": "gelu", "hidden": 64}),
    "nope": dict(position="none"),
    "interleaved_partial": dict(rope={"pairing": "interleaved", "fraction": 0.5}),
    "yarn": dict(rope={"scaling": "yarn", "factor": 4.0}),
    "llama3": dict(rope={"scaling": "llama3", "factor": 8.0, "original_max_seq_len": 8}),
    # dynamic NTK stays consistent with a cache only up to the original length (see the report);
    # here the whole run (8 + 4 tokens) is within the original 32 tokens
    "dynamic_ntk": dict(rope={"scaling": "dynamic_ntk", "factor": 2.0}),
    "post_norm": dict(residual="post", norm="layer"),
    "deepnorm": dict(residual="deepnorm", attention={"n_kv_heads": 2}),
}

PROMPT, NEW = 8, 4


def build(case: str):
    model = tiny_model(tiny_config(**CASES[case]))
    perturb_norm_weights(model)
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_then_decode_equals_full_forward(case):
    model = build(case)
    tokens = torch.randint(0, 61, (2, PROMPT + NEW), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(2, PROMPT + NEW)
        steps = [model(tokens[:, :PROMPT], cache=cache)]
        for t in range(PROMPT, PROMPT + NEW):
            steps.append(model(tokens[:, t : t + 1], cache=cache))
    assert cache.length == PROMPT + NEW
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
    "case", ["mha", "gqa", "mla_q_lora", "mla_window_yarn", "sliding_window", "alibi", "learned"]
)
def test_prefill_in_chunks_equals_full_forward(case):
    model = build(case)
    tokens = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(2, 10)  # larger than needed: the unused tail must not matter
        first = model(tokens[:, :5], cache=cache)
        second = model(tokens[:, 5:], cache=cache)
    torch.testing.assert_close(torch.cat([first, second], dim=1), full, atol=ATOL, rtol=RTOL)


def naive_greedy(model, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """Recompute the whole forward for every new token; no cache."""
    out = prompt
    for _ in range(n):
        next_token = model(out)[:, -1].argmax(dim=-1, keepdim=True)
        out = torch.cat([out, next_token], dim=1)
    return out


@pytest.mark.parametrize("case", ["gqa", "mla_q_lora", "alibi_window", "learned"])
def test_greedy_generate_equals_naive_loop(case):
    model = build(case)
    prompt = torch.randint(0, 61, (3, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = generate(model, prompt, 10, temperature=0)
        want = naive_greedy(model, prompt, 10)
    assert got.shape == (3, 15)
    assert torch.equal(got[:, :5], prompt)
    assert torch.equal(got, want)
    assert len(set(got[:, 5:].flatten().tolist())) > 1  # not a degenerate constant continuation


def test_generate_eos_rows_keep_emitting_eos():
    model = build("gqa")
    prompt = torch.randint(0, 61, (3, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        free = generate(model, prompt, 10, temperature=0)
        eos = int(free[0, 7])  # the third token that row 0 generates
        got = generate(model, prompt, 10, temperature=0, eos_id=eos)
    row = got[0, 5:].tolist()
    first = row.index(eos)
    assert first <= 2
    assert all(t == eos for t in row[first:])
    assert got[0, 5 : 5 + first].tolist() == free[0, 5 : 5 + first].tolist()


# ---- cache memory ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("case", "per_token_elements"),
    [
        # GQA: keys and values of the kv heads: 2 * layers * K * D
        ("mha", 2 * 2 * 4 * 8),
        ("gqa", 2 * 2 * 2 * 8),
        ("mqa", 2 * 2 * 1 * 8),
        # MLA: the latent and the shared rope key: layers * (kv_lora_rank + qk_rope_head_dim)
        ("mla_q_lora", 2 * (16 + 4)),
        ("mla_no_q_lora", 2 * (16 + 4)),
    ],
)
def test_cache_bytes_per_token(case, per_token_elements, dtype):
    model = build(case)
    batch, capacity = 3, 7
    cache = model.new_cache(batch, capacity, dtype=dtype)
    bytes_per = torch.finfo(dtype).bits // 8
    assert cache.nbytes() == batch * capacity * per_token_elements * bytes_per
    assert all(buf.dtype == dtype for buf in cache.buffers())
    # the accounting hook the inspect table uses agrees
    hook = sum(block.attn.state_size().per_token for block in model.layers.values())
    assert hook == per_token_elements


# ---- capacity ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["gqa", "mla_q_lora"])
def test_exceeding_cache_capacity_raises(case):
    model = build(case)
    tokens = torch.randint(0, 61, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cache = model.new_cache(1, 5)
        with pytest.raises(ValueError, match="KV cache holds 5 tokens"):
            model(tokens, cache=cache)  # 6 tokens into room for 5
        assert cache.length == 0  # the failed call stored nothing
        model(tokens[:, :5], cache=cache)
        with pytest.raises(ValueError, match=r"5 are used and 1 more"):
            model(tokens[:, 5:], cache=cache)
        assert cache.length == 5


@pytest.mark.parametrize("case", ["gqa", "mla_q_lora"])
def test_last_logits_is_the_last_row_of_the_full_logits(case):
    model = build(case)
    tokens = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(
            model.last_logits(tokens), model(tokens)[:, -1], atol=ATOL, rtol=RTOL
        )
