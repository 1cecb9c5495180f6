"""Loss curves of a fixed set of short runs, for refactors that must not change the numbers.

    python bench/loss_curves.py record  bench/results/loss_curves_before.json
    python bench/loss_curves.py compare bench/results/loss_curves_before.json

`record` trains each case through the public command (`python -m trainer`, or torchrun for the
distributed cases) with a fixed seed and writes every logged train and validation loss;
`record` with case names re-records only those in an existing file;
`compare` re-runs the cases and reports, per case, whether every number is bitwise equal (exit 1
if any differs). Cases cover the default model in fp32 and bf16, MLA, MoE, the residual styles,
Muon and MuonClip, activation checkpointing, `trainer.compile=true` (fp32 and bf16), and FSDP2 /
expert parallelism on 2 gloo ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMON = [
    "trainer.max_steps=12",
    "trainer.log_every=1",
    "trainer.eval_every=6",
    "trainer.sample_tokens=0",
    "data.seq_len=128",
    "checkpoint.every=0",
    "logging.wandb=disabled",
    "optim.warmup_steps=3",
]
FP32 = ["trainer.precision=fp32"]
# explicit: the default (auto) is fp32 on CPUs without bf16 instructions (parallel/precision.py)
BF16 = ["trainer.precision=bf16"]
CASES: dict[str, tuple[int, list[str]]] = {  # name -> (ranks, overrides)
    "default_bf16": (1, BF16),
    "tiny_fp32": (1, FP32),
    "tiny_post_fp32": (1, [*FP32, "model.residual=post"]),
    "tiny_deepnorm_fp32": (1, [*FP32, "model.residual=deepnorm"]),
    "tiny_mla_muonclip_fp32": (1, [*FP32, "model=tiny_mla", "optim=muonclip"]),
    "tiny_moe_muon_fp32": (1, [*FP32, "model=tiny_moe", "optim=muon"]),
    "tiny_bf16_master_ac": (
        1,
        ["trainer.precision=bf16_master", "parallel.activation_checkpoint=selective"],
    ),
    # trainer.compile=true: the compiled blocks and the compiled loss chunk (model.loss's
    # loss_chunk_fusable) differ from eager in rounding, so compare these with their own record
    "tiny_fp32_compiled": (1, [*FP32, "trainer.compile=true"]),
    "default_bf16_compiled": (1, [*BF16, "trainer.compile=true"]),
    "fsdp2_fp32": (2, [*FP32, "parallel.activation_checkpoint=full"]),
    "ep2_moe_fp32": (2, [*FP32, "model=tiny_moe", "parallel.ep=2"]),
}


def run_case(name: str, ranks: int, overrides: list[str], tmp: Path) -> dict:
    run_dir = tmp / name
    env = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    args = ["-m", "trainer", f"hydra.run.dir={run_dir}", *COMMON, *overrides]
    if ranks > 1:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={ranks}",
            *args,
        ]
    else:
        command = [sys.executable, *args]
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "loss": [r["loss"] for r in rows if "loss" in r],
        "grad_norm": [r["grad_norm"] for r in rows if "grad_norm" in r],
        "val_loss": [r["val_loss"] for r in rows if "val_loss" in r],
    }


def run_all(only: list[str]) -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (ranks, overrides) in CASES.items():
            if only and name not in only:
                continue
            results[name] = run_case(name, ranks, overrides, Path(tmp))
            print(f"{name}: final loss {results[name]['loss'][-1]:.6f}", flush=True)
    return results


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("record", "compare"):
        print(__doc__)
        return 2
    mode, path, only = argv[0], Path(argv[1]), argv[2:]
    results = run_all(only)
    if mode == "record":  # naming cases re-records those and keeps the file's others
        kept = json.loads(path.read_text()) if only and path.exists() else {}
        path.write_text(json.dumps(kept | results, indent=1) + "\n")
        return 0
    before = json.loads(path.read_text())
    differ = 0
    for name, now in results.items():
        same = before.get(name) == now
        differ += not same
        print(f"{name}: {'bitwise equal' if same else 'DIFFERENT'}")
        if not same:
            for key in now:
                pairs = list(zip(before.get(name, {}).get(key, []), now[key]))
                worst = max((abs(a - b) for a, b in pairs), default=float("nan"))
                print(f"  {key}: max abs difference {worst:.3g}")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
