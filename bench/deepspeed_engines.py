"""FSDP2 vs DeepSpeed ZeRO-2 / ZeRO-3 / ZeRO-3 + CPU optimizer offload on 2 CPU ranks (gloo):
median step time and peak memory per rank, same model, global batch and precision (issue 19).

Each case builds the trainer's engine (trainer.build.build_training_engine: bf16 autocast over
fp32 weights, the trainer's AdamW, clipping at 1.0) on 2 spawned ranks with cores / 2 threads
each and times train_step after 2 warm-up steps. Memory is each rank's peak resident set
(ru_maxrss) above what the process held before building the engine: weights, gradients,
optimizer states and activations together (CPU tensors have no allocator statistics).

    python bench/deepspeed_engines.py [--steps 5] [--batch 8] [--seq-len 256]
Writes bench/results/deepspeed_engines_cpu.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.machine import machine
from bench.ranks import run_on_ranks
from data.loader import Batch
from model.presets import load_preset
from optim.config import OptimConfig
from parallel.config import DeepSpeedConfig, ParallelConfig
from parallel.mesh import ParallelDims
from trainer.build import build_training_engine
from trainer.config import TrainerConfig
from trainer.hooks import start_hooks
from trainer.step import LossTracker, StepSettings, train_step

MODELS = {  # name -> preset overrides (vocabulary 8192 as the default run's)
    "tiny": {},
    "wide": {"d_model": 768, "n_layers": 12, "attention.n_heads": 12, "attention.n_kv_heads": 4},
}
ENGINES = {  # name -> parallel config
    "fsdp2": ParallelConfig(),
    "zero2": ParallelConfig(engine="deepspeed", deepspeed=DeepSpeedConfig(zero_stage=2)),
    "zero3": ParallelConfig(engine="deepspeed", deepspeed=DeepSpeedConfig(zero_stage=3)),
    "zero3_offload": ParallelConfig(
        engine="deepspeed", deepspeed=DeepSpeedConfig(zero_stage=3, offload_optimizer="cpu")
    ),
}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(rank: int, world: int, model: str, engine_name: str, args: argparse.Namespace) -> dict:
    cfg = load_preset("tiny", MODELS[model])
    pcfg = ENGINES[engine_name]
    before = peak_rss_mib()
    tcfg = TrainerConfig(precision="bf16", batch_size=args.batch, grad_clip=1.0, compile="false")
    engine = build_training_engine(
        cfg, tcfg, pcfg, OptimConfig(warmup_steps=0), ParallelDims.resolve(pcfg, world),
        torch.device("cpu"), 0,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=gen)
    local = args.batch // world
    part = tokens[rank * local : (rank + 1) * local]
    batch = Batch(part[:, :-1], part[:, 1:], torch.zeros_like(part[:, 1:]))
    settings, tracker, times, losses = StepSettings(grad_clip=1.0), LossTracker(0.0), [], []
    hooks = start_hooks(engine, 0.0, None)
    for step in range(2 + args.steps):
        start = time.perf_counter()
        result = train_step(engine, batch, settings, tracker, hooks)
        if step >= 2:
            times.append(time.perf_counter() - start)
        losses.append(result.loss)
    params = sum(p.numel() for p in engine.model.parameters())  # this rank's (partitioned) share
    peaks = torch.tensor([peak_rss_mib() - before, peak_rss_mib()])
    torch.distributed.all_reduce(peaks, op=torch.distributed.ReduceOp.MAX)
    return {
        "step_s": round(statistics.median(times), 4),
        "peak_rss_above_start_mib": round(peaks[0].item()),
        "peak_rss_mib": round(peaks[1].item()),
        "params_held_rank0": params,
        "losses": [round(v, 5) for v in losses],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "deepspeed_engines_cpu.json"
    )
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    results: dict = {}
    for model in MODELS:
        for engine in ENGINES:
            result = run_on_ranks(2, cores, measure, model, engine, args)
            results.setdefault(model, {})[engine] = result
            base = results[model]["fsdp2"]
            print(
                f"{model:5s} {engine:14s} step {result['step_s']:7.3f} s "
                f"({result['step_s'] / base['step_s']:.2f}x fsdp2)  peak +{result['peak_rss_above_start_mib']} MiB "
                f"({result['peak_rss_above_start_mib'] / base['peak_rss_above_start_mib']:.2f}x)",
                flush=True,
            )
    report = {
        "benchmark": "deepspeed_engines",
        "args": {k: str(v) for k, v in vars(args).items()},
        "machine": machine(("torch", "deepspeed")),
        "ranks": 2,
        "results": results,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
