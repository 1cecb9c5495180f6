"""The Triton FlashAttention kernel (model/kernels/flash_attention.py) under Triton's interpreter
on CPU (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA), against an fp64 softmax over the
dense mask of model/mixers/masks.py (outputs, dQ/dK/dV) and the chunked max-logit recomputation of
model/mixers/qk_logits.py: causal and full attention, MHA / GQA / MQA, packed documents, sliding
windows, head dims that are not powers of two (MLA's 192 / 128 shape scaled down), lengths that
are and are not a multiple of the block (the unmasked and masked loads), bf16; both backward
variants (two kernels; one pass with atomic dQ), and unequal row and key blocks as the GPU's
candidates have them. The autotuner's pruning, and the sm_90 compile of every kernel variant
(model/kernels/aot.py). Skipped where triton is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.mixers.masks import build_mask, document_starts
from model.mixers.qk_logits import max_logits_per_head

triton = pytest.importorskip("triton")
from model.kernels import flash_attention as fa  # noqa: E402
from model.kernels.flash_attention import flash_attention, key_bounds, last_rows  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

# (B, Hq, Hkv, T, Dqk, Dv, causal, window, documents)
CASES = {
    "gqa causal": (2, 4, 2, 50, 32, 32, True, 0, False),
    "mha causal": (1, 2, 2, 33, 64, 64, True, 0, False),
    "mqa full": (2, 4, 1, 37, 16, 16, False, 0, False),
    "gqa documents + window, odd dims": (2, 4, 2, 70, 24, 40, True, 9, True),
    "mqa documents": (1, 2, 1, 45, 48, 32, True, 0, True),
    "window": (1, 2, 2, 64, 32, 32, True, 20, False),
    "mla dims 96/64": (1, 2, 2, 40, 96, 64, True, 0, True),  # 192 / 128 halved: same padding
    # lengths a multiple of every block: no row masks on loads and stores
    "mha full, even": (1, 2, 2, 48, 32, 32, False, 0, False),
    "gqa causal, even, mla dims": (1, 4, 2, 64, 96, 64, True, 0, False),
}
# rows and keys per program as the GPU's candidates have them (forward and dQ: BLOCK_M twice
# BLOCK_N; dK/dV the reverse), instead of the interpreter's default 16 x 16
UNEQUAL_BLOCKS = {
    "_fwd": (32, 16), "_bwd_kv": (16, 32), "_bwd_kv_atomic": (16, 32), "_bwd_q": (32, 16),
    "_bwd_delta": (32, 0),
}  # fmt: skip


@pytest.fixture(params=fa.BACKWARDS)
def backward(request, monkeypatch):
    """Runs the test under each backward variant (LMFORGE_FLASH_BACKWARD)."""
    monkeypatch.setenv(fa.BACKWARD_ENV, request.param)
    return request.param


def inputs(B, Hq, Hkv, T, Dqk, Dv, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, T, Dqk, generator=g)
    k = torch.randn(B, Hkv, T, Dqk, generator=g)
    v = torch.randn(B, Hkv, T, Dv, generator=g)
    return [x.to(dtype).requires_grad_() for x in (q, k, v)]


def masks(B, T, causal, window, documents, seed=0):
    """(doc_ids or None, dense bool mask (B|1, 1, T, T) or None, first_key or None)."""
    g = torch.Generator().manual_seed(seed + 1)
    doc_ids = torch.randint(0, 4, (B, T), generator=g).sort(dim=1).values if documents else None
    if not causal:
        return doc_ids, None, None
    mask, _ = build_mask(T, 0, window=window, doc_ids=doc_ids)
    if mask is None:
        mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    starts = document_starts(doc_ids) if documents else None
    return doc_ids, mask, key_bounds(starts, window, T, torch.device("cpu"))


def reference(q, k, v, mask, scale):
    """fp64 softmax attention over the dense mask (None: every key)."""
    G = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    logits = (q.double() @ k.transpose(-1, -2)) * scale
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    return logits.softmax(-1) @ v


@pytest.mark.parametrize("case", CASES)
def test_outputs_gradients_and_max_logits_equal_the_references(case, backward):
    check_against_references(*CASES[case])


@pytest.mark.parametrize(
    "case", ["gqa documents + window, odd dims", "mha full, even", "gqa causal, even, mla dims"]
)
def test_unequal_row_and_key_blocks_give_the_same_results(case, backward, monkeypatch):
    """The loops' block arithmetic (diagonal and first-key ranges rounded to the other kernel's
    blocks, lengths a multiple of one block but not the other) with BLOCK_M != BLOCK_N."""
    monkeypatch.setattr(fa, "INTERPRETER_BLOCKS", UNEQUAL_BLOCKS)
    check_against_references(*CASES[case])


def check_against_references(B, Hq, Hkv, T, Dqk, Dv, causal, window, documents):
    q, k, v = inputs(B, Hq, Hkv, T, Dqk, Dv)
    _, mask, first_key = masks(B, T, causal, window, documents)
    out, max_logits = flash_attention(
        q, k, v, causal=causal, first_key=first_key, return_max_logits=True
    )
    assert out.shape == (B, Hq, T, Dv)
    assert out.transpose(1, 2).is_contiguous()  # heads merge for free afterwards
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = reference(*leaves, mask, Dqk**-0.5)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=2e-6)
    expected = max_logits_per_head(q, k, Dqk**-0.5, mask, False, 0)  # mask None: every key
    torch.testing.assert_close(max_logits, expected, rtol=1e-6, atol=2e-6)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad(out, (q, k, v), cotangent)
    ref_grads = torch.autograd.grad(ref, leaves, cotangent.double())
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=5e-6, msg=f"d{name}")


def test_bf16_inputs_give_bf16_outputs_and_gradients_close_to_fp32(backward):
    """bf16 in and out, fp32 inside (under the interpreter the dots multiply fp32 copies of the
    bf16 operands, see `_dot`): within bf16 rounding of the fp32 kernel."""
    q, k, v = inputs(2, 4, 2, 45, 32, 32, seed=4)
    _, _, first_key = masks(2, 45, True, 7, True)
    low = [x.detach().bfloat16().requires_grad_() for x in (q, k, v)]
    out = flash_attention(*low, first_key=first_key)
    ref = flash_attention(*(x.detach().bfloat16().float() for x in (q, k, v)), first_key=first_key)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    grads = torch.autograd.grad(out, low, cotangent.bfloat16())
    fp32 = [x.detach().bfloat16().float().requires_grad_() for x in (q, k, v)]
    ref_grads = torch.autograd.grad(flash_attention(*fp32, first_key=first_key), fp32, cotangent)
    for got, want in zip(grads, ref_grads, strict=True):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=5e-2, atol=5e-2)


def test_the_max_is_not_the_log_sum_exp():
    """What the kernel returns is the max logit, which the LSE overestimates by up to log(keys)."""
    q, k, v = inputs(1, 2, 2, 40, 32, 32, seed=1)
    _, max_logits = flash_attention(q, k, v, return_max_logits=True)
    logits = (q @ k.transpose(-1, -2)) / 32**0.5
    logits = logits.masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1), float("-inf"))
    lse = logits.logsumexp(-1).amax(dim=(0, 2))
    assert (lse > max_logits + 0.1).all()


@pytest.mark.parametrize("window", [0, 1, 6])
def test_key_bounds_are_the_dense_masks_first_key_and_last_row(window):
    """first_key[r] is the first True of the mask's row r, last_rows[c] the last True of column
    c: the two bounds the kernels loop between."""
    B, T = 3, 29
    _, mask, first_key = masks(B, T, True, window, True, seed=window)
    mask = mask[:, 0]  # (B, T, T)
    index = torch.arange(T)
    first = torch.where(mask, index, T).amin(dim=-1)
    last = torch.where(mask, index[:, None], -1).amax(dim=-2)
    assert torch.equal(first_key, first.int())
    assert torch.equal(last_rows(first_key), last.int())
    assert key_bounds(None, 0, T, torch.device("cpu")) is None
    assert torch.equal(
        key_bounds(None, 4, 6, torch.device("cpu")), torch.tensor([[0, 0, 0, 0, 1, 2]]).int()
    )


@pytest.mark.parametrize(
    ("shapes", "kwargs", "message"),
    [
        (((1, 3, 8, 32), (1, 2, 8, 32)), {}, "not a multiple"),
        (((1, 2, 8, 320), (1, 2, 8, 320)), {}, "head dim 320"),
        (((1, 2, 9, 32), (1, 2, 8, 32)), {}, "takes q"),  # fewer keys than queries
        (
            ((1, 2, 8, 32), (1, 2, 8, 32)),
            {"causal": False, "first_key": torch.zeros(1, 8).int()},
            "causal",
        ),
        (((1, 2, 8, 32), (1, 2, 8, 32)), {"first_key": torch.zeros(1, 8)}, "int32"),
    ],
)
def test_bad_inputs_are_refused_with_the_reason(shapes, kwargs, message):
    q, k = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        flash_attention(q, k, k, **kwargs)


def test_an_unknown_backward_variant_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv(fa.BACKWARD_ENV, "three_kernel")
    q = torch.zeros(1, 2, 8, 16)
    with pytest.raises(ValueError, match="expected one of two_kernel, single_pass") as error:
        flash_attention(q, q, q)
    assert "\n" not in str(error.value) and "'three_kernel'" in str(error.value)


def launch_args(dtype, T, n_keys, d_qk, d_v) -> dict:
    """The named arguments the autotuner's pruning reads: q and v (dtype, head dims), sizes."""
    q, v = torch.zeros(1, 1, 1, d_qk, dtype=dtype), torch.zeros(1, 1, 1, d_v, dtype=dtype)
    return {"Q": q, "V": v, "T": T, "n_keys": n_keys}


