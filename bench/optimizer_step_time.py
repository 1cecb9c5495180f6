"""Optimizer step time as a fraction of the whole training step: AdamW vs Muon (vs MuonClip),
on the tiny model (`trainer.precision=auto`: bf16 autocast where the CPU has bf16 instructions,
else fp32; global batch 8 x 256 and 32 x 256), in one process and with
FSDP2 on 2 gloo processes (same global batch); Muon also with every attention head
orthogonalized alone, and with every matrix orthogonalized on its own (`unbatched`: the path
before same-shaped matrices were batched).

The floor: Newton-Schulz's matmul FLOPs on this rank (counted by torch's FlopCounterMode over
one optimizer step) at the rate of a large GEMM in the iteration's dtype (bf16, or fp32 where
bf16 is emulated: optim.newton_schulz.iteration_dtype) measured in the same process; the floor
share is that time over the step's other work plus it.

    python bench/optimizer_step_time.py [--steps 6]
Writes bench/results/optimizer_step_time_cpu[_fp32].json (_fp32 where the step runs in fp32).
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
from optim import newton_schulz
from optim.config import OptimConfig
from parallel.config import ParallelConfig
from parallel.mesh import ParallelDims
from parallel.precision import resolve_precision
from trainer.build import build_training_engine
from trainer.config import TrainerConfig
from trainer.hooks import start_hooks
from trainer.step import LossTracker, StepSettings, train_step

# name -> (optim.name, optim.muon_split); "muon (heads)" orthogonalizes every attention head alone
OPTIMIZERS = {
    "adamw": ("adamw", "fused"),
    "muon (unbatched)": ("muon", "fused"),
    "muon": ("muon", "fused"),
    "muon (heads)": ("muon", "heads"),
    "muonclip": ("muonclip", "fused"),
}
LARGE_BATCH_OPTIMIZERS = ("adamw", "muon (unbatched)", "muon")  # also run at 4x the batch


def gemm_rate(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a (size x size) @ (size x size) matmul in `dtype` on this process's threads."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def counted(step, flops: list[float]):
    """`step` that adds the matmul FLOPs of its first call to `flops` (an untimed warmup)."""
    from torch.utils.flop_counter import FlopCounterMode

    def first_step_counted(*a, **k):
        if flops:
            return step(*a, **k)
        with FlopCounterMode(display=False) as counter:
            out = step(*a, **k)
        flops.append(counter.get_total_flops())
        return out

    return first_step_counted


def measure(rank: int, world: int, name: str, batch_size: int, args: argparse.Namespace) -> dict:
    if name == "muon (unbatched)":
        newton_schulz.BATCH_ELEMENTS = 0  # every matrix alone (this rank's process only)
    cfg = load_preset("tiny")
    dims = ParallelDims.resolve(ParallelConfig(), world)
    device = torch.device("cpu")
    tcfg = TrainerConfig(batch_size=batch_size, compile="false")
    optim_name, split = OPTIMIZERS[name]
    tau = 100.0 if optim_name == "muonclip" else 0.0
    settings = OptimConfig(name=optim_name, warmup_steps=0, qk_clip_tau=tau, muon_split=split)
    engine = build_training_engine(cfg, tcfg, ParallelConfig(), settings, dims, device, 0)
    optimizer = engine.optimizer
    hooks = start_hooks(engine, tau, None)  # QK-clip records from here on
    optimizer_seconds: list[float] = []
    flops: list[float] = []
    step = counted(optimizer.step, flops)

    def timed_step(*a, **k):
        start = time.perf_counter()
        out = step(*a, **k)
        optimizer_seconds.append(time.perf_counter() - start)
        return out

    optimizer.step = timed_step  # type: ignore[method-assign]
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, args.seq_len + 1))
    local = batch_size // world
    part = tokens[rank * local : (rank + 1) * local]
    batch = Batch(part[:, :-1], part[:, 1:], torch.zeros_like(part[:, 1:]))
    step_settings = StepSettings(grad_clip=1.0)
    tracker, totals = LossTracker(0.0), []
    for _ in range(args.warmup + args.steps):
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        train_step(engine, batch, step_settings, tracker, hooks)
        totals.append(time.perf_counter() - start)
    total = statistics.median(totals[args.warmup :])
    opt = statistics.median(optimizer_seconds[args.warmup :])
    rate = gemm_rate(newton_schulz.iteration_dtype(device))
    floor = flops[0] / rate
    return {
        "optimizer": name,
        "ranks": world,
        "batch": batch_size,
        "step_s": total,
        "optimizer_s": opt,
        "optimizer_matmul_flops": flops[0],
        "gemm_flops_per_s": rate,
        "floor_s": floor,
        "floor_share": floor / (total - opt + floor),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_step_arguments(parser)
    args = parser.parse_args()
    rows = []
    print("| optimizer | ranks | batch | step s | optimizer s | share of step | floor share |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for world in (1, 2):
        for batch_size, names in (
            (args.batch, OPTIMIZERS),
            (4 * args.batch, LARGE_BATCH_OPTIMIZERS),
        ):
            for name in names:
                row = run_on_ranks(world, args.cores, measure, name, batch_size, args)
                row["share"] = row["optimizer_s"] / row["step_s"]
                rows.append(row)
                print(
                    f"| {name} | {world} | {batch_size} | {row['step_s']:.3f} | "
                    f"{row['optimizer_s']:.3f} | {100 * row['share']:.1f}% | "
                    f"{100 * row['floor_share']:.1f}% |"
                )
    precision = resolve_precision("auto", torch.device("cpu"))
    report = {
        "benchmark": "optimizer_step_time",
        "args": vars(args),
        "machine": machine(),
        "precision": precision,
        "newton_schulz_dtype": str(newton_schulz.iteration_dtype(torch.device("cpu"))),
        "rows": rows,
    }
    suffix = "_fp32" if precision == "fp32" else ""
    out = Path(__file__).parent / "results" / f"optimizer_step_time_cpu{suffix}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
