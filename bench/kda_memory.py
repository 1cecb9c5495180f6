"""Peak memory and time of the KDA chunked form: the sub-chunked per-channel decay products
(model/mixers/delta_rule.py::_channel_pair_products) vs the direct form that builds the (C, C, Dk) decay
tensor of every chunk, in the same run.

One `tiny_kda`-width KDA layer (4 heads x 64, chunk 64), batch 1, fp32, forward + backward at
each length. Each measurement runs in its own process (peak RSS above the process's baseline
after the warm-up allocations; the CPU has no allocator statistics), median of `--repeats` times.

    python bench/kda_memory.py [--lengths 1024 4096] [--repeats 3]
Writes bench/results/kda_memory_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.machine import machine


def direct_pair_products(a: torch.Tensor, b: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """The baseline: the explicit (..., C, C, Dk) decay tensor per chunk."""
    C = a.shape[-2]
    lower = torch.ones(C, C, dtype=torch.bool, device=a.device).tril()
    diff = gamma[..., :, None, :] - gamma[..., None, :, :]
    decay = torch.exp(diff.masked_fill(~lower[..., None], -torch.inf))
    return torch.einsum("...rd,...sd,...rsd->...rs", a, b, decay)


def measure(form: str, T: int, repeats: int) -> dict:
    """In this process: forward + backward of one KDA layer; peak RSS growth and median time."""
    import model.mixers.delta_rule as rule
    from model.mixers.masks import AttentionContext
    from model.presets import load_preset
    from model.transformer import build_model

    if form == "direct":
        rule._channel_pair_products = direct_pair_products
    torch.manual_seed(0)
    layer = build_model(load_preset("tiny_kda"), seed=0).layers["0"].attn
    x = torch.randn(1, T, 256)
    positions = torch.arange(T)[None]
    ctx = AttentionContext(positions=positions, rope=None, mask=None, is_causal=True, start=0)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        layer(x, ctx).sum().backward()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"peak_rss_growth_mib": (peak - base) / 1024, "seconds": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker[0], int(args.worker[1]), args.repeats)))
        return
    rows = []
    for T in args.lengths:
        row = {"tokens": T}
        for form in ("sub_chunked", "direct"):
            command = [sys.executable, __file__, "--worker", form, str(T)]
            command += ["--repeats", str(args.repeats)]
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            row[form] = json.loads(out.strip().splitlines()[-1])
        row["memory_ratio"] = row["direct"]["peak_rss_growth_mib"] / max(
            row["sub_chunked"]["peak_rss_growth_mib"], 1e-9
        )
        row["speed_ratio"] = row["direct"]["seconds"] / row["sub_chunked"]["seconds"]
        rows.append(row)
        print(
            f"T={T}: sub-chunked {row['sub_chunked']['peak_rss_growth_mib']:.0f} MiB "
            f"{row['sub_chunked']['seconds']:.3f} s; direct {row['direct']['peak_rss_growth_mib']:.0f} "
            f"MiB {row['direct']['seconds']:.3f} s"
        )
    out = ROOT / "bench" / "results" / "kda_memory_cpu.json"
    out.write_text(
        json.dumps({"machine": machine(), "layer": "tiny_kda KDA", "rows": rows}, indent=1)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
