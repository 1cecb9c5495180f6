"""Training throughput of the tiny dense model vs Hugging Face transformers' LlamaForCausalLM.

Same dimensions (the `tiny` preset: d 256, 6 layers, 8 query / 4 KV heads, SwiGLU, tied
embeddings, vocab 8192), same batch and sequence length, bf16 autocast, fused AdamW, on CPU.
Each variant runs in a fresh subprocess; the median step time after warm-up counts. MFU is the
model's training FLOPs per token (model.accounting: causal attention, matmuls) x tokens/s over
the bf16 matmul peak measured in the same run (trainer.mfu.measure_matmul_peak).

    python bench/train_throughput.py [--batch 8] [--seq-len 512] [--steps 8] [--warmup 3]
Writes bench/results/train_throughput_cpu_<batch>x<seq_len>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.machine import machine
from model.accounting import training_flops_per_token
from model.hf import hf_config
from model.presets import load_preset
from model.transformer import build_model
from optim.builder import build_optimizer
from optim.config import OptimConfig
from trainer.mfu import measure_matmul_peak

# *_compiled: torch.compile per block; lmforge_compiled_model: the whole model (what
# trainer.compile=true does in one process)
VARIANTS = ("transformers", "transformers_compiled", "lmforge", "lmforge_compiled_model")


def build(variant: str):
    """(model, optimizer, step function) for one variant."""
    cfg = load_preset("tiny")
    torch.manual_seed(0)
    if variant.startswith("transformers"):
        import transformers

        hf_cfg = transformers.LlamaConfig(**hf_config(cfg))
        model = transformers.LlamaForCausalLM(hf_cfg).train()
        model.config._attn_implementation = "sdpa"

        def loss_of(x, y):
            return model(input_ids=x, labels=y).loss

        if variant.endswith("compiled"):
            for layer in model.model.layers:
                layer.compile()
    else:
        model = build_model(cfg)

        def loss_of(x, y):
            return model(x, y)

        if variant.endswith("compiled"):
            for block in model.layers.values():
                block.compile()
        elif variant.endswith("compiled_model"):
            model.compile()
    optimizer = build_optimizer(OptimConfig(), model)
    return model, optimizer, loss_of


def run_variant(variant: str, batch: int, seq_len: int, steps: int, warmup: int) -> dict:
    """In the child process: median seconds per training step."""
    _, optimizer, loss_of = build(variant)
    x = torch.randint(0, 8192, (batch, seq_len))
    y = torch.randint(0, 8192, (batch, seq_len))
    times = []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    step = statistics.median(times[warmup:])
    return {
        "variant": variant,
        "seconds_per_step": step,
        "warmup_seconds": sum(times[:warmup]),
        "tokens_per_s": batch * seq_len / step,
        "final_loss": float(loss),
    }


def child(args: argparse.Namespace, variant: str) -> dict:
    cmd = [sys.executable, __file__, "--child", variant]
    cmd += ["--batch", str(args.batch), "--seq-len", str(args.seq_len)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--child", default="")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    if args.child:
        print(
            json.dumps(run_variant(args.child, args.batch, args.seq_len, args.steps, args.warmup))
        )
        return
    peak = measure_matmul_peak(torch.device("cpu"), torch.bfloat16, seconds=2.0)
    flops = training_flops_per_token(
        build_model(load_preset("tiny"), device="meta"), args.seq_len
    ).total
    rows = []
    for variant in args.variants.split(","):
        row = child(args, variant)
        row["mfu_of_measured_peak"] = flops * row["tokens_per_s"] / peak
        rows.append(row)
        print(f"  {variant}: {row['tokens_per_s']:.0f} tok/s, {row['seconds_per_step']:.3f} s/step")
    base = next((r for r in rows if r["variant"] == "transformers"), rows[0])
    for row in rows:
        row["speedup_vs_transformers"] = row["tokens_per_s"] / base["tokens_per_s"]
    result = {
        "benchmark": "train_throughput",
        "args": {k: v for k, v in vars(args).items() if k not in ("child", "out")},
        "machine": machine(("torch", "transformers"), torch_threads=torch.get_num_threads()),
        "bf16_matmul_peak_flops": peak,
        "training_flops_per_token": flops,
        "targets": {"speedup_vs_transformers": 1.5, "mfu_of_measured_peak": 0.6},
        "rows": rows,
    }
    out = Path(args.out) / f"train_throughput_cpu_{args.batch}x{args.seq_len}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nbf16 matmul peak {peak / 1e9:.0f} GFLOP/s; {flops / 1e6:.1f} MFLOP/token")
    print("| variant | tokens/s | s/step | vs transformers | MFU (of measured peak) |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['tokens_per_s']:.0f} | {r['seconds_per_step']:.3f} | "
            f"{r['speedup_vs_transformers']:.2f} | {100 * r['mfu_of_measured_peak']:.1f}% |"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
