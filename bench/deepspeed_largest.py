"""The largest model each engine trains on this machine (2 CPU ranks, gloo): FSDP2, DeepSpeed
ZeRO-2, ZeRO-3, ZeRO-3 + CPU optimizer offload, ZeRO-3 + CPU optimizer and parameter offload.

A family of models grows by depth (d_model 1024, 16 heads / 4 kv heads, SwiGLU, vocabulary 8192,
fp32 training with the trainer's AdamW, clipping at 1.0, global batch 2 x 64 tokens). For each
engine:

1. model.inspect's estimate (model.accounting.training_memory: AdamW's 16 bytes per parameter,
   sharded over the 2 ranks) gives the first guess of the largest depth under the budget;
2. two small depths are trained for two steps and their summed peak resident memory (both ranks)
   fitted as a + b x parameters: the engine's measured bytes per parameter;
3. the depth the fit puts under the budget is confirmed with 2 steps (10% fewer layers while it
   fails), and its measured peak is what the table reports.

The budget is --budget-fraction of the memory available when the script starts. NVMe offload
needs libaio (DeepSpeed's async_io op), which this machine does not have; it is reported as
unavailable when so.

    python bench/deepspeed_largest.py [--budget-fraction 0.75]
Writes bench/results/deepspeed_largest_cpu.json and prints a table.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
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
from model.accounting import param_counts, training_memory
from model.presets import load_preset
from model.transformer import build_model
from optim.config import OptimConfig
from parallel.config import DeepSpeedConfig, ParallelConfig
from parallel.mesh import ParallelDims
from trainer.build import build_training_engine
from trainer.config import TrainerConfig
from trainer.hooks import start_hooks
from trainer.step import LossTracker, StepSettings, train_step

WIDTH = {"d_model": 1024, "attention.n_heads": 16, "attention.n_kv_heads": 4, "vocab_size": 8192}
SEQ, BATCH, RANKS = 64, 2, 2
ENGINES = {
    "fsdp2": ParallelConfig(),
    "zero2": ParallelConfig(engine="deepspeed", deepspeed=DeepSpeedConfig(zero_stage=2)),
    "zero3": ParallelConfig(engine="deepspeed", deepspeed=DeepSpeedConfig(zero_stage=3)),
    "zero3_offload_optimizer": ParallelConfig(
        engine="deepspeed", deepspeed=DeepSpeedConfig(zero_stage=3, offload_optimizer="cpu")
    ),
    "zero3_offload_all": ParallelConfig(
        engine="deepspeed",
        deepspeed=DeepSpeedConfig(zero_stage=3, offload_optimizer="cpu", offload_params="cpu"),
    ),
}
GIB = 2**30


def config(layers: int):
    return load_preset("tiny", WIDTH | {"n_layers": layers, "max_seq_len": SEQ})


@functools.cache
def _counted(layers: int) -> int:
    return param_counts(build_model(config(layers), device="meta")).total


def parameters(layers: int) -> int:
    """Parameters at this depth: the embedding and head plus identical blocks (from 1 and 2)."""
    per_block = _counted(2) - _counted(1)
    return _counted(1) + (layers - 1) * per_block


def train_steps(rank: int, world: int, layers: int, engine_name: str, steps: int) -> dict:
    """Each rank's peak resident memory (summed over ranks) over `steps` training steps."""
    pcfg = ENGINES[engine_name]
    tcfg = TrainerConfig(precision="fp32", batch_size=BATCH, grad_clip=1.0, compile="false")
    engine = build_training_engine(
        config(layers), tcfg, pcfg, OptimConfig(warmup_steps=0), ParallelDims.resolve(pcfg, world),
        torch.device("cpu"), 0,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 8192, (BATCH, SEQ + 1), generator=gen)[rank : rank + 1]
    batch = Batch(tokens[:, :-1], tokens[:, 1:], torch.zeros_like(tokens[:, 1:]))
    start, losses, hooks = time.perf_counter(), [], start_hooks(engine, 0.0, None)
    for _ in range(steps):
        step = train_step(engine, batch, StepSettings(grad_clip=1.0), LossTracker(0.0), hooks)
        losses.append(step.loss)
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0])
    torch.distributed.all_reduce(peak)  # both ranks share this machine's memory
    return {"peak_bytes": peak.item(), "seconds": time.perf_counter() - start, "losses": losses}


def attempt(layers: int, engine: str, steps: int, cores: int) -> dict | None:
    """The run's measurements, or None when it failed (out of memory: the ranks were killed)."""
    try:
        return run_on_ranks(RANKS, cores, train_steps, layers, engine, steps)
    except Exception as err:  # a killed or failed rank
        print(
            f"  {engine} at {layers} layers failed: {str(err).splitlines()[-1][:120]}", flush=True
        )
        return None


def largest(engine: str, budget: float, cores: int, small: tuple[int, int]) -> dict:
    estimate_layers = max(
        (n for n in range(1, 400) if _estimate(n) <= budget), default=1
    )  # model.inspect's AdamW state, 2 shards (summed), no activations
    fit = {n: attempt(n, engine, 2, cores) for n in small}
    if any(v is None for v in fit.values()):
        return {"error": "the small fit runs failed"}
    (n1, r1), (n2, r2) = sorted(fit.items())
    per_param = (r2["peak_bytes"] - r1["peak_bytes"]) / (parameters(n2) - parameters(n1))
    base = r1["peak_bytes"] - per_param * parameters(n1)
    layers = max(n for n in range(1, 400) if base + per_param * parameters(n) <= budget)
    print(
        f"{engine}: {per_param:.1f} bytes/param measured (+{base / GIB:.2f} GiB); estimate "
        f"{estimate_layers} layers, fit {layers} layers ({parameters(layers) / 1e9:.2f}B)",
        flush=True,
    )
    while layers >= 1:
        confirmed = attempt(layers, engine, 2, cores)
        if confirmed is not None and confirmed["peak_bytes"] <= budget:
            return {
                "layers": layers,
                "params": parameters(layers),
                "peak_gib": round(confirmed["peak_bytes"] / GIB, 2),
                "bytes_per_param_fit": round(per_param, 2),
                "base_gib_fit": round(base / GIB, 2),
                "estimate_layers": estimate_layers,
                "two_steps_s": round(confirmed["seconds"], 1),
                "losses": [round(v, 4) for v in confirmed["losses"]],
            }
        layers = min(layers - 1, int(layers * 0.9))  # a failure: 10% smaller
    return {"error": "nothing fits"}


def _estimate(layers: int) -> float:
    return training_memory(parameters(layers), "fp32", shards=RANKS).total


def available_bytes() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return float(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def nvme_available() -> bool:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return bool(AsyncIOBuilder().is_compatible(verbose=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-fraction", type=float, default=0.75)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "deepspeed_largest_cpu.json"
    )
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    budget = args.budget_fraction * available_bytes()
    print(f"budget {budget / GIB:.1f} GiB ({args.budget_fraction:.0%} of the memory available)")
    results = {}
    for engine in args.engines.split(","):
        results[engine] = largest(engine, budget, cores, small=(2, 6))
        print(engine, results[engine], flush=True)
    report = {
        "benchmark": "deepspeed_largest",
        "machine": machine(("torch", "deepspeed")),
        "budget_gib": round(budget / GIB, 2),
        "model": WIDTH | {"seq_len": SEQ, "global_batch": BATCH, "precision": "fp32"},
        "nvme_offload": "available" if nvme_available() else "unavailable (no libaio)",
        "results": results,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
