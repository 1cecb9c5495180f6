"""Why the eager step's GEMMs take longer inside the step than bench/mfu_ceiling.py's bound
says they need: the bound times each GEMM in a loop on the same operands, which then sit in the
caches (this CPU: 2 MiB L2 per core, 32 MiB L3), while inside a step each GEMM reads operands
that other kernels wrote or that have not been touched since the forward pass.

Each GEMM call of one eager training step of the default model (8 x 256, bf16 autocast, the
trainer's engine; bench/train_throughput.py's `build`) is recorded with its operands and timed
four ways in the same run, in rounds taking turns:
  * in the step: every mm / bmm / baddbmm / addmm call timed by a TorchDispatchMode while the
    step runs (bench/step_gemm_share.py's GemmTimer);
  * hot: each call repeated alone in a loop, median (what the bound assumes);
  * cold: each call alone after the caches were flushed (a 128 MiB buffer rewritten), median;
  * replayed: all calls back to back in the step's order, nothing else between them.
A cold sum near the in-step sum says the bound's hot timing is the gap: a step whose working
set exceeds the caches cannot reach it.

    python bench/gemm_caches.py [--rounds 3] [--repeats 3]
Writes bench/results/gemm_caches_cpu.json.
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
from bench.gemm_layouts import BADDBMM, BMM, GemmRecorder, warm_default_step
from bench.machine import machine
from bench.step_gemm_share import GemmTimer
from trainer.mfu import measure_matmul_peak

FLUSH = torch.ones(32 * 2**20)  # 128 MiB of fp32: 4x the L3


def flush_caches() -> None:
    FLUSH.mul_(1.0)  # reads and writes every line: the GEMM operands leave L2 and L3


def call_seconds(call: tuple, cold: bool, repeats: int) -> float:
    func, args, kwargs = call
    func(*args, **kwargs)
    times = []
    for _ in range(repeats):
        if cold:
            flush_caches()
        start = time.perf_counter()
        func(*args, **kwargs)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def replay_seconds(calls: list[tuple]) -> float:
    start = time.perf_counter()
    for func, args, kwargs in calls:
        func(*args, **kwargs)
    return time.perf_counter() - start


def split(calls: list[tuple], seconds: list[float]) -> dict[str, float]:
    """Seconds of the projection and head GEMMs (mm, addmm) and of attention's (bmm, baddbmm)."""
    attention = sum(s for (f, _, _), s in zip(calls, seconds) if f in (BMM, BADDBMM))
    return {"all": sum(seconds), "projection_and_head": sum(seconds) - attention,
            "attention": attention}  # fmt: skip


def one_round(step, x, y, repeats: int) -> dict:
    timer = GemmTimer()
    with timer:
        step(x, y)
    in_step = {"all": timer.seconds, "attention": timer.batched_seconds}
    in_step["projection_and_head"] = timer.seconds - timer.batched_seconds
    recorder = GemmRecorder()
    with recorder:
        step(x, y)
    calls = recorder.calls
    hot = [call_seconds(c, cold=False, repeats=repeats) for c in calls]
    cold = [call_seconds(c, cold=True, repeats=repeats) for c in calls]
    replay_seconds(calls)
    replayed = statistics.median(replay_seconds(calls) for _ in range(repeats))
    start = time.perf_counter()
    for _ in range(repeats):
        step(x, y)
    return {
        "calls": len(calls),
        "step_seconds": (time.perf_counter() - start) / repeats,
        "in_step": in_step,
        "hot": split(calls, hot),
        "cold": split(calls, cold),
        "replayed_in_order": replayed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    step, x, y = warm_default_step(3)
    rounds = []
    for index in range(args.rounds):
        rounds.append(one_round(step, x, y, args.repeats))
        r = rounds[-1]
        print(
            f"round {index}: step {r['step_seconds'] * 1e3:.0f} ms; GEMMs in the step "
            f"{r['in_step']['all'] * 1e3:.0f}, hot {r['hot']['all'] * 1e3:.0f}, cold "
            f"{r['cold']['all'] * 1e3:.0f}, replayed {r['replayed_in_order'] * 1e3:.0f} ms",
            flush=True,
        )
    peak = measure_matmul_peak(torch.device("cpu"), torch.bfloat16, seconds=2.0)
    medians = {
        way: {part: statistics.median(r[way][part] for r in rounds) for part in rounds[0][way]}
        for way in ("in_step", "hot", "cold")
    }
    medians["replayed_in_order"] = statistics.median(r["replayed_in_order"] for r in rounds)
    result = {"benchmark": "gemm_caches", "machine": machine(), "args": vars(args)}
    result |= {"bf16_matmul_peak_flops": peak, "medians": medians, "rounds": rounds}
    out = ROOT / "bench" / "results" / "gemm_caches_cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(medians, indent=2))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
