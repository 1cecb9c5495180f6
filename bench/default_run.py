"""The default run as users start it (`python -m trainer`, no overrides), measured: wall time,
the validation curve (sampled over the whole validation split) and the loss on the fixed
training sample, side by side.

    python bench/default_run.py
Writes bench/results/default_run_cpu.json and default_run_loss.png (the run's own loss.png).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.machine import machine


def main() -> None:
    out = Path(__file__).parent / "results"
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        env = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
        command = [sys.executable, "-m", "trainer", f"hydra.run.dir={run_dir}"]
        start = time.perf_counter()
        subprocess.run(command, cwd=ROOT, env=env, check=True)  # not a terminal: no bar
        wall = time.perf_counter() - start
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        shutil.copy(run_dir / "loss.png", out / "default_run_loss.png")
    evals = [r for r in rows if "val_loss" in r]
    report = {
        "command": "python -m trainer",
        "wall_seconds": round(wall, 1),
        "machine": machine(),
        "validation": [[r["step"], round(r["val_loss"], 4)] for r in evals],
        "train_sample": [
            [r["step"], round(r.get("train_eval_loss", float("nan")), 4)] for r in evals
        ],
        "evaluated": {k: evals[-1][k] for k in ("val_windows", "val_tokens", "val_documents")},
        "metrics": rows,
    }
    (out / "default_run_cpu.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("wall_seconds", "validation", "train_sample")}))


if __name__ == "__main__":
    main()
