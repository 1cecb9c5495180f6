"""The attention part of bench/gpu_check.py (issue 18): the Triton FlashAttention kernel
(model/kernels/flash_attention.py) checked, then timed against SDPA and FlexAttention.

Checks, bf16 inputs (B 2, T 4096, 16 query heads of 128 over 8 kv heads), each against an fp32
reference on the same inputs, next to SDPA's own bf16 error against it (the kernel should be as
close as SDPA is):
  dense       causal GQA: outputs, dQ, dK, dV; max logits vs the fp32 recomputation
              (model/mixers/qk_logits.py) and vs FlexAttention's max_scores
  documents   packed documents and a sliding window (per-row first keys) vs the dense mask
  mla         head dims 192 / 128 (DeepSeek-V3's), MHA
  cp_chunks   context parallelism's calls (cp = 4: 8 chunks; each rank's two chunks over the
              keys before their ends, bottom-right aligned, with documents and a window) vs the
              same rows of one whole call: outputs and gradients
Timing, forward + backward (B 4, T 4096, same heads): SDPA as dispatched, SDPA's cuDNN and
FlashAttention-2 kernels forced, FlexAttention compiled, the Triton kernel without and with its
max logits, SDPA followed by the max-logit recomputation (what QK-clip costs without the kernel);
milliseconds, TFLOP/s (causal: 2 B H T^2 D forward, 2.5x that backward), and the ratio of the
Triton kernel with max logits to the fastest SDPA (issue 18's target: <= 1.3). Also with
documents: the kernel's block skipping vs SDPA's dense mask vs FlexAttention's block mask; and
context parallelism's chunked calls per cp = 4 rank (their spread: the head-tail balance) against
the whole call.

`small=True` runs the same code on a tiny shape (a CPU dry run under Triton's interpreter).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model.kernels.flash_attention import flash_attention, key_bounds
from model.mixers.masks import build_mask, document_starts
from model.mixers.qk_logits import max_logits_per_head


@dataclass(frozen=True)
class Shape:
    B: int
    Hq: int
    Hkv: int
    T: int
    Dqk: int
    Dv: int

    def flops(self, causal: bool = True) -> float:
        """Forward + backward FLOPs of attention (QK^T and PV; the backward 2.5x the forward)."""
        forward = 2 * self.B * self.Hq * self.T**2 * (self.Dqk + self.Dv)
        return 3.5 * forward * (0.5 if causal else 1.0)


def shapes(small: bool) -> dict[str, Shape]:
    if small:
        return {
            "check": Shape(1, 4, 2, 48, 32, 32),
            "mla": Shape(1, 2, 2, 40, 48, 32),
            "time": Shape(1, 4, 2, 64, 32, 32),
        }
    return {
        "check": Shape(2, 16, 8, 4096, 128, 128),
        "mla": Shape(2, 16, 16, 4096, 192, 128),
        "time": Shape(4, 16, 8, 4096, 128, 128),
    }


def inputs(shape: Shape, device: str, dtype=torch.bfloat16, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    dims = ((shape.Hq, shape.Dqk), (shape.Hkv, shape.Dqk), (shape.Hkv, shape.Dv))
    return [
        torch.randn(shape.B, h, shape.T, d, device=device, generator=gen, dtype=dtype)
        for h, d in dims
    ]


def documents(shape: Shape, device: str) -> torch.Tensor:
    """(B, T) document ids: row 0 in five uneven documents, the others in two."""
    doc_ids = torch.zeros(shape.B, shape.T, dtype=torch.long, device=device)
    for cut in (0.1, 0.35, 0.4, 0.8):
        doc_ids[0, int(cut * shape.T) :] += 1
    doc_ids[1:, shape.T // 2 :] = 1
    return doc_ids


def sdpa(q, k, v, mask=None):
    """SDPA with GQA (kv heads repeated where a mask needs the memory-efficient kernel)."""
    G = q.shape[1] // k.shape[1]
    if mask is not None and G > 1:
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=G > 1 and mask is None
    )


def fwd_bwd(attend: Callable, leaves: list[torch.Tensor], cotangent: torch.Tensor):
    """(out, dq, dk, dv) of attend(*leaves) against the cotangent."""
    leaves = [x.detach().requires_grad_() for x in leaves]
    out = attend(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    return (out.detach(), *torch.autograd.grad(out, leaves, cotangent.to(out.dtype)))


def relative_errors(got: tuple, ref: tuple, names=("out", "dq", "dk", "dv")) -> dict:
    return {
        name: ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
        for name, a, b in zip(names, got, ref)
    }


def compare(shape: Shape, device: str, mask=None, first_key=None) -> dict:
    """The kernel's and SDPA's bf16 errors against SDPA in fp32 on the same inputs, and the max
    logits against the fp32 recomputation."""
    q, k, v = inputs(shape, device)
    cot = torch.randn(shape.B, shape.Hq, shape.T, shape.Dv, device=device, dtype=torch.bfloat16)
    reference = fwd_bwd(lambda *x: sdpa(*x, mask), [x.float() for x in (q, k, v)], cot.float())
    kernel = fwd_bwd(lambda *x: flash_attention(*x, first_key=first_key), [q, k, v], cot)
    sdpa_bf16 = fwd_bwd(lambda *x: sdpa(*x, mask), [q, k, v], cot)
    _, max_logits = flash_attention(q, k, v, first_key=first_key, return_max_logits=True)
    scale = shape.Dqk**-0.5
    recomputed = max_logits_per_head(q, k, scale, mask, mask is None, 0)
    result = {
        "triton_rel_error": relative_errors(kernel, reference),
        "sdpa_bf16_rel_error": relative_errors(sdpa_bf16, reference),
        "max_logits_abs_diff": (max_logits - recomputed).abs().max().item(),
        "max_logits_range": [recomputed.min().item(), recomputed.max().item()],
    }
    # bf16 attention: within 2% of the largest value (bf16's epsilon is 0.8%); SDPA's own error
    # stands beside it for comparison
    result["ok"] = max(result["triton_rel_error"].values()) < 2e-2
    result["ok"] &= result["max_logits_abs_diff"] <= 1e-3 * recomputed.abs().max().item()
    return result


def flex_max_scores(q, k, block_mask) -> torch.Tensor:
    from torch.nn.attention.flex_attention import AuxRequest

    from model.mixers.attention_backend import _compiled_flex

    _, aux = _compiled_flex()(
        q, k, k, block_mask=block_mask, enable_gqa=True, return_aux=AuxRequest(max_scores=True)
    )
    return aux.max_scores.amax(dim=(0, 2))


def check_cases(small: bool, device: str, sub_case: Callable) -> dict:
    """sub_case(results, name, fn, need_s) runs fn into results[name] (errors recorded)."""
    results: dict = {}
    sizes = shapes(small)
    check = sizes["check"]
    sub_case(results, "dense", lambda: compare(check, device), 40)
    doc_ids = documents(check, device)
    window = check.T // 4

    def docs() -> dict:
        mask, _ = build_mask(check.T, 0, window=window, doc_ids=doc_ids, device=device)
        first_key = key_bounds(document_starts(doc_ids), window, check.T, torch.device(device))
        return compare(check, device, mask=mask, first_key=first_key) | {"window": window}

    sub_case(results, "documents", docs, 40)
    sub_case(results, "mla", lambda: compare(sizes["mla"], device), 40)
    sub_case(results, "cp_chunks", lambda: chunks_match_whole(check, device, window), 40)
    if device == "cuda":

        def flex_agrees() -> dict:
            from model.mixers.attention_backend import flex_block_mask

            q, k, _ = inputs(check, device)
            _, kernel_max = flash_attention(q, k, k, return_max_logits=True)
            block_mask = flex_block_mask(None, 0, check.B, check.T, torch.device(device))
            diff = (kernel_max - flex_max_scores(q, k, block_mask)).abs().max().item()
            return {"abs_diff": diff, "ok": diff <= 1e-3 * kernel_max.abs().max().item()}

        sub_case(results, "max_logits_vs_flex", flex_agrees, 60)
    return results


def sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "default":
        return contextlib.nullcontext()
    return sdpa_kernel(getattr(SDPBackend, name))


def timing_cases(small: bool, device: str, timed: Callable, sub_case: Callable) -> dict:
    """Forward + backward of each implementation on the timing shape (dense causal, then with
    documents); each entry: ms, TFLOP/s."""
    shape = shapes(small)["time"]
    q, k, v = inputs(shape, device, seed=1)
    cot = torch.randn(shape.B, shape.Hq, shape.T, shape.Dv, device=device, dtype=torch.bfloat16)
    scale = shape.Dqk**-0.5
    results: dict = {"shape": vars(shape)}

    def measure(attend: Callable, context=contextlib.nullcontext) -> dict:
        def run():
            with context():
                fwd_bwd(attend, [q, k, v], cot)

        numbers = timed(run)
        numbers["tflops"] = round(shape.flops() / (numbers["median_ms"] * 1e-3) / 1e12, 1)
        return numbers

    for backend in (
        ("default", "CUDNN_ATTENTION", "FLASH_ATTENTION") if device == "cuda" else ("default",)
    ):
        sub_case(
            results,
            f"sdpa_{backend.lower()}",
            lambda b=backend: measure(sdpa, lambda: sdpa_backend(b)),
            20,
        )
    sub_case(results, "triton", lambda: measure(flash_attention), 60)
    sub_case(
        results,
        "triton_max_logits",
        lambda: measure(lambda *x: flash_attention(*x, return_max_logits=True)),
        20,
    )

    def sdpa_and_recompute(q_, k_, v_):
        max_logits_per_head(q_, k_, scale, None, True, 0)
        return sdpa(q_, k_, v_)

    sub_case(results, "sdpa_plus_recompute", lambda: measure(sdpa_and_recompute), 30)
    if device == "cuda":
        from model.mixers.attention_backend import _compiled_flex, flex_block_mask

        block_mask = flex_block_mask(None, 0, shape.B, shape.T, torch.device(device))
        flex = _compiled_flex()
        sub_case(
            results,
            "flex",
            lambda: measure(lambda *x: flex(*x, block_mask=block_mask, enable_gqa=True)),
            90,
        )
    sdpa_ms = [
        v["median_ms"]
        for name, v in results.items()
        if name.startswith("sdpa_") and name != "sdpa_plus_recompute" and "median_ms" in v
    ]
    if sdpa_ms and "median_ms" in results.get("triton_max_logits", {}):
        results["triton_max_logits_over_best_sdpa"] = round(
            results["triton_max_logits"]["median_ms"] / min(sdpa_ms), 3
        )
    results["documents"] = document_timings(shape, device, timed, sub_case, q, k, v, cot)
    sub_case(results, "cp_chunks", lambda: chunk_timings(shape, timed, q, k, v, cot), 60)
    return results


CP = 4  # context-parallel ranks simulated on one GPU: 2 CP head-tail chunks of the sequence


def rank_chunks(T: int, rank: int) -> list[tuple[int, int]]:
    """[(start, end)] of the two chunks rank `rank` keeps (parallel/context_parallel.py)."""
    c = T // (2 * CP)
    return [(j * c, (j + 1) * c) for j in (rank, 2 * CP - 1 - rank)]


def chunk_call(q, k, v, start, end, first_key=None):
    """The kernel on queries [start, end) over keys [0, end), as a cp rank calls it."""
    return flash_attention(q[:, :, start:end], k[:, :, :end], v[:, :, :end], first_key=first_key)


def chunks_match_whole(shape: Shape, device: str, window: int) -> dict:
    """Every chunk's outputs and its queries' gradients against the same rows of one whole call
    (documents and a window: per-row first keys from the global positions)."""
    q, k, v = inputs(shape, device)
    starts = document_starts(documents(shape, device))
    whole_first = key_bounds(starts, window, shape.T, torch.device(device))
    cot = torch.randn(shape.B, shape.Hq, shape.T, shape.Dv, device=device, dtype=q.dtype)
    want = fwd_bwd(lambda *x: flash_attention(*x, first_key=whole_first), [q, k, v], cot)
    worst = {"out": 0.0, "dq": 0.0}
    for rank in range(CP):
        for start, end in rank_chunks(shape.T, rank):
            first = key_bounds(
                starts, window, shape.T, torch.device(device), rows=slice(start, end)
            )
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            out = chunk_call(*leaves, start, end, first)
            dq = torch.autograd.grad(out, leaves[0], cot[:, :, start:end])[0][:, :, start:end]
            for name, got, ref in (("out", out, want[0]), ("dq", dq, want[1])):
                rows = ref[:, :, start:end].float()
                error = ((got.float() - rows).norm() / rows.norm()).item()
                worst[name] = max(worst[name], error)
    return {"max_relative_error": worst, "ok": max(worst.values()) <= 1e-2}


def chunk_timings(shape: Shape, timed: Callable, q, k, v, cot) -> dict:
    """Forward + backward of each simulated cp rank's two chunk calls (the ranks' work should be
    even: head-tail chunks), against the whole sequence's call."""
    results = {"cp": CP, "whole": timed(lambda: fwd_bwd(flash_attention, [q, k, v], cot))}
    for rank in range(CP):

        def both_chunks(rank=rank) -> None:
            for start, end in rank_chunks(shape.T, rank):
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                out = chunk_call(*leaves, start, end)
                torch.autograd.grad(out, leaves, cot[:, :, start:end])

        results[f"rank{rank}"] = timed(both_chunks)
    ranks = [results[f"rank{r}"]["median_ms"] for r in range(CP)]
    results["slowest_over_fastest_rank"] = round(max(ranks) / min(ranks), 3)
    results["ranks_sum_over_whole"] = round(sum(ranks) / results["whole"]["median_ms"], 3)
    return results


