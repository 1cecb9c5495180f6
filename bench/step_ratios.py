"""Steady-state training-step ratios against transformers' eager LlamaForCausalLM, with the
machine's drift cancelled: each variant (bench/train_throughput.py's `build`: the same tiny
model, batch, AdamW and clipping) lives in its own process for the whole run, and the processes
take turns, a few steps each, round after round (the order rotating, after one untimed turn
each), so that a change of the machine's speed falls on all of them alike. Each round's ratios
come from that round's medians.

Variants: transformers as users run it (glibc's allocator defaults), transformers with the
allocator setting the trainer makes on CPU (trainer.cpu_malloc=keep), the trainer's eager step
(trainer.compile=false) and its compiled step (trainer.compile=true, what the default 300-step
`python -m trainer` runs, after compilation). Separate processes because the allocator setting is per process.

    python bench/step_ratios.py [--batch 8] [--seq-len 256] [--rounds 12] [--steps-per-turn 3]
Writes bench/results/step_ratios_cpu_<batch>x<seq_len>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.machine import machine

VARIANTS = ("transformers", "transformers_malloc_keep", "lmforge", "lmforge_compiled")
BASELINE, SAME_MALLOC = "transformers", "transformers_malloc_keep"
WARMUP_STEPS = 3  # the compiled variant compiles in its first step


def serve(variant: str, batch: int, seq_len: int) -> None:
    """Child: build the variant, warm it up, then run the steps asked for on stdin ("N"),
    answering each request with one JSON line of per-step seconds; "quit" ends it."""
    import torch

    from bench.train_throughput import build

    step = build(variant)
    x = torch.randint(0, 8192, (batch, seq_len))
    y = torch.randint(0, 8192, (batch, seq_len))
    for _ in range(WARMUP_STEPS):
        step(x, y)
    print(json.dumps({"ready": variant}), flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            return
        times = []
        for _ in range(int(line)):
            start = time.perf_counter()
            step(x, y)
            times.append(time.perf_counter() - start)
        print(json.dumps(times), flush=True)


def start(variant: str, args: argparse.Namespace) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--serve", variant]
    cmd += ["--batch", str(args.batch), "--seq-len", str(args.seq_len)]
    child = subprocess.Popen(
        cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
    )
    ready = child.stdout.readline()  # waits for its warm-up (one at a time: no contention)
    if json.loads(ready or "{}").get("ready") != variant:
        raise SystemExit(f"{variant}: the child did not start (exit {child.wait()}): {ready!r}")
    return child


def turn(child: subprocess.Popen, steps: int) -> list[float]:
    child.stdin.write(f"{steps}\n")
    answer = child.stdout.readline()
    if not answer:
        raise SystemExit(f"a child stopped (exit {child.wait()}): see its output above")
    return json.loads(answer)


def stop(child: subprocess.Popen) -> None:
    if child.poll() is None:
        child.stdin.write("quit\n")
        child.stdin.close()
    child.wait()


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps-per-turn", type=int, default=3)
    parser.add_argument("--serve", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.batch, args.seq_len)
        return
    children: dict[str, subprocess.Popen] = {}
    rounds = []
    try:
        for variant in VARIANTS:
            children[variant] = start(variant, args)
        for child in children.values():  # an untimed turn each: the first ones waited longest
            turn(child, 1)
        for index in range(args.rounds):
            order = VARIANTS[index % len(VARIANTS) :] + VARIANTS[: index % len(VARIANTS)]
            medians = {v: statistics.median(turn(children[v], args.steps_per_turn)) for v in order}
            rounds.append(medians)
            print(
                f"round {index}: " + ", ".join(f"{v} {t * 1e3:.0f} ms" for v, t in medians.items())
            )
    finally:
        for child in children.values():
            stop(child)
    ours = [v for v in VARIANTS if v.startswith("lmforge")]
    ratios = {
        f"{v}_vs_{base}": summary([r[base] / r[v] for r in rounds])
        for v in ours
        for base in (BASELINE, SAME_MALLOC)
    }
    tokens = args.batch * args.seq_len
    report = {
        "benchmark": "step_ratios",
        "args": vars(args) | {"serve": None},
        "machine": machine(("torch", "transformers")),
        "seconds_per_step": {v: summary([r[v] for r in rounds]) for v in VARIANTS},
        "tokens_per_s_median": {
            v: tokens / statistics.median(r[v] for r in rounds) for v in VARIANTS
        },
        "speedup": ratios,
        "rounds": rounds,
    }
    for name, stats in ratios.items():
        print(f"{name}: median {stats['median']:.2f}x ({stats['min']:.2f}-{stats['max']:.2f}x)")
    out = ROOT / "bench" / "results" / f"step_ratios_cpu_{args.batch}x{args.seq_len}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
