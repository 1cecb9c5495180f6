"""Training throughput of the tiny dense model vs Hugging Face transformers' LlamaForCausalLM.

Same dimensions (the `tiny` preset: d 256, 6 layers, 4 query / 2 KV heads of 64, SwiGLU, tied
embeddings, vocab 8192), same batch and sequence length, same precision (--precision: auto =
what `trainer.precision=auto` takes on this CPU, bf16 autocast where it has bf16 instructions,
else fp32; both sides alike), fused AdamW, gradient clipping, on CPU; our side runs the trainer's own step function. Each variant runs in a fresh subprocess;
the median step time after warm-up counts. MFU is the
model's training FLOPs per token (model.accounting: causal attention, matmuls) x tokens/s over
the matmul peak in that precision measured in the same run (trainer.mfu.measure_matmul_peak).

    python bench/train_throughput.py [--batch 8] [--seq-len 512] [--steps 8] [--warmup 3]
        [--precision auto|bf16|fp32]
Writes bench/results/train_throughput_cpu_<batch>x<seq_len>.json (_fp32.json in fp32).
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
from bench.engines import tiny_cpu_engine
from bench.machine import machine
from data.loader import Batch
from model.accounting import training_flops_per_token
from model.hf import hf_config
from model.presets import load_preset
from model.transformer import build_model
from optim.config import OptimConfig
from parallel.precision import compute_dtype, resolve_precision
from trainer.cpu_malloc import keep_freed_memory
from trainer.hooks import start_hooks
from trainer.mfu import measure_matmul_peak
from trainer.step import LossTracker, StepSettings, train_step

# transformers_compiled: each decoder layer compiled; lmforge_*: the trainer's own engine and step
# with trainer.precision=bf16 (autocast) or bf16_master; *_compiled: trainer.compile=true (each
# block compiled, the composition path of every layout); *_compiled_whole_model: the whole model
# compiled as one graph instead (the single-process path before the engine interface)
# transformers_malloc_keep: transformers' eager step with glibc keeping freed blocks, as the
# trainer sets it on CPU (trainer/cpu_malloc.py); every lmforge_* variant runs with it
VARIANTS = (
    "transformers",
    "transformers_malloc_keep",
    "transformers_compiled",
    "lmforge",
    "lmforge_compiled",
    "lmforge_compiled_whole_model",
    "lmforge_bf16_master_compiled",
)


def build(variant: str, precision: str):
    """A step function for one variant: forward, backward, clip to 1.0, AdamW step;
    precision "bf16" (autocast) or "fp32"."""
    cfg = load_preset("tiny")
    torch.manual_seed(0)
    if variant.startswith("lmforge") or variant.endswith("_malloc_keep"):
        keep_freed_memory()  # what `python -m trainer` does on CPU (trainer.cpu_malloc=keep)
    if variant.startswith("transformers"):
        import transformers

        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(cfg))).train()
        model.config._attn_implementation = "sdpa"
        if variant.endswith("compiled"):
            for layer in model.model.layers:
                layer.compile()
        # our AdamW settings (fused, decay on matrices only) over a model without our roles
        opt_cfg = OptimConfig()
        decay = [p for p in model.parameters() if p.ndim >= 2]
        rest = [p for p in model.parameters() if p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay}, {"params": rest, "weight_decay": 0.0}],
            lr=opt_cfg.lr,
            betas=(opt_cfg.beta1, opt_cfg.beta2),
            eps=opt_cfg.eps,
            weight_decay=opt_cfg.weight_decay,
            fused=True,
        )

        def hf_step(x, y):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = model(input_ids=x, labels=y).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return float(loss)

        return hf_step
    # the trainer's own engine and step (trainer.step.train_step), as `python -m trainer` runs it
    precision = "bf16_master" if "bf16_master" in variant else precision
    per_block = variant.endswith("_compiled")
    engine = tiny_cpu_engine(precision, compile=per_block)
    if variant.endswith("compiled_whole_model"):
        engine.model.compile()
    tracker, settings = LossTracker(0.0), StepSettings(grad_clip=1.0)
    hooks = start_hooks(engine, 0.0, None)

    def our_step(x, y):
        batch = Batch(x, y, torch.zeros_like(x, dtype=torch.int32))
        return train_step(engine, batch, settings, tracker, hooks).loss

    return our_step


def run_variant(
    variant: str, batch: int, seq_len: int, steps: int, warmup: int, precision: str
) -> dict:
    """In the child process: median seconds per training step."""
    step_fn = build(variant, precision)
    x = torch.randint(0, 8192, (batch, seq_len))
    y = torch.randint(0, 8192, (batch, seq_len))
    times = []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        loss = step_fn(x, y)
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
    cmd += ["--precision", args.precision]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp32"))
    parser.add_argument("--child", default="")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    args.precision = resolve_precision(args.precision, torch.device("cpu"))
    if args.child:
        shape = (args.batch, args.seq_len, args.steps, args.warmup, args.precision)
        print(json.dumps(run_variant(args.child, *shape)))
        return
    dtype = compute_dtype(args.precision)
    peak = measure_matmul_peak(torch.device("cpu"), dtype, seconds=2.0)
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
        "precision": args.precision,
        "matmul_peak_flops": peak,  # in the precision's dtype
        "training_flops_per_token": flops,
        "targets": {"speedup_vs_transformers": 1.5, "mfu_of_measured_peak": 0.6},
        "rows": rows,
    }
    suffix = "_fp32" if args.precision == "fp32" else ""
    out = Path(args.out) / f"train_throughput_cpu_{args.batch}x{args.seq_len}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{dtype} matmul peak {peak / 1e9:.0f} GFLOP/s; {flops / 1e6:.1f} MFLOP/token")
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
