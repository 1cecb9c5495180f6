"""The fused-kernel part of bench/gpu_check.py (issue 18): each Triton training kernel
(model/kernels/fused.py) checked against the torch op, then timed (forward + backward) against the
torch op eager and under torch.compile, which already generates fused Triton for these chains.
A kernel "beats compile" when its median is below the compiled op's; model.kernels should turn on
only those. Shapes of a ~1B model's step: N = 16384 tokens, C 2048, 16 heads of 128, F 8192.

Also the fused linear + cross-entropy's peak memory at vocab 128256 (C 2048, 8192 tokens, bf16):
logits materialized (h W^T then F.cross_entropy) against model/loss.py's chunked form (the
default, chunk 4096) and liger-kernel's when installed (issue 18's target: >= 3x less memory).

`small=True` runs the same code on tiny shapes (a CPU dry run under Triton's interpreter).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from model.kernels.fused import rms_norm, rope, swiglu
from model.mixers.rope import apply_rope_half, apply_rope_interleaved, base_inv_freq, rope_rotations


def sizes(small: bool) -> dict:
    if small:
        return dict(B=2, T=16, C=64, H=4, D=16, F=96, V=512, N_CE=64, chunk=16)
    return dict(B=4, T=4096, C=2048, H=16, D=128, F=8192, V=128256, N_CE=8192, chunk=4096)


def torch_rms_norm(x, w, residual=None):
    h = x if residual is None else x + residual
    return (F.rms_norm(h.float(), (h.shape[-1],), eps=1e-5) * w.float()).to(x.dtype)


def ops(small: bool, device: str) -> dict[str, tuple[Callable, Callable, list]]:
    """name -> (kernel, torch op, bf16 inputs), on the step's shapes."""
    s = sizes(small)
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=device, generator=gen).to(dtype)

    N = s["B"] * s["T"]
    x, r, w = rand(N, s["C"]), rand(N, s["C"]), rand(s["C"], dtype=torch.float32)
    q = rand(s["B"], s["T"], s["H"], s["D"])
    positions = torch.arange(s["T"], device=device).expand(s["B"], -1)
    rot = rope_rotations(positions, base_inv_freq(10000.0, s["D"]).to(device), 1.0)
    gate, up = rand(N, s["F"]), rand(N, s["F"])
    return {
        "rms_norm": (lambda a, b: rms_norm(a, b, 1e-5), torch_rms_norm, [x, w]),
        "add_rms_norm": (lambda a, b, c: rms_norm(a, c, 1e-5, residual=b)[0], lambda a, b, c: torch_rms_norm(a, c, b), [x, r, w]),
        "rope_half": (lambda a: rope(a, rot, False), lambda a: apply_rope_half(a, rot), [q]),
        "rope_interleaved": (lambda a: rope(a, rot, True), lambda a: apply_rope_interleaved(a, rot), [q]),
        "swiglu": (swiglu, lambda a, b: F.silu(a) * b, [gate, up]),
    }  # fmt: skip


def fwd_bwd(fn: Callable, leaves: list[torch.Tensor], cotangent: torch.Tensor | None = None):
    leaves = [t.detach().requires_grad_() for t in leaves]
    out = fn(*leaves)
    cot = cotangent if cotangent is not None else torch.ones_like(out)
    return (out.detach(), *torch.autograd.grad(out, leaves, cot))


def kernel_case(
    kernel: Callable, reference: Callable, leaves: list, timed: Callable, small: bool
) -> dict:
    cot = torch.randn_like(reference(*leaves))
    got, want = fwd_bwd(kernel, leaves, cot), fwd_bwd(reference, leaves, cot)
    errors = [
        ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()
        for a, b in zip(got, want)
    ]
    result = {"max_rel_error": max(errors), "ok": max(errors) < 2e-2}
    compiled = torch.compile(reference)
    result["eager"] = timed(lambda: fwd_bwd(reference, leaves, cot))
    result["compiled"] = timed(lambda: fwd_bwd(compiled, leaves, cot))
    result["triton"] = timed(lambda: fwd_bwd(kernel, leaves, cot))
    result["beats_compile"] = result["triton"]["median_ms"] < result["compiled"]["median_ms"]
    return result


def fused_kernels(small: bool, device: str, timed: Callable, sub_case: Callable) -> dict:
    results: dict = {"sizes": sizes(small)}
    for name, (kernel, reference, leaves) in ops(small, device).items():
        sub_case(
            results,
            name,
            lambda k=kernel, r=reference, x=leaves: kernel_case(k, r, x, timed, small),
            30,
        )
    return results


def cross_entropy_memory(small: bool, device: str, timed: Callable, sub_case: Callable) -> dict:
    """Peak memory and time of the head + cross-entropy, forward + backward, three ways."""
    from model.loss import chunked_cross_entropy

    s = sizes(small)
    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(s["N_CE"], s["C"], device=device, generator=gen).bfloat16()
    weight = (torch.randn(s["V"], s["C"], device=device, generator=gen) * 0.02).bfloat16()
    targets = torch.randint(0, s["V"], (s["N_CE"],), device=device, generator=gen)

    def unfused(h_, w_):
        return F.cross_entropy((h_ @ w_.T).float(), targets)

    def chunked(h_, w_):
        return chunked_cross_entropy(h_, w_, targets, s["chunk"])

    def run(fn) -> Callable:
        return lambda: fwd_bwd(fn, [h, weight])

    results: dict = {"tokens": s["N_CE"], "vocab": s["V"], "width": s["C"]}
    loss_ref, loss_chunked = unfused(h, weight).item(), chunked(h, weight).item()
    results["loss_abs_diff"] = abs(loss_ref - loss_chunked)
    sub_case(results, "unfused", lambda: timed(run(unfused), warmup=1, repeats=3), 20)
    sub_case(results, "chunked", lambda: timed(run(chunked), warmup=1, repeats=3), 20)
    for chunk in (s["chunk"] // 4, s["chunk"] // 2):  # smaller chunks: the peak and the time
        fn = lambda h_, w_, chunk=chunk: chunked_cross_entropy(h_, w_, targets, chunk)  # noqa: E731
        sub_case(results, f"chunked_{chunk}", lambda fn=fn: timed(run(fn), warmup=1, repeats=3), 20)
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        results["liger"] = {"skipped": "liger-kernel is not installed"}
    else:
        liger = LigerFusedLinearCrossEntropyLoss()
        sub_case(
            results,
            "liger",
            lambda: timed(run(lambda h_, w_: liger(w_, h_, targets)), warmup=1, repeats=3),
            20,
        )
    unfused_mib = results["unfused"].get("peak_mib")
    if unfused_mib and results["chunked"].get("peak_mib"):
        results["unfused_over_chunked_memory"] = round(
            unfused_mib / results["chunked"]["peak_mib"], 2
        )
    return results
