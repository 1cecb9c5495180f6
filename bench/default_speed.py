"""The default command's speed against transformers' eager LlamaForCausalLM, compile time
included: `python -m trainer` (no overrides: 300 steps of 8 x 256 tokens, trainer.compile=auto,
which keeps a run this short eager) run whole, and with trainer.compile=true from an empty
compile cache (a first run) and again with the cache it left (every later run);
transformers' eager step on the same model, batch and sequence length
(bench/train_throughput.py's child) is timed before and after them, as users run it and with
the allocator setting the trainer makes on CPU (trainer.cpu_malloc=keep); the default run is also
repeated with trainer.cpu_malloc=system.

A run's training time is the sum of its logged windows (evaluation and checkpoints excluded,
the first steps' compilation included); its tokens/s are all its tokens over that time.

    python bench/default_speed.py
Writes bench/results/default_speed_cpu.json.
"""

from __future__ import annotations

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
from bench.machine import machine

BATCH, SEQ_LEN = 8, 256  # conf/trainer/default.yaml, conf/data/default.yaml
RUNS = {  # name -> (overrides, compile cache: "fresh" or "reused": the first run's)
    "python -m trainer (default)": ([], "fresh"),
    "trainer.cpu_malloc=system (glibc's defaults)": (["trainer.cpu_malloc=system"], "fresh"),
    "trainer.compile=true, first run (empty compile cache)": (["trainer.compile=true"], "fresh"),
    "trainer.compile=true, later runs (cache on disk)": (["trainer.compile=true"], "reused"),
}


def transformers_tokens_per_s(variant: str = "transformers") -> float:
    """Steady-state tokens/s of transformers' eager Llama on the default batch (8 timed steps);
    variant "transformers_malloc_keep": with the trainer's CPU allocator setting."""
    cmd = [sys.executable, str(ROOT / "bench" / "train_throughput.py"), "--child", variant]
    cmd += ["--batch", str(BATCH), "--seq-len", str(SEQ_LEN), "--steps", "8", "--warmup", "3"]
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


def main() -> None:
    before = transformers_tokens_per_s()
    keep_before = transformers_tokens_per_s("transformers_malloc_keep")
    rows = {}
    with tempfile.TemporaryDirectory() as caches:
        previous = Path(caches) / "none"
        for i, (name, (overrides, cache)) in enumerate(RUNS.items()):
            fresh = Path(caches) / str(i)  # no spaces: the C++ compiler gets this path
            rows[name] = run_trainer(overrides, previous if cache == "reused" else fresh)
            previous = fresh
            print(name, json.dumps({k: v for k, v in rows[name].items() if k != "compile"}))
    after = transformers_tokens_per_s()
    keep_after = transformers_tokens_per_s("transformers_malloc_keep")
    reference, keep_reference = (before + after) / 2, (keep_before + keep_after) / 2
    for row in rows.values():
        row["vs_transformers_eager"] = row["tokens_per_s"] / reference
        row["steady_vs_transformers_eager"] = row["steady_tokens_per_s"] / reference
        row["vs_transformers_eager_same_malloc"] = row["tokens_per_s"] / keep_reference
    report = {
        "benchmark": "default_speed",
        "batch": BATCH,
        "seq_len": SEQ_LEN,
        "machine": machine(("torch", "transformers")),
        "transformers_eager_tokens_per_s": {"before": before, "after": after},
        # the same with glibc keeping freed blocks, as the trainer sets it (trainer/cpu_malloc.py)
        "transformers_eager_malloc_keep_tokens_per_s": {"before": keep_before, "after": keep_after},
        "runs": rows,
    }
    print(f"transformers eager: {before:.0f} tok/s before, {after:.0f} after")
    print(f"  with malloc keep: {keep_before:.0f} tok/s before, {keep_after:.0f} after")
    print(
        "| run | compile | training s | tokens/s | vs transformers eager | steady | "
        "vs transformers, same malloc | wall s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['compile'].split(' (')[0]} | {r['training_seconds']:.1f} | "
            f"{r['tokens_per_s']:.0f} | {r['vs_transformers_eager']:.2f}x | "
            f"{r['steady_vs_transformers_eager']:.2f}x | "
            f"{r['vs_transformers_eager_same_malloc']:.2f}x | {r['wall_seconds']:.1f} |"
        )
    out = Path(__file__).parent / "results" / "default_speed_cpu.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
