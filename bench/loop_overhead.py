"""What the trainer's loop costs around its step: `python -m trainer` in eager mode (data loader
worker, schedule, logging, progress, metrics; evaluation and checkpoints excluded from its
logged windows) against the same step function timed alone on random tokens
(bench/train_throughput.py's `lmforge` child: the trainer's engine and `train_step`), and that
step against transformers' eager Llama with the same allocator setting
(`transformers_malloc_keep`). The three take turns, --rounds times, because this machine's
speed drifts by 10-25% within minutes: compare within a round.

    python bench/loop_overhead.py [--rounds 3] [--steps 60]
Writes bench/results/loop_overhead_cpu.json (_fp32 before .json where precision=auto takes fp32).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import torch

from bench.default_speed import BATCH, KEEP, SEQ_LEN, run_trainer, transformers_tokens_per_s
from bench.machine import machine
from parallel.precision import resolve_precision


def one_round(steps: int, workers: int) -> dict:
    """The trainer's in-run tokens/s (median of its windows after the first two), then the step
    alone, then transformers with the same allocator, each in a fresh process."""
    overrides = [
        "trainer.compile=false",
        f"trainer.max_steps={steps}",
        "trainer.eval_every=0",
        f"data.num_workers={workers}",
    ]
    with tempfile.TemporaryDirectory() as cache:
        run = run_trainer(overrides, Path(cache))
    step = transformers_tokens_per_s("lmforge")
    peer = transformers_tokens_per_s(KEEP)
    return {
        "trainer_tokens_per_s": run["steady_tokens_per_s"],
        "step_alone_tokens_per_s": step,
        "transformers_malloc_keep_tokens_per_s": peer,
        "loop_vs_step_alone": run["steady_tokens_per_s"] / step,
        "step_vs_transformers_same_malloc": step / peer,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="training steps per trainer run")
    parser.add_argument("--workers", type=int, default=1, help="data.num_workers (default 1)")
    args = parser.parse_args()
    if args.steps < 40:
        raise SystemExit("--steps must be >= 40: the medians skip the first two 10-step windows")
    rounds = []
    for index in range(args.rounds):
        row = one_round(args.steps, args.workers)
        rounds.append(row)
        print(
            f"round {index + 1}: trainer {row['trainer_tokens_per_s']:.0f} tok/s, step alone "
            f"{row['step_alone_tokens_per_s']:.0f}, transformers (same allocator) "
            f"{row['transformers_malloc_keep_tokens_per_s']:.0f}: loop/step "
            f"{row['loop_vs_step_alone']:.3f}, step/transformers "
            f"{row['step_vs_transformers_same_malloc']:.3f}"
        )
    precision = resolve_precision("auto", torch.device("cpu"))
    summary = {
        key: {"median": statistics.median(r[key] for r in rounds)}
        | {"min": min(r[key] for r in rounds), "max": max(r[key] for r in rounds)}
        for key in ("loop_vs_step_alone", "step_vs_transformers_same_malloc")
    }
    result = {
        "benchmark": "loop_overhead",
        "args": vars(args),
        "batch": BATCH,
        "seq_len": SEQ_LEN,
        "precision": precision,
        "machine": machine(("torch", "transformers"), torch_threads=torch.get_num_threads()),
        "summary": summary,
        "rounds": rounds,
    }
    suffix = "_fp32" if precision == "fp32" else ""
    out = ROOT / "bench" / "results" / f"loop_overhead_cpu{suffix}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
