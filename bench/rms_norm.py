"""RMSNorm forward + backward on CPU: the closed-form autograd function model/norms.py uses
(RMSNormFunction) against autograd through F.rms_norm and the weight's product (what it
replaced), interleaved in one process, on the tiny default model's fp32 stream (8 x 256 tokens,
width 256), a wider one, and a bf16 input. Also counted: the bytes each keeps for backward
(saved-tensor hooks), and the largest difference of outputs and gradients (the forward is the
same formula; the backward rounds differently).

    python bench/rms_norm.py
Writes bench/results/rms_norm_cpu.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.machine import machine
from model.norms import RMSNormFunction
from trainer.cpu_malloc import keep_freed_memory

EPS = 1e-5
CASES = [  # (name, tokens, width, input dtype)
    ("tiny default stream", 2048, 256, torch.float32),
    ("wider stream", 2048, 1024, torch.float32),
    ("bf16 input", 2048, 1024, torch.bfloat16),
]


def through_autograd(x: Tensor, w: Tensor) -> Tensor:
    """The form before issue 21: F.rms_norm in fp32, times the weight, cast back."""
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=EPS) * w.float()).to(x.dtype)


def closed_form(x: Tensor, w: Tensor) -> Tensor:
    return RMSNormFunction.apply(x, w, EPS)


FORMS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "autograd": through_autograd,
    "closed_form": closed_form,
}


def saved_bytes(form: Callable[[Tensor, Tensor], Tensor], x: Tensor, w: Tensor) -> int:
    """Bytes of the tensors autograd keeps for backward, leaves (x, w) not counted."""
    seen: list[Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        form(x, w)
    fresh = {t.data_ptr(): t for t in seen if t.data_ptr() not in (x.data_ptr(), w.data_ptr())}
    return sum(t.numel() * t.element_size() for t in fresh.values())


def run_case(tokens: int, width: int, dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(tokens, width, generator=gen) * 2).to(dtype)
    w = torch.randn(width, generator=gen).requires_grad_()
    dy = torch.randn(tokens, width, generator=gen).to(dtype)
    times: dict[str, list[float]] = {name: [] for name in FORMS}
    results = {}
    for _ in range(40):
        for name, form in FORMS.items():
            leaf = x.clone().requires_grad_()
            w.grad = None
            start = time.perf_counter()
            out = form(leaf, w)
            out.backward(dy)
            times[name].append(time.perf_counter() - start)
            results[name] = (out.detach(), leaf.grad, w.grad)
    ms = {name: 1000 * statistics.median(t[5:]) for name, t in times.items()}
    diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(*results.values())]
    leaf = x.clone().requires_grad_()
    return {
        "ms": ms,
        "speedup": ms["autograd"] / ms["closed_form"],
        "saved_bytes": {name: saved_bytes(form, leaf, w) for name, form in FORMS.items()},
        "max_abs_diff": dict(zip(("output", "grad_input", "grad_weight"), diffs)),
    }


def main() -> None:
    keep_freed_memory()  # as the trainer runs on CPU
    rows = []
    for name, tokens, width, dtype in CASES:
        row = {"case": name, "tokens": tokens, "width": width, "dtype": str(dtype)}
        row |= run_case(tokens, width, dtype)
        rows.append(row)
        ms, saved = row["ms"], row["saved_bytes"]
        print(f"{name:20s} autograd {ms['autograd']:.3f} ms, closed form {ms['closed_form']:.3f} "
              f"ms ({row['speedup']:.2f}x); saved {saved['autograd'] >> 10} KiB -> "
              f"{saved['closed_form'] >> 10} KiB; max diffs {row['max_abs_diff']}")  # fmt: skip
    report = {
        "benchmark": "rms_norm",
        "machine": machine(torch_threads=torch.get_num_threads()),
        "rows": rows,
    }
    out = ROOT / "bench" / "results" / "rms_norm_cpu.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
