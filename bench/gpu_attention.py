"""The attention part of bench/gpu_check.py (issue 18): the Triton FlashAttention kernel
(model/kernels/flash_attention.py) checked, then timed against SDPA and FlexAttention.

Checks, bf16 inputs (B 2, T 4096, 16 query heads of 128 over 8 kv heads), each against an fp32
reference on the same inputs, next to SDPA's own bf16 error against it (the kernel should be as
close as SDPA is):
  dense       causal GQA: outputs, dQ, dK, dV; max logits vs the fp32 recomputation
              (model/mixers/qk_logits.py) and vs FlexAttention's max_scores
  documents   packed documents and a sliding window (per-row first keys) vs the dense mask
  mla         head dims 192 / 128 (DeepSeek-V3's), MHA
  dense_single_pass, mla_single_pass  the same with the single-pass backward (dQ summed by
              atomics, which only a GPU runs concurrently)
  cp_chunks   context parallelism's calls (cp = 4: 8 chunks; each rank's two chunks over the
              keys before their ends, bottom-right aligned, with documents and a window) vs the
              same rows of one whole call: outputs and gradients
Timing (issue 60), causal bf16, per shape: dense GQA (16 query heads of 128 over 8 kv heads) at
T 4096 (B 4, the target's shape, first) and T 16384 (B 1), and MLA's head dims 192 / 128 (MHA,
16 heads, T 4096, B 2). Each implementation is its own sub-case (a failure or the time budget
skips only it): the Triton kernel with its max logits, SDPA's cuDNN and FlashAttention-2
kernels forced (a refusal recorded with SDPA's reasons), the kernel without max logits, the
kernel's single-pass backward (atomic dQ, LMFORGE_FLASH_BACKWARD=single_pass), FlexAttention
compiled (CUDA only); on the first shape also Flex with its max scores and SDPA followed by the
max-logit recomputation (what QK-clip costs without the kernel). Each is timed as the training
forward alone and forward + backward; the backward is their difference. Milliseconds, TFLOP/s
per phase (causal: 2 B H T^2 (Dqk + Dv) / 2 forward, 2.5x that backward), and per shape the
ratio of the kernel with max logits to the fastest SDPA kernel per phase (the target: <= 1.2 on
forward + backward at T 4096, D 128). Then, on the first shape, packed documents (the kernel's
block skipping vs SDPA's dense mask vs FlexAttention's block mask) and context parallelism's
chunked calls per cp = 4 rank against the whole call; last, the block sizes the autotuner chose
for each kernel and shape.

`small=True` runs the same code on tiny shapes (a CPU dry run under Triton's interpreter).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model.kernels.flash_attention import BACKWARD_ENV, flash_attention, key_bounds, tuned_configs
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

    def forward_flops(self, causal: bool = True) -> float:
        """Forward FLOPs of attention (QK^T and PV; causal: half); the backward's are 2.5x."""
        return 2 * self.B * self.Hq * self.T**2 * (self.Dqk + self.Dv) * (0.5 if causal else 1.0)


