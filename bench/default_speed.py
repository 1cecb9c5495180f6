"""The default command's speed against transformers' eager LlamaForCausalLM, compile time
included: `python -m trainer` (no overrides: 300 steps of 8 x 256 tokens, trainer.compile=auto)
run whole from an empty compile cache (a first run on a new machine), taking turns with the
same run eager (trainer.compile=false), --default-runs times each; then once more with the
compile cache the last run left (every later run on that machine). This machine's speed drifts
by 10-25% within minutes, so transformers' eager step on the same model, batch and sequence
length (bench/train_throughput.py's child), as users run it and with the allocator setting the
trainer makes on CPU (trainer.cpu_malloc=keep), is timed between every two runs: each run is
compared with the mean of the measurements just before and just after it. Both sides run in
the precision `trainer.precision=auto` takes on this CPU (bf16 autocast where it has bf16
instructions, else fp32: transformers then runs in fp32, as users run it there).

A run's training time is the sum of its logged windows (evaluations and checkpoints excluded,
the first steps' compilation included); its tokens/s are all its tokens over that time.

    python bench/default_speed.py [--default-runs 3] [--transformers-steps 8] [--default-only]
Writes bench/results/default_speed_cpu.json (--default-only: the default runs alone, into
default_speed_cpu_default_only.json; either with _fp32 before .json where auto takes fp32).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import torch

from bench.machine import machine
from parallel.precision import resolve_precision

BATCH, SEQ_LEN = 8, 256  # the defaults: TrainerConfig.batch_size, LoaderConfig.seq_len
DEFAULT_RUN = "python -m trainer (default)"  # run --default-runs times, from an empty cache
KEEP = "transformers_malloc_keep"
EAGER_RUN = ("trainer.compile=false (eager)", ["trainer.compile=false"], "fresh")
LATER_RUN = ("python -m trainer, a later run (the compile cache on disk)", [], "reused")


def transformers_tokens_per_s(variant: str = "transformers", steps: int = 8) -> float:
    """Steady-state tokens/s of transformers' eager Llama on the default batch (the median of
    `steps` timed steps); variant "transformers_malloc_keep": with the trainer's CPU allocator
    setting."""
    cmd = [sys.executable, str(ROOT / "bench" / "train_throughput.py"), "--child", variant]
    cmd += [
        "--batch",
        str(BATCH),
        "--seq-len",
        str(SEQ_LEN),
        "--steps",
        str(steps),
        "--warmup",
        "3",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"]


def run_trainer(overrides: list[str], cache: Path) -> dict:
    """One whole `python -m trainer` run: wall time, training time, tokens, the compile line."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        env = os.environ | {"HF_DATASETS_OFFLINE": "1", "TORCHINDUCTOR_CACHE_DIR": str(cache)}
        command = [sys.executable, "-m", "trainer", f"hydra.run.dir={run_dir}", *overrides]
        start = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        log = (run_dir / "train.log").read_text()
    train = [r for r in rows if "tokens_per_s" in r]
    seconds, previous = 0.0, 0
    for row in train:  # each window: its tokens over its tokens/s
        seconds += (row["tokens"] - previous) / row["tokens_per_s"]
        previous = row["tokens"]
    line = next(x for x in log.splitlines() if "torch.compile:" in x)
    return {
        "wall_seconds": wall,
        "training_seconds": seconds,
        "tokens": previous,
        "tokens_per_s": previous / seconds,
        "first_window_seconds": train[0]["tokens"] / train[0]["tokens_per_s"],
        "steady_tokens_per_s": statistics.median(r["tokens_per_s"] for r in train[2:]),
        "compile": line.split("torch.compile: ", 1)[1],
        "final_loss": train[-1]["loss"],
        "peak_rss_mib": max(r.get("rss", 0) for r in train) / 2**20,  # resident memory, logged
    }


def transformers_pair(steps: int) -> dict[str, float]:
    """transformers' eager tokens/s as users run it, and with the trainer's allocator setting."""
    return {
        "plain": transformers_tokens_per_s(steps=steps),
        "keep": transformers_tokens_per_s(KEEP, steps=steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--default-runs", type=int, default=3, help="repeats of the default run")
    parser.add_argument("--transformers-steps", type=int, default=8, help="timed, per bracket")
    parser.add_argument(
        "--default-only", action="store_true", help="only the default runs (a separate JSON)"
    )
    args = parser.parse_args()
    args.default_runs = max(1, args.default_runs)
    if args.default_only:
        runs = [(DEFAULT_RUN, [], "fresh")] * args.default_runs
    else:  # taking turns with eager runs, then a run with the last default run's cache
        runs = [(DEFAULT_RUN, [], "fresh"), EAGER_RUN] * args.default_runs
        runs = [*runs[:-1], LATER_RUN, EAGER_RUN]
    rows = []
    bracket = transformers_pair(args.transformers_steps)  # measured before each run and after it
    with tempfile.TemporaryDirectory() as caches:
        previous = Path(caches) / "none"
        for i, (name, overrides, cache) in enumerate(runs):
            fresh = Path(caches) / str(i)  # no spaces: the C++ compiler gets this path
            row = {"run": name} | run_trainer(overrides, previous if cache == "reused" else fresh)
            previous = fresh
            after = transformers_pair(args.transformers_steps)
            plain = (bracket["plain"] + after["plain"]) / 2
            keep = (bracket["keep"] + after["keep"]) / 2
            row |= {
                "transformers_tokens_per_s": {"before": bracket["plain"], "after": after["plain"]},
                "transformers_malloc_keep_tokens_per_s": {
                    "before": bracket["keep"], "after": after["keep"]
                },
                "vs_transformers_eager": row["tokens_per_s"] / plain,
                "steady_vs_transformers_eager": row["steady_tokens_per_s"] / plain,
                "vs_transformers_eager_same_malloc": row["tokens_per_s"] / keep,
            }  # fmt: skip
            bracket = after
            rows.append(row)
            print(name, json.dumps({k: v for k, v in row.items() if k != "compile"}))
    defaults = [r["vs_transformers_eager"] for r in rows if r["run"] == DEFAULT_RUN]
    report = {
        "benchmark": "default_speed",
        "args": vars(args),
        "batch": BATCH,
        "seq_len": SEQ_LEN,
        "precision": resolve_precision("auto", torch.device("cpu")),
        "machine": machine(("torch", "transformers")),
        "default_run_vs_transformers_eager": {
            "median": statistics.median(defaults), "min": min(defaults), "max": max(defaults)
        },
        "runs": rows,
    }  # fmt: skip
    print(
        "| run | compile | training s | tokens/s | transformers tok/s (before, after) | "
        "vs transformers eager | steady | vs transformers, same malloc | peak RSS | wall s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        t = r["transformers_tokens_per_s"]
        print(
            f"| {r['run']} | {r['compile'].split(' (')[0]} | {r['training_seconds']:.1f} | "
            f"{r['tokens_per_s']:.0f} | {t['before']:.0f}, {t['after']:.0f} | "
            f"{r['vs_transformers_eager']:.2f}x | {r['steady_vs_transformers_eager']:.2f}x | "
            f"{r['vs_transformers_eager_same_malloc']:.2f}x | {r['peak_rss_mib']:.0f} MiB | "
            f"{r['wall_seconds']:.1f} |"
        )
    name = "default_speed_cpu_default_only" if args.default_only else "default_speed_cpu"
    name += "_fp32" if report["precision"] == "fp32" else ""
    out = Path(__file__).parent / "results" / f"{name}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