def blocks(configs: list) -> list[tuple]:
    """(BLOCK_M, BLOCK_N, warps, stages) of each triton.Config."""
    return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in configs]


@pytest.mark.parametrize("name", ["_fwd", "_bwd_kv", "_bwd_kv_atomic", "_bwd_q"])
def test_pruning_keeps_the_candidates_that_fit_the_dtype_memory_and_length(name):
    """Before tuning a shape, the autotuner drops the candidates of the other dtype, those whose
    shared memory estimate passes sm_90's (CPU: the limit defaults to Hopper's), and those with
    blocks longer than the sequence; at least one always remains."""
    prune = fa._pruner(name)
    candidates = fa._configs(name)

    def kept(dtype, T, n_keys, bd_qk, bd_v) -> list:
        return blocks(prune(candidates, launch_args(dtype, T, n_keys, bd_qk, bd_v)))

    def fits(c, bd_qk, bd_v, itemsize) -> bool:
        estimate = fa.shared_bytes_estimate(name, c[0], c[1], c[3], bd_qk, bd_v, itemsize)
        return estimate <= fa.SHARED_BYTES_SM90

    sixteen = fa.CONFIGS[name]["16-bit"]
    for bd_qk, bd_v in ((128, 128), (256, 128)):
        want = [c for c in sixteen if fits(c, bd_qk, bd_v, 2)]
        assert kept(torch.bfloat16, 4096, 4096, bd_qk, bd_v) == want and want
    assert kept(torch.float32, 4096, 4096, 256, 128) == list(fa.CONFIGS[name]["fp32"])
    short = [c for c in sixteen if c[0] <= 64 and c[1] <= 64 and fits(c, 64, 64, 2)]
    assert kept(torch.bfloat16, 60, 60, 64, 64) == short and short  # blocks of <= 64
    assert len(kept(torch.bfloat16, 1, 1, 256, 256)) == 1  # none fits: the smallest remains


