"""How much of an eager training step is GEMMs, measured inside the step: transformers' eager
LlamaForCausalLM and the trainer's eager step (bench/train_throughput.py's `build`: the default
tiny model, 8 x 256, bf16 autocast, AdamW, clipping), both with the trainer's allocator setting;
the trainer's compiled step (trainer.compile=true) is timed alongside, whole.

Each round times a few plain steps, then a few steps under a TorchDispatchMode that times every
mm / bmm / baddbmm / addmm call with perf_counter (the mode slows the other ops, not the GEMMs
it times); "other" is the plain step minus the GEMMs. Each eager step's GEMM calls are also
timed alone, each in a loop (the isolated speed bench/mfu_ceiling.py's bound assumes), and the
bf16 matmul peak is measured. transformers' attention is SDPA's flash kernel (in "other"); the
trainer's is the matmul kernel, whose bmm / baddbmm are GEMMs (reported apart). The compiled
step's GEMMs run inside Inductor's code and are not timed: its "other" is an estimate that takes
them as the eager step's. A target of `speedup` x transformers leaves the trainer's step
transformers_step / speedup; minus the GEMMs as they run in the step, that is the time left for
everything else (norms, RoPE, SwiGLU, softmax, casts, the loss's softmax, the optimizer).

    python bench/step_gemm_share.py [--rounds 5] [--steps 3] [--speedup 1.4]
Writes bench/results/step_gemm_share_cpu.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.machine import machine
from bench.train_throughput import build
from trainer.mfu import measure_matmul_peak

GEMMS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten.addmm.default,
}
BATCHED = {torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default}
VARIANTS = {
    "transformers": "transformers_malloc_keep",
    "trainer": "lmforge",
    "trainer_compiled": "lmforge_compiled",  # plain steps only: its GEMMs run inside Inductor
}
COMPILED = "trainer_compiled"
EAGER = [name for name in VARIANTS if name != COMPILED]


class GemmTimer(TorchDispatchMode):
    """Sums the wall time of every GEMM call; records each call's op and operand layouts."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = 0.0
        self.batched_seconds = 0.0  # bmm / baddbmm: the matmul attention's GEMMs
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in GEMMS:
            return func(*args, **(kwargs or {}))
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.seconds += time.perf_counter() - start
        if func in BATCHED:
            self.batched_seconds += time.perf_counter() - start
        self.calls.append((func, [a for a in args if isinstance(a, torch.Tensor)], kwargs))
        return out


def isolated_gemm_seconds(calls: list[tuple], repeats: int = 5) -> float:
    """The same GEMM calls (same operands), each repeated alone in a loop: the median per call."""
    total = 0.0
    for func, tensors, kwargs in calls:
        func(*tensors, **(kwargs or {}))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            func(*tensors, **(kwargs or {}))
            times.append(time.perf_counter() - start)
        total += statistics.median(times)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--speedup", type=float, default=1.4)
    args = parser.parse_args()
    steps = {name: build(variant) for name, variant in VARIANTS.items()}
    x = torch.randint(0, 8192, (8, 256))
    y = torch.randint(0, 8192, (8, 256))
    for step in steps.values():
        for _ in range(3):
            step(x, y)
    plain: dict[str, list[float]] = collections.defaultdict(list)
    gemm: dict[str, list[float]] = collections.defaultdict(list)
    batched: dict[str, list[float]] = collections.defaultdict(list)
    isolated: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, step in steps.items():
            for _ in range(args.steps):
                start = time.perf_counter()
                step(x, y)
                plain[name].append(time.perf_counter() - start)
            if name == COMPILED:
                continue
            for _ in range(args.steps):
                timer = GemmTimer()
                with timer:
                    step(x, y)
                gemm[name].append(timer.seconds)
                batched[name].append(timer.batched_seconds)
            if name not in isolated:
                isolated[name] = isolated_gemm_seconds(timer.calls)
                isolated[f"{name}_calls"] = len(timer.calls)
    peak = measure_matmul_peak(torch.device("cpu"), torch.bfloat16, seconds=2.0)
    result: dict = {"benchmark": "step_gemm_share", "machine": machine(), "args": vars(args)}
    result["bf16_matmul_peak_flops"] = peak
    for name in EAGER:
        step_s, gemm_s = statistics.median(plain[name]), statistics.median(gemm[name])
        result[name] = {
            "step_seconds": step_s,
            "gemm_seconds_in_step": gemm_s,
            "of_which_batched_attention_gemms": statistics.median(batched[name]),
            "other_seconds": step_s - gemm_s,
            "gemm_seconds_isolated": isolated[name],
            "gemm_calls": isolated[f"{name}_calls"],
            "step_seconds_all": plain[name],
            "gemm_seconds_all": gemm[name],
        }
    compiled = statistics.median(plain[COMPILED])
    result[COMPILED] = {
        "step_seconds": compiled,
        # an estimate: the compiled step's GEMMs taken as the eager step's (both call aten's mm)
        "other_seconds_if_its_gemms_take_the_eager_time": compiled
        - result["trainer"]["gemm_seconds_in_step"],
        "step_seconds_all": plain[COMPILED],
    }
    target = result["transformers"]["step_seconds"] / args.speedup
    result["target"] = {
        "speedup": args.speedup,
        "trainer_step_seconds": target,
        "left_for_non_gemm_seconds": target - result["trainer"]["gemm_seconds_in_step"],
        "trainer_non_gemm_seconds_now": result["trainer"]["other_seconds"],
        "trainer_vs_transformers_now": result["transformers"]["step_seconds"]
        / result["trainer"]["step_seconds"],
    }
    out = ROOT / "bench" / "results" / "step_gemm_share_cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    for name in EAGER:
        r = result[name]
        ms = {key: round(1e3 * value) for key, value in r.items() if isinstance(value, float)}
        print(
            f"{name}: step {ms['step_seconds']} ms = GEMMs {ms['gemm_seconds_in_step']} "
            f"(alone {ms['gemm_seconds_isolated']}) + other {ms['other_seconds']}"
        )
    print(json.dumps(result[COMPILED] | {"step_seconds_all": None}, indent=2))
    print(json.dumps(result["target"], indent=2))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
