"""Causal SDPA forward + backward time at a fixed width (heads x head_dim) for several head_dims.

Same FLOPs in every row: only how the width is split into heads changes. This is the measurement
behind the tiny preset's head_dim of 64 (bf16, GQA with 2 query heads per kv head).

    python bench/attention_head_dim.py [--batch 16] [--seq-len 256] [--width 256] [--device cpu]
Writes bench/results/attention_head_dim_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.machine import machine


def median_seconds(batch: int, seq_len: int, heads: int, head_dim: int, device: str) -> float:
    """Median forward + backward seconds of causal GQA attention, (B, H, T, D) with H/2 kv heads."""
    torch.manual_seed(0)

    def tensor(h: int) -> torch.Tensor:
        shape = (batch, h, seq_len, head_dim)
        return torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True)

    q, k, v = tensor(heads), tensor(heads // 2), tensor(heads // 2)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for _ in range(7):  # the first two warm up
        sync()
        start = time.perf_counter()
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        y.float().sum().backward()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times[2:])[len(times[2:]) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--width", type=int, default=256, help="heads x head_dim of the queries")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    rows = []
    for head_dim in (32, 64, 128):
        heads = args.width // head_dim
        seconds = median_seconds(args.batch, args.seq_len, heads, head_dim, args.device)
        rows.append(
            {"heads": heads, "kv_heads": heads // 2, "head_dim": head_dim, "ms": seconds * 1e3}
        )
        print(f"head_dim {head_dim:4d}  heads {heads:2d}  {seconds * 1e3:7.1f} ms")
    report = {
        "benchmark": "attention_head_dim",
        "args": vars(args),
        "machine": machine(torch_threads=torch.get_num_threads()),
        "rows": rows,
    }
    out = Path(__file__).parent / "results" / f"attention_head_dim_{args.device}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
