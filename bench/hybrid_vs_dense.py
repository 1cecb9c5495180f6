"""`tiny_hybrid` (Gated DeltaNet 3:1 with gated GQA) vs `tiny` (all GQA) on the default corpus:
the same command, steps, batch and tokens (`python -m trainer model=<preset>`, 300 steps), with
parameter counts within 1%. Reports the validation curve, the training-sample loss and tokens/s.

    python bench/hybrid_vs_dense.py
Writes bench/results/hybrid_vs_dense_cpu.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.machine import machine

PRESETS = ("tiny", "tiny_hybrid")


def run(preset: str, tmp: Path) -> dict:
    run_dir = tmp / preset
    env = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "trainer", f"model={preset}", f"hydra.run.dir={run_dir}"]
    command.append("trainer.compile=false")  # eager, as measured for the README (auto compiles)
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "val_loss" in r]
    speeds = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    return {
        "preset": preset,
        "wall_seconds": round(wall, 1),
        "validation": [[r["step"], round(r["val_loss"], 4)] for r in evals],
        "train_sample": [[r["step"], round(r["train_eval_loss"], 4)] for r in evals],
        "median_tokens_per_s": round(sorted(speeds)[len(speeds) // 2], 1),
    }


def main() -> None:
    from model.accounting import param_counts
    from model.presets import load_preset
    from model.transformer import build_model

    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(p, Path(tmp)) for p in PRESETS]
    for row in rows:
        model = build_model(load_preset(row["preset"]), device="meta")
        row["parameters"] = param_counts(model).total
        print(
            f"{row['preset']}: {row['parameters']:,} parameters, validation "
            f"{row['validation'][0][1]} -> {row['validation'][-1][1]}, training sample "
            f"{row['train_sample'][-1][1]}, {row['median_tokens_per_s']:.0f} tokens/s"
        )
    report = {"benchmark": "hybrid_vs_dense", "machine": machine(), "rows": rows}
    out = ROOT / "bench" / "results" / "hybrid_vs_dense_cpu.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
