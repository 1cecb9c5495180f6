"""Why the eager step's GEMMs take longer than bench/mfu_ceiling.py's bound says they need: each
GEMM call of one eager training step of the default model (8 x 256, bf16 autocast, the trainer's
engine) is recorded with its operands, grouped by (op, shapes, strides), and timed alone three
ways: as the step calls it; on contiguous copies of its operands (the copies not timed); and as
the transposed product (C^T = B^T A^T, the same FLOPs with the other operand layout). A group
whose call is much slower than its best layout names a layout the framework could change.

    python bench/gemm_layouts.py [--repeats 7]
Writes bench/results/gemm_layouts_cpu.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.machine import machine
from bench.mfu_ceiling import median_seconds
from bench.train_throughput import build

MM, BMM = torch.ops.aten.mm.default, torch.ops.aten.bmm.default
ADDMM, BADDBMM = torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default


class GemmRecorder(TorchDispatchMode):
    """Keeps (op, operand tensors, kwargs) of every GEMM call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (MM, BMM, ADDMM, BADDBMM):
            self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def operands(func, args) -> tuple[torch.Tensor, torch.Tensor]:
    """The two multiplied operands (addmm / baddbmm: the last two)."""
    return (args[1], args[2]) if func in (ADDMM, BADDBMM) else (args[0], args[1])


def layout(t: torch.Tensor) -> str:
    """'N' when the last dimension is contiguous, 'T' when the one before it is, else '?'."""
    if t.stride(-1) == 1:
        return "N"
    return "T" if t.stride(-2) == 1 else "?"


def transposed_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(B^T A^T)^T: the same product with each operand read in the other order."""
    return torch.matmul(b.transpose(-1, -2), a.transpose(-1, -2)).transpose(-1, -2)


def time_group(func, args, kwargs, repeats: int) -> dict:
    a, b = operands(func, args)
    ac, bc = a.contiguous(), b.contiguous()
    flops = 2 * a.shape[-2] * a.shape[-1] * b.shape[-1] * (a.shape[0] if a.dim() == 3 else 1)
    as_called = median_seconds(lambda: func(*args, **kwargs), repeats)
    contiguous = median_seconds(lambda: torch.matmul(ac, bc), repeats)
    flipped = median_seconds(lambda: transposed_product(a, b), repeats)
    return {
        "op": str(func).split(".")[-2],
        "a": list(a.shape),
        "b": list(b.shape),
        "layouts": layout(a) + layout(b),
        "dtype": str(a.dtype).removeprefix("torch."),
        "gflop": flops / 1e9,
        "as_called_ms": 1e3 * as_called,
        "contiguous_ms": 1e3 * contiguous,
        "transposed_product_ms": 1e3 * flipped,
        "as_called_gflops": flops / as_called / 1e9,
    }


def warm_default_step(warmups: int):
    """The trainer's eager step of the default model (8 x 256) and its batch, after `warmups`
    untimed steps."""
    step = build("lmforge")
    x = torch.randint(0, 8192, (8, 256))
    y = torch.randint(0, 8192, (8, 256))
    for _ in range(warmups):
        step(x, y)
    return step, x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    step, x, y = warm_default_step(2)
    recorder = GemmRecorder()
    with recorder:
        step(x, y)
    groups: dict[tuple, list] = collections.defaultdict(list)
    for func, call_args, kwargs in recorder.calls:
        a, b = operands(func, call_args)
        groups[(func, a.shape, a.stride(), b.shape, b.stride())].append((func, call_args, kwargs))
    rows = []
    for calls in groups.values():
        row = time_group(*calls[0], args.repeats)
        row["calls"] = len(calls)
        rows.append(row)
    rows.sort(key=lambda r: -r["as_called_ms"] * r["calls"])
    total = {
        key: sum(r[key] * r["calls"] for r in rows)
        for key in ("as_called_ms", "contiguous_ms", "transposed_product_ms")
    }
    total["best_ms"] = sum(
        min(r["as_called_ms"], r["contiguous_ms"], r["transposed_product_ms"]) * r["calls"]
        for r in rows
    )
    result = {"benchmark": "gemm_layouts", "machine": machine(), "args": vars(args)}
    result |= {"calls": len(recorder.calls), "total": total, "groups": rows}
    out = ROOT / "bench" / "results" / "gemm_layouts_cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'op':7} {'a':>16} {'b':>16} lay n  called  contig  transp  GFLOP/s")
    for r in rows:
        print(
            f"{r['op']:7} {r['a']!s:>16} {r['b']!s:>16} {r['layouts']:3} {r['calls']:2} "
            f"{r['as_called_ms']:7.2f} {r['contiguous_ms']:7.2f} {r['transposed_product_ms']:7.2f}"
            f"  {r['as_called_gflops']:6.0f}"
        )
    print(json.dumps(total, indent=2))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
