"""FSDP2 step time vs one process on the same global batch (CPU, gloo).

The tiny preset, bf16 autocast, AdamW, gradient clipping: one process with all cores, then
`--ranks` gloo processes with cores / ranks threads each, same global batch and sequence length.
The median step after warm-up counts; the overhead is what sharding costs on this machine
(all-gathers, reduce-scatters and the per-rank Python work) for the same work.

    python bench/fsdp_overhead.py [--ranks 2] [--batch 8] [--seq-len 256] [--steps 6]
Writes bench/results/fsdp_overhead_cpu.json.
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
from parallel.config import ParallelConfig
from parallel.mesh import ParallelDims
from trainer.build import build_training_engine
from trainer.config import TrainerConfig
from trainer.hooks import start_hooks
from trainer.step import LossTracker, StepSettings, train_step


def step_times(rank: int, world: int, args: argparse.Namespace) -> list[float]:
    cfg = load_preset("tiny")
    dims = ParallelDims.resolve(ParallelConfig(), world)
    tcfg = TrainerConfig(precision="bf16", batch_size=args.batch, compile="false")
    device = torch.device("cpu")
    engine = build_training_engine(
        cfg, tcfg, ParallelConfig(), OptimConfig(warmup_steps=0), dims, device, 0
    )
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=gen)
    local = args.batch // world
    part = tokens[rank * local : (rank + 1) * local]
    batch = Batch(part[:, :-1], part[:, 1:], torch.zeros_like(part[:, 1:]))
    settings, tracker = StepSettings(grad_clip=1.0), LossTracker(0.0)
    hooks = start_hooks(engine, 0.0, None)
    times = []
    for _ in range(args.warmup + args.steps):
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        train_step(engine, batch, settings, tracker, hooks)
        times.append(time.perf_counter() - start)
    return times[args.warmup :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    add_step_arguments(parser)
    args = parser.parse_args()
    rows = []
    for world in (1, args.ranks):
        seconds = statistics.median(run_on_ranks(world, args.cores, step_times, args))
        tokens = args.batch * args.seq_len / seconds
        rows.append({"ranks": world, "seconds_per_step": seconds, "tokens_per_s": tokens})
        print(f"{world} rank(s): {seconds:.3f} s/step, {tokens:.0f} tokens/s")
    overhead = rows[1]["seconds_per_step"] / rows[0]["seconds_per_step"] - 1
    print(f"FSDP2 over {args.ranks} gloo ranks: {100 * overhead:+.1f}% step time vs one process")
    report = {
        "benchmark": "fsdp_overhead",
        "args": vars(args),
        "machine": machine(),
        "rows": rows,
        "step_time_overhead": overhead,
    }
    out = Path(__file__).parent / "results" / "fsdp_overhead_cpu.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
