"""The MoE combine alone, forward + backward: out[t] = sum_j w[t, j] rows[slot_row[t, j]].

Three ways, on the same rows, slot indices and weights, stepping in turn round after round:
  embedding_bag   one fused gather + weighted sum (model/moe/slots.py `combine_slots`)
  gather_bmm      a gather of the N k rows, then a (1 x k) @ (k x C) product per token
  gather_mul_sum  a gather, a multiply by the weights, a sum over k (the combine before issue 21)
Shapes default to bench/moe_layer.py's E=64 case: N = 4096 tokens, k = 8, C = 512, bf16, and
P = 36608 expert output rows (the padded layout of that case). The process keeps freed memory
as the trainer does on CPU (trainer/cpu_malloc.py).

    python bench/moe_combine.py [--tokens 4096] [--top-k 8] [--d-model 512] [--repeats 15]
Writes bench/results/moe_combine_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.machine import machine
from model.moe.slots import combine_slots
from trainer.cpu_malloc import keep_freed_memory


def variants(rows: Tensor, slot_row: Tensor, w: Tensor) -> dict[str, Callable[[], Tensor]]:
    N, k = w.shape
    C = rows.shape[1]

    def gathered() -> Tensor:
        return rows.index_select(0, slot_row.reshape(-1)).view(N, k, C)

    return {
        "embedding_bag": lambda: combine_slots(rows, slot_row, w, None),
        "gather_bmm": lambda: torch.bmm(w.to(rows.dtype).unsqueeze(1), gathered()).squeeze(1),
        "gather_mul_sum": lambda: (gathered() * w.to(rows.dtype)[..., None]).sum(dim=1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--rows", type=int, default=36608)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    keep_freed_memory()
    N, k, C = args.tokens, args.top_k, args.d_model
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(args.rows, C, generator=g, dtype=torch.bfloat16, requires_grad=True)
    slot_row = torch.randperm(args.rows, generator=g)[: N * k].view(N, k)
    w = torch.rand(N, k, generator=g, requires_grad=True)
    grad = torch.randn(N, C, generator=g, dtype=torch.bfloat16)
    fns = variants(rows, slot_row, w)
    times: dict[str, list[float]] = {name: [] for name in fns}
    outs: dict[str, Tensor] = {}
    for step in range(args.repeats + 1):  # the first round warms up
        for name, fn in fns.items():
            rows.grad = w.grad = None
            start = time.perf_counter()
            out = fn()
            out.backward(grad)
            if step:
                times[name].append(time.perf_counter() - start)
            outs[name] = out.detach().float()
    reference = outs["gather_mul_sum"]
    results = []
    for name in fns:
        error = ((outs[name] - reference).norm() / reference.norm()).item()
        ms = statistics.median(times[name]) * 1e3
        results.append({"variant": name, "ms": ms, "rel_error_vs_mul_sum": error})
        print(f"{name:16s} {ms:7.1f} ms  rel. difference {error:.1e}")
    report = {
        "benchmark": "moe_combine",
        "args": vars(args),
        "dtype": "bf16",
        "machine": machine(("torch",), torch_threads=torch.get_num_threads()),
        "rows": results,
    }
    out = Path(__file__).parent / "results" / "moe_combine_cpu.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