def test_mla_dims_prune_the_forward_blocks_that_overflow_shared_memory():
    """128 x 128 forward blocks fit at head dim 128 in bf16 (229,376 bytes with 3 stages on
    sm_90, model/kernels/aot.py) but not at MLA's 192 (padded 256) / 128: 262,144 bytes."""
    prune = fa._pruner("_fwd")
    dense = prune(fa._configs("_fwd"), launch_args(torch.bfloat16, 4096, 4096, 128, 128))
    mla = prune(fa._configs("_fwd"), launch_args(torch.bfloat16, 4096, 4096, 192, 128))
    assert (128, 128, 8, 3) in blocks(dense)
    assert all(block_n < 128 for _, block_n, _, _ in blocks(mla))


def test_the_gpu_path_tunes_pruned_candidates_and_zeroes_the_atomic_dq_buffer(monkeypatch):
    """The GPU's launch path (triton.autotune over heuristics, the pruning called by this
    triton's autotuner, reset_to_zero of the fp32 dQ buffer) run by the interpreter, with a CPU
    stand-in for the benchmark: two candidates survive per kernel at T 64, each benchmarked
    once, so a dQ buffer not zeroed after tuning would hold three sums instead of one."""
    import functools

    from triton.runtime.autotuner import Autotuner

    if not isinstance(vars(Autotuner).get("do_bench"), (property, functools.cached_property)):
        pytest.skip("this triton's autotuner takes its benchmark otherwise")

    def bench(fn, quantiles=None, **_):
        fn()
        return [1.0, 1.0, 1.0]

    monkeypatch.setattr(Autotuner, "do_bench", property(lambda self: bench))
    q, k, v = inputs(1, 2, 1, 64, 16, 16, seed=6, dtype=torch.bfloat16)
    _, _, first_key = masks(1, 64, True, 20, False)  # a window: documents' code path

    def grads() -> tuple:
        out = flash_attention(q, k, v, first_key=first_key)
        return torch.autograd.grad(out, (q, k, v), cotangent.bfloat16())

    cotangent = torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(7))
    want = grads()
    monkeypatch.setenv(fa.BACKWARD_ENV, "single_pass")
    monkeypatch.setattr(fa, "_interpreting", lambda: False)  # the autotuned kernels
    monkeypatch.setattr(fa, "_precision", lambda dtype: "upcast")  # as the interpreter needs
    fa._kernels.cache_clear()
    try:
        got = grads()
        tuned = fa.tuned_configs()
    finally:
        fa._kernels.cache_clear()
    for name, a, b in zip("qkv", got, want, strict=True):  # bf16: other blocks, other roundings
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, msg=f"d{name}")
    assert {name for name, found in tuned.items() if found} == {"_fwd", "_bwd_kv_atomic"}
    assert "BLOCK_N: 64" in tuned["_bwd_kv_atomic"][0]["config"]  # the pruned list's blocks


def test_the_kernels_compile_for_hopper(tmp_path):
    """The interpreter runs the kernels as Python; Triton's compiler (front end, LLVM, ptxas, on
    the CPU) compiles them for sm_90 here (model/kernels/aot.py), with the alignment a GPU launch
    specializes on, and checks each fits an sm_90 block's shared memory and the estimate the
    autotuner's pruning trusts: per head-dim class (bf16 dims 128 with documents and even
    lengths, bf16 MLA 192/128, fp32 MLA) every attention kernel (dK/dV with and without atomic
    dQ) with its largest candidate that the pruning keeps, the delta kernel, and the fused
    training kernels (model/kernels/fused_triton.py) at a ~1B model's widths."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from model.kernels.aot import HOPPER_SHARED_BYTES, kernel_jobs

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "model.kernels.aot", "--arch", "90"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines()]
    jobs = kernel_jobs(90)
    assert [r["kernel"] for r in results] == [job[1] for job in jobs]
    assert sum("ATOMIC_DQ" in r["constants"] for r in results) == 6  # 3 classes x 2 variants
    for result in results:
        assert result["shared_bytes"] <= HOPPER_SHARED_BYTES, result
        assert result["shared_bytes"] <= result.get("estimate", result["shared_bytes"]), result
