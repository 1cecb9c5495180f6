"""AdamW vs Muon vs MuonClip on the default corpus and tiny model: the same steps and tokens,
a small learning-rate sweep for each, through the real command (`python -m trainer`).

Reports each run's final validation loss, and for the best Muon run how many tokens it needed
to reach the best AdamW run's final validation loss (interpolated between evaluations).

    python bench/optimizer_sweep.py [--steps 150] [--eval-every 25]
Writes bench/results/optimizer_sweep_cpu.json and optimizer_sweep_cpu.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.machine import machine

RUNS = [
    ("adamw", 3e-3),
    ("adamw", 6e-3),
    ("adamw", 1.2e-2),
    ("muon", 3e-3),
    ("muon", 6e-3),
    ("muon", 1.2e-2),
]


def train(optimizer: str, lr: float, args: argparse.Namespace, run_dir: Path) -> list[dict]:
    command = [sys.executable, "-m", "trainer", f"optim={optimizer}", f"optim.lr={lr}"]
    command += [f"trainer.max_steps={args.steps}", f"trainer.eval_every={args.eval_every}"]
    command += ["trainer.sample_tokens=0", "checkpoint.every=0", "logging.progress=false"]
    command += [f"hydra.run.dir={run_dir}"]
    env = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "val_loss" in r]


def tokens_to_reach(curve: list[dict], target: float) -> float | None:
    """First token count where the validation loss reaches `target` (linear interpolation)."""
    for before, after in pairwise(curve):
        if after["val_loss"] <= target:
            span = before["val_loss"] - after["val_loss"]
            frac = (before["val_loss"] - target) / span if span > 0 else 1.0
            return before["tokens"] + frac * (after["tokens"] - before["tokens"])
    return None


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        curve = r["curve"][1:]  # skip step 0 (the same for all)
        label = f"{r['optimizer']} lr={r['lr']:g}"
        ax.plot([p["tokens"] for p in curve], [p["val_loss"] for p in curve], label=label)
    ax.set_xlabel("tokens")
    ax.set_ylabel("validation loss")
    ax.set_title("tiny model, default corpus: AdamW vs Muon vs MuonClip")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--eval-every", type=int, default=25)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = list(RUNS)
        for index, (optimizer, lr) in enumerate(runs):
            curve = train(optimizer, lr, args, Path(tmp) / f"run{index}")
            results.append({"optimizer": optimizer, "lr": lr, "curve": curve})
            print(
                f"{optimizer:9s} lr {lr:<7g} final validation loss {curve[-1]['val_loss']:.4f}",
                flush=True,
            )
            if index == len(RUNS) - 1:  # MuonClip at the best Muon learning rate
                muon = [r for r in results if r["optimizer"] == "muon"]
                best = min(muon, key=lambda r: r["curve"][-1]["val_loss"])
                runs.append(("muonclip", best["lr"]))
        if len(results) < len(runs):
            optimizer, lr = runs[-1]
            curve = train(optimizer, lr, args, Path(tmp) / "clip")
            results.append({"optimizer": optimizer, "lr": lr, "curve": curve})
            print(
                f"{optimizer:9s} lr {lr:<7g} final validation loss {curve[-1]['val_loss']:.4f}",
                flush=True,
            )

    def best(name: str) -> dict:
        return min(
            (r for r in results if r["optimizer"] == name), key=lambda r: r["curve"][-1]["val_loss"]
        )

    adamw, muon = best("adamw"), best("muon")
    target = adamw["curve"][-1]["val_loss"]
    reached = tokens_to_reach(muon["curve"], target)
    total = adamw["curve"][-1]["tokens"]
    summary = {
        "adamw_best": {"lr": adamw["lr"], "final_val_loss": target},
        "muon_best": {"lr": muon["lr"], "final_val_loss": muon["curve"][-1]["val_loss"]},
        "muon_tokens_to_adamw_final_loss": reached,
        "token_ratio_muon_over_adamw": (reached / total) if reached else None,
    }
    print(json.dumps(summary, indent=2))
    out = Path(__file__).parent / "results"
    report = {
        "benchmark": "optimizer_sweep",
        "args": vars(args),
        "machine": machine(),
        "summary": summary,
        "runs": results,
    }
    (out / "optimizer_sweep_cpu.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(results, out / "optimizer_sweep_cpu.png")
    print(f"wrote {out / 'optimizer_sweep_cpu.json'}")


if __name__ == "__main__":
    main()