def shapes(small: bool) -> dict[str, Shape]:
    if small:
        return {
            "check": Shape(1, 2, 1, 48, 32, 32),
            "mla": Shape(1, 2, 2, 40, 48, 32),
        }
    return {
        "check": Shape(2, 16, 8, 4096, 128, 128),
        "mla": Shape(2, 16, 16, 4096, 192, 128),
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
    for name, shape in (("dense", check), ("mla", sizes["mla"])):  # atomic dQ: races show here

        def single_pass(shape=shape) -> dict:
            with flash_backward("single_pass"):
                return compare(shape, device)

        sub_case(results, f"{name}_single_pass", single_pass, 40)
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


@contextlib.contextmanager
def flash_backward(variant: str):
    """The kernel's backward variant (LMFORGE_FLASH_BACKWARD, read at each call) inside."""
    before = os.environ.get(BACKWARD_ENV)
    os.environ[BACKWARD_ENV] = variant
    try:
        yield
    finally:
        if before is None:
            del os.environ[BACKWARD_ENV]
        else:
            os.environ[BACKWARD_ENV] = before


def timing_shapes(small: bool) -> dict[str, Shape]:
    """The timed shapes, the issue's target (T 4096, D 128) first; tiny stand-ins when small
    (head dims off a power of two where MLA's are)."""
    if small:
        return {
            "dense_t4096_d128": Shape(1, 2, 1, 32, 16, 16),
            "dense_t16384_d128": Shape(1, 2, 1, 48, 16, 16),
            "mla_t4096": Shape(1, 2, 2, 32, 24, 16),
        }
    return {
        "dense_t4096_d128": Shape(4, 16, 8, 4096, 128, 128),
        "dense_t16384_d128": Shape(1, 16, 8, 16384, 128, 128),
        "mla_t4096": Shape(2, 16, 16, 4096, 192, 128),
    }


def implementations(shape: Shape, device: str, main: bool) -> list[tuple]:
    """(name, attend(q, k, v) -> out or (out, max logits), context, need_s), in the order they
    run: ours with max logits and SDPA's kernels first (the target's ratio), then the rest;
    FlexAttention (compiled) on CUDA only; on the main shape also Flex with its max scores and
    SDPA with the max logits recomputed (what QK-clip costs without a kernel)."""
    scale = shape.Dqk**-0.5
    null = contextlib.nullcontext
    backends = ("CUDNN_ATTENTION", "FLASH_ATTENTION") if device == "cuda" else ("default",)
    cases = [
        ("triton_max_logits", lambda *x: flash_attention(*x, return_max_logits=True), null, 60)
    ]
    cases += [(f"sdpa_{b.lower()}", sdpa, lambda b=b: sdpa_backend(b), 20) for b in backends]
    cases += [
        ("triton", flash_attention, null, 20),
        (
            "triton_max_logits_single_pass",
            lambda *x: flash_attention(*x, return_max_logits=True),
            lambda: flash_backward("single_pass"),
            60,
        ),
    ]
    if device == "cuda":
        cases.append(("flex", flex_call(shape, device, max_scores=False), null, 90))
        if main:
            cases.append(("flex_max_scores", flex_call(shape, device, max_scores=True), null, 90))
    if main:

        def sdpa_and_recompute(q, k, v):
            max_logits_per_head(q, k, scale, None, True, 0)
            return sdpa(q, k, v)

        cases.append(("sdpa_plus_recompute", sdpa_and_recompute, null, 30))
    return cases


def flex_call(shape: Shape, device: str, max_scores: bool) -> Callable:
    """Compiled FlexAttention with a causal block mask (built at the first call, inside its
    sub-case); with `max_scores` also its (Hq,) max logits."""
    state: dict = {}

    def attend(q, k, v):
        from torch.nn.attention.flex_attention import AuxRequest

        from model.mixers.attention_backend import _compiled_flex, flex_block_mask

        if not state:
            state["mask"] = flex_block_mask(None, 0, shape.B, shape.T, torch.device(device))
        flex = _compiled_flex()
        if not max_scores:
            return flex(q, k, v, block_mask=state["mask"], enable_gqa=True)
        aux = AuxRequest(max_scores=True)
        out, aux = flex(q, k, v, block_mask=state["mask"], enable_gqa=True, return_aux=aux)
        return out, aux.max_scores.amax(dim=(0, 2))

    return attend


def forward_only(attend: Callable, leaves: list[torch.Tensor]) -> None:
    """The training forward alone: leaves that require grad (what the backward needs is kept)."""
    attend(*[x.detach().requires_grad_() for x in leaves])


REFUSALS = ("No available kernel", "No viable backend")  # SDPA with a backend it cannot use


def measure(shape: Shape, tensors: tuple, attend: Callable, context: Callable, timed) -> dict:
    """Forward, forward + backward (timed apart), the backward as their difference; TFLOP/s of
    each. A backend that refuses the inputs (SDPA: REFUSALS) is recorded with the reasons it
    warned of."""
    q, k, v, cot = tensors

    def forward() -> None:
        with context():
            forward_only(attend, [q, k, v])

    def both() -> None:
        with context():
            fwd_bwd(attend, [q, k, v], cot)

    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        try:
            result = {"forward": timed(forward), "forward_backward": timed(both)}
        except RuntimeError as error:
            if not any(text in str(error) for text in REFUSALS):
                raise
            reasons = sorted({str(w.message)[:300] for w in warned})
            return {"refused": str(error)[:300], "reasons": reasons}
    forward_ms = result["forward"]["median_ms"]
    total_ms = result["forward_backward"]["median_ms"]
    result["backward_ms"] = round(total_ms - forward_ms, 3)
    flops = shape.forward_flops()
    result["tflops"] = {
        "forward": tflops(flops, forward_ms),
        "backward": tflops(2.5 * flops, result["backward_ms"]),
        "forward_backward": tflops(3.5 * flops, total_ms),
    }
    return result


def tflops(flops: float, ms: float) -> float | None:
    return round(flops / (ms * 1e-3) / 1e12, 1) if ms > 0 else None  # None: noise (dry runs)


def ratios(results: dict) -> dict:
    """Ours with max logits over the fastest SDPA kernel (the issue's target: <= 1.2 on the
    forward + backward at T 4096, D 128), per phase; {} without both."""
    ours = results.get("triton_max_logits", {})
    sdpa_runs = [
        r
        for name, r in results.items()
        if name.startswith("sdpa_") and name != "sdpa_plus_recompute" and "forward" in r
    ]
    if "forward" not in ours or not sdpa_runs:
        return {}
    best = min(sdpa_runs, key=lambda r: r["forward_backward"]["median_ms"])
    pairs = {
        "forward": (ours["forward"]["median_ms"], best["forward"]["median_ms"]),
        "backward": (ours["backward_ms"], best["backward_ms"]),
        "forward_backward": (
            ours["forward_backward"]["median_ms"],
            best["forward_backward"]["median_ms"],
        ),
    }
    return {phase: round(a / b, 3) if b > 0 else None for phase, (a, b) in pairs.items()}


def shape_timings(shape: Shape, device: str, timed: Callable, sub_case: Callable, main: bool):
    """Every implementation on one shape (each its own sub-case), then the ratios."""
    q, k, v = inputs(shape, device, seed=1)
    cot = torch.randn(shape.B, shape.Hq, shape.T, shape.Dv, device=device, dtype=torch.bfloat16)
    results: dict = {"shape": vars(shape)}
    for name, attend, context, need_s in implementations(shape, device, main):
        sub_case(
            results,
            name,
            lambda a=attend, c=context: measure(shape, (q, k, v, cot), a, c, timed),
            need_s,
        )
    results["triton_max_logits_over_best_sdpa"] = ratios(results)
    return results, (q, k, v, cot)


def timing_cases(small: bool, device: str, timed: Callable, sub_case: Callable) -> dict:
    """Forward and forward + backward of each implementation on each timing shape (the issue's
    T 4096, D 128 first), with per-phase TFLOP/s and ours over the fastest SDPA; then packed
    documents and context parallelism's chunks on the first shape; the autotuner's choices."""
    results: dict = {}
    main_tensors = None
    for i, (label, shape) in enumerate(timing_shapes(small).items()):
        results[label], tensors = shape_timings(shape, device, timed, sub_case, main=i == 0)
        main_tensors = main_tensors or (shape, tensors)
    shape, (q, k, v, cot) = main_tensors
    results["documents"] = document_timings(shape, device, timed, sub_case, q, k, v, cot)
    sub_case(results, "cp_chunks", lambda: chunk_timings(shape, timed, q, k, v, cot), 60)
    results["tuned_configs"] = tuned_configs()
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
