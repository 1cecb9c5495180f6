"""Gated DeltaNet vs softmax attention on this CPU: training time vs sequence length, and decode
time per token vs context length.

One layer of each, at the widths of `tiny_hybrid` (d_model 256; GDN 2 query/key heads and 4
value heads of 64; GQA 4 query / 2 kv heads of 64, SDPA), batch 1, bf16 autocast as training
runs. Training: forward + backward of the layer (median of `--repeats`). Decode: the layer's
generation state after a prefill of `context` tokens, then the median time of one-token steps.
The crossover is the shortest length at which GDN is the faster one.

    python bench/linear_attention.py [--repeats 3] [--max-len 8192]
Writes bench/results/linear_attention_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.machine import machine
from model.mixers.masks import AttentionContext, build_mask
from model.presets import load_preset
from model.transformer import build_model


def layers() -> dict[str, torch.nn.Module]:
    model = build_model(load_preset("tiny_hybrid"), seed=0)
    return {"gdn": model.layers["0"].attn, "attention": model.layers["3"].attn, "model": model}


def context(model: torch.nn.Module, T: int, start: int = 0) -> AttentionContext:
    positions = torch.arange(start, start + T)[None]
    mask, causal = build_mask(T, start)
    rope = {d: model.pos.rotary(positions, start + T, d) for d in model.rotary_dims}
    return AttentionContext(
        positions=positions, rope=rope, mask=mask, is_causal=causal, start=start
    )


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def train_time(layer: torch.nn.Module, model: torch.nn.Module, T: int, repeats: int) -> float:
    x = torch.randn(1, T, 256, requires_grad=True)
    ctx = context(model, T)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x, ctx)
        y.float().square().mean().backward()

    return median_seconds(step, repeats)


@torch.no_grad()
def decode_time(layer: torch.nn.Module, model: torch.nn.Module, T: int, steps: int) -> float:
    state = layer.new_state(1, T + steps + 1, torch.bfloat16, torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(torch.randn(1, T, 256), context(model, T), state)  # prefill
        times = []
        for i in range(steps):
            x, ctx = torch.randn(1, 1, 256), context(model, 1, T + i)
            start = time.perf_counter()
            layer(x, ctx, state)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def crossover(rows: list[dict], key: str) -> int | None:
    return next((r["tokens"] for r in rows if r[f"gdn_{key}"] < r[f"attention_{key}"]), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=12)
    parser.add_argument("--max-len", type=int, default=8192)
    args = parser.parse_args()
    torch.manual_seed(0)
    parts = layers()
    model = parts["model"]
    lengths = [n for n in (256, 512, 1024, 2048, 4096, 8192, 16384) if n <= args.max_len]
    rows = []
    print(
        "| tokens | GDN train s | attention train s | GDN decode ms/token | attention decode ms/token |"
    )
    print("|---:|---:|---:|---:|---:|")
    for T in lengths:
        row = {"tokens": T}
        for name in ("gdn", "attention"):
            row[f"{name}_train_s"] = train_time(parts[name], model, T, args.repeats)
            row[f"{name}_decode_ms"] = 1e3 * decode_time(parts[name], model, T, args.decode_steps)
        rows.append(row)
        print(
            f"| {T} | {row['gdn_train_s']:.4f} | {row['attention_train_s']:.4f} | "
            f"{row['gdn_decode_ms']:.3f} | {row['attention_decode_ms']:.3f} |",
            flush=True,
        )
    report = {
        "benchmark": "linear_attention",
        "args": vars(args),
        "machine": machine(("torch",), torch_threads=torch.get_num_threads()),
        "layers": {"gdn": parts["gdn"].describe(), "attention": parts["attention"].describe()},
        "rows": rows,
        "crossover_train_tokens": crossover(rows, "train_s"),
        "crossover_decode_tokens": crossover(rows, "decode_ms"),
    }
    out = ROOT / "bench" / "results" / "linear_attention_cpu.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"crossover: training from {report['crossover_train_tokens']} tokens, decoding from "
        f"{report['crossover_decode_tokens']} tokens; wrote {out}"
    )


if __name__ == "__main__":
    main()
