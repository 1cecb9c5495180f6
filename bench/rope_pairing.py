"""RoPE's half pairing on the tiny default model's queries and keys (8 x 256 tokens, 4 query and
2 kv heads of 64, bf16), forward + backward: the whole-head form model/rope.py uses
(x cos + (-x2, x1) sin) against the per-half formula it replaced (x1 cos - x2 sin,
x2 cos + x1 sin), interleaved in one process; both give bitwise the same numbers (checked here
and in tests/model/test_rope.py).

    python bench/rope_pairing.py
Writes bench/results/rope_pairing_cpu.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.machine import machine
from model.rope import apply_rope_half, base_inv_freq, cos_sin, rope_rotations
from trainer.cpu_malloc import keep_freed_memory


def per_half(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """The formula before issue 21: each half rotated separately, then concatenated."""
    r = 2 * rot.shape[-1]
    cos, sin = cos_sin(rot)
    x1, x2 = x[..., : r // 2].float(), x[..., r // 2 : r].float()
    a, b = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return torch.cat([a.to(x.dtype), b.to(x.dtype), x[..., r:]], dim=-1)


def main() -> None:
    keep_freed_memory()  # as the trainer runs on CPU
    B, T, D = 8, 256, 64
    rot = rope_rotations(torch.arange(T).expand(B, T), base_inv_freq(10000.0, D), 1.0)
    forms = {"per_half": per_half, "whole_head": apply_rope_half}
    rows = []
    for heads in (4, 2):  # queries, keys
        gen = torch.Generator().manual_seed(heads)
        x = torch.randn(B, T, heads, D, generator=gen).bfloat16()
        grad = torch.randn(B, T, heads, D, generator=gen).bfloat16()
        times: dict[str, list[float]] = {name: [] for name in forms}
        results = {}
        for _ in range(25):
            for name, form in forms.items():
                leaf = x.clone().requires_grad_()
                start = time.perf_counter()
                out = form(leaf, rot)
                out.backward(grad)
                times[name].append(time.perf_counter() - start)
                results[name] = (out.detach(), leaf.grad)
        equal = all(torch.equal(a, b) for a, b in zip(*results.values()))
        ms = {name: 1000 * statistics.median(t[3:]) for name, t in times.items()}
        rows.append({"heads": heads, "ms": ms, "speedup": ms["per_half"] / ms["whole_head"],
                     "bitwise_equal": equal})  # fmt: skip
        print(f"{heads} heads: per_half {ms['per_half']:.3f} ms, whole_head "
              f"{ms['whole_head']:.3f} ms ({rows[-1]['speedup']:.2f}x), bitwise equal {equal}")  # fmt: skip
    report = {
        "benchmark": "rope_pairing",
        "machine": machine(torch_threads=torch.get_num_threads()),
        "shape": {"batch": B, "seq_len": T, "head_dim": D, "dtype": "bfloat16"},
        "rows": rows,
    }
    out = ROOT / "bench" / "results" / "rope_pairing_cpu.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