def document_timings(shape, device, timed, sub_case, q, k, v, cot) -> dict:
    """Packed documents (row 0 in five, the others in two): the kernel skips the blocks outside
    each document; SDPA reads a dense (B, 1, T, T) mask; Flex a block mask."""
    doc_ids = documents(shape, device)
    mask, _ = build_mask(shape.T, 0, doc_ids=doc_ids, device=device)
    first_key = key_bounds(document_starts(doc_ids), 0, shape.T, torch.device(device))
    results: dict = {}
    sub_case(
        results,
        "triton",
        lambda: timed(
            lambda: fwd_bwd(lambda *x: flash_attention(*x, first_key=first_key), [q, k, v], cot)
        ),
        60,
    )
    sub_case(
        results,
        "sdpa_dense_mask",
        lambda: timed(lambda: fwd_bwd(lambda *x: sdpa(*x, mask), [q, k, v], cot)),
        20,
    )
    if device == "cuda":
        from model.mixers.attention_backend import _compiled_flex, flex_block_mask

        block_mask = flex_block_mask(
            document_starts(doc_ids), 0, shape.B, shape.T, torch.device(device)
        )
        flex = _compiled_flex()
        sub_case(
            results,
            "flex",
            lambda: timed(
                lambda: fwd_bwd(
                    lambda *x: flex(*x, block_mask=block_mask, enable_gqa=True), [q, k, v], cot
                )
            ),
            90,
        )
    return results
