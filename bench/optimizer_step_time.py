"""Optimizer step time as a fraction of the whole training step: AdamW vs Muon (vs MuonClip),
on the tiny model (bf16 autocast, global batch 8 x 256), in one process and with FSDP2 on 2 gloo
processes (same global batch); Muon also with every attention head orthogonalized alone.

    python bench/optimizer_step_time.py [--steps 6]
Writes bench/results/optimizer_step_time_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.machine import machine
from bench.ranks import add_step_arguments, run_on_ranks
from data.loader import Batch
from model.presets import load_preset
from optim.config import OptimConfig
from optim.qk_clip import enable_qk_clip
from parallel.config import ParallelConfig
from parallel.mesh import ParallelDims
from trainer.build import build_training_engine
from trainer.config import TrainerConfig
from trainer.step import LossTracker, StepSettings, train_step

# name -> (optim.name, optim.muon_split); "muon (heads)" orthogonalizes every attention head alone
OPTIMIZERS = {
    "adamw": ("adamw", "fused"),
    "muon": ("muon", "fused"),
    "muon (heads)": ("muon", "heads"),
    "muonclip": ("muonclip", "fused"),
}


def measure(rank: int, world: int, name: str, args: argparse.Namespace) -> dict:
    cfg = load_preset("tiny")
    dims = ParallelDims.resolve(ParallelConfig(), world)
    device = torch.device("cpu")
    tcfg = TrainerConfig(batch_size=args.batch)
    optim_name, split = OPTIMIZERS[name]
    tau = 100.0 if optim_name == "muonclip" else 0.0
    settings = OptimConfig(name=optim_name, warmup_steps=0, qk_clip_tau=tau, muon_split=split)
    engine = build_training_engine(cfg, tcfg, ParallelConfig(), settings, dims, device, 0)
    optimizer = engine.optimizer
    if tau:
        enable_qk_clip(engine.model)
    optimizer_seconds: list[float] = []
    step = optimizer.step

    def timed_step(*a, **k):
        start = time.perf_counter()
        out = step(*a, **k)
        optimizer_seconds.append(time.perf_counter() - start)
        return out

    optimizer.step = timed_step  # type: ignore[method-assign]
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1))
    local = args.batch // world
    part = tokens[rank * local : (rank + 1) * local]
    batch = Batch(part[:, :-1], part[:, 1:], torch.zeros_like(part[:, 1:]))
    step_settings = StepSettings(grad_clip=1.0, qk_clip_tau=tau)
    tracker, totals = LossTracker(0.0), []
    for _ in range(args.warmup + args.steps):
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        train_step(engine, batch, step_settings, tracker)
        totals.append(time.perf_counter() - start)
    total = statistics.median(totals[args.warmup :])
    opt = statistics.median(optimizer_seconds[args.warmup :])
    return {"optimizer": name, "ranks": world, "step_s": total, "optimizer_s": opt}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_step_arguments(parser)
    args = parser.parse_args()
    rows = []
    print("| optimizer | ranks | step s | optimizer s | share of step |")
    print("|---|---:|---:|---:|---:|")
    for world in (1, 2):
        for name in OPTIMIZERS:
            row = run_on_ranks(world, args.cores, measure, name, args)
            row["share"] = row["optimizer_s"] / row["step_s"]
            rows.append(row)
            print(
                f"| {name} | {world} | {row['step_s']:.3f} | {row['optimizer_s']:.3f} | "
                f"{100 * row['share']:.1f}% |"
            )
    report = {
        "benchmark": "optimizer_step_time",
        "args": vars(args),
        "machine": machine(),
        "rows": rows,
    }
    out = Path(__file__).parent / "results" / "optimizer_step_time_cpu.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
