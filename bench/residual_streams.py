"""The 2026 residual streams against the plain pre-norm `tiny`, on this CPU.

`step`: training-step time and peak memory of one process (forward + backward + AdamW, bf16
autocast or fp32, the default batch of 8 x 256), each variant in its own process, in the same run:
pre-norm, Full AttnRes (also with the aggregation through plain autograd instead of the custom
Function), Block AttnRes (k = 2, 4), mHC n = 4 (maps recomputed in backward, or kept; also with
the Sinkhorn steps through plain autograd instead of model/residual/mhc_sinkhorn.py's Function), and
compiled per block (`trainer.compile=true`) against the compiled pre-norm model.
Peak memory is the growth of the process's peak RSS over the model and optimizer
(the CPU has no allocator statistics).

`corpus`: `python -m trainer model=<preset>` on the default corpus as users run it (300 steps,
the same batches and tokens) for `tiny`, `tiny_attnres` (Block AttnRes, k = 2) and `tiny_mhc`, at
the default learning rate and at twice it; the validation curves, and one plot of them.

    python bench/residual_streams.py step [--repeats 5] [--precision fp32] [--variants "mHC n=4"]
    python bench/residual_streams.py corpus [--only tiny_mhc]   (reruns those, keeps the rest)
Writes bench/results/residual_streams_{step,corpus}_cpu.json (+ residual_streams_corpus.png; step
in fp32: residual_streams_step_cpu_fp32.json). --variants: a subset (the pre-norm rows they are
compared with always run).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.machine import finish_validation_plot, save_result

VARIANTS = {  # name: (preset, overrides)
    "pre (tiny)": ("tiny", {}),
    "AttnRes full": ("tiny_attnres", {"attnres.block_layers": 0}),
    "AttnRes full, plain autograd": ("tiny_attnres", {"attnres.block_layers": 0}),
    "AttnRes block k=2": ("tiny_attnres", {"attnres.block_layers": 2}),
    "AttnRes block k=4": ("tiny_attnres", {"attnres.block_layers": 4}),
    "mHC n=4": ("tiny_mhc", {}),
    "mHC n=4, maps kept": ("tiny_mhc", {"mhc.recompute_maps": False}),
    "mHC n=4, Sinkhorn through autograd": ("tiny_mhc", {}),
    "mHC n=4, maps kept, Sinkhorn through autograd": ("tiny_mhc", {"mhc.recompute_maps": False}),
    "pre (tiny), compiled": ("tiny", {}),
    "AttnRes block k=2, compiled": ("tiny_attnres", {"attnres.block_layers": 2}),
    "mHC n=4, compiled": ("tiny_mhc", {}),
}
CORPUS_PRESETS = ("tiny", "tiny_attnres", "tiny_mhc")
LRS = (3e-3, 6e-3)


def measure_step(name: str, repeats: int, precision: str = "bf16") -> dict:
    """In this process: median step time and peak RSS growth of one variant."""
    from model.presets import load_preset
    from model.transformer import build_model

    preset, overrides = VARIANTS[name]
    if "plain autograd" in name:  # the baseline of the custom Function: autograd's saved tensors
        import model.residual.attnres as attnres

        def plain(self, sources):
            return attnres.reference_depth_attention(sources, self.query, self.gain, self.eps)

        attnres.DepthQuery.forward = plain
    if "Sinkhorn through autograd" in name:  # the baseline of the eager Sinkhorn Function
        import model.residual.mhc as mhc

        mhc.sinkhorn_tokens_last = mhc.sinkhorn
    torch.manual_seed(0)
    model = build_model(load_preset(preset, overrides), seed=0)
    if name.endswith("compiled"):
        from parallel.activation import compile_model

        compile_model(model, "cpu")  # per block, as trainer.compile=true does
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, model.cfg.vocab_size, (8, 257))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= 2:  # warm-up: allocator, AdamW state, compilation
            times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    params = sum(p.numel() for p in model.parameters())
    return {
        "parameters": params,
        "step_seconds": statistics.median(times),
        "peak_rss_growth_mib": (peak - base) / 1024,
    }


def step_benchmark(repeats: int, precision: str, only: list[str]) -> None:
    rows = {}
    wanted = set(only or VARIANTS) | {"pre (tiny)"}
    if any(name.endswith("compiled") for name in wanted):
        wanted.add("pre (tiny), compiled")
    for name in [n for n in VARIANTS if n in wanted]:
        command = [sys.executable, __file__, "worker", "--variant", name, "--repeats", str(repeats)]
        command += ["--precision", precision]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        rows[name] = json.loads(out.strip().splitlines()[-1])
    for name, row in rows.items():
        base = rows["pre (tiny), compiled" if name.endswith("compiled") else "pre (tiny)"]
        row["time_vs_pre"] = row["step_seconds"] / base["step_seconds"]
        row["memory_vs_pre"] = row["peak_rss_growth_mib"] / base["peak_rss_growth_mib"]
        print(
            f"{name:22s} {row['parameters']:>10,} params  {row['step_seconds']:.3f} s "
            f"({row['time_vs_pre']:.2f}x)  peak +{row['peak_rss_growth_mib']:.0f} MiB "
            f"({row['memory_vs_pre']:.2f}x)"
        )
    suffix = "_fp32" if precision == "fp32" else ""
    save_result(
        f"residual_streams_step_cpu{suffix}.json",
        {"batch": [8, 256], "precision": precision, "rows": rows},
    )


def run_dir_name(tag: str) -> str:
    """A run directory name Hydra's override grammar accepts (no '=', '+', spaces...)."""
    return re.sub(r"[^A-Za-z0-9_.]+", "_", tag)


def corpus_run(preset: str, lr: float, tmp: Path, overrides: list[str] = (), tag: str = "") -> dict:
    """`python -m trainer model=<preset> optim.lr=<lr> <overrides>` in a run dir under `tmp`."""
    run_dir = tmp / run_dir_name(tag or f"{preset}_{lr:g}")
    env = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "trainer", f"model={preset}", f"optim.lr={lr}"]
    command += ["trainer.compile=false", *overrides]  # eager as in the README (auto compiles)
    command.append(f"hydra.run.dir={run_dir}")
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "val_loss" in r]
    speeds = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    skipped = max((r.get("skipped_steps", 0) for r in rows), default=0)
    return {
        "preset": preset,
        "lr": lr,
        "wall_seconds": round(wall, 1),
        "validation": [[r["step"], round(r["val_loss"], 4)] for r in evals],
        "train_sample": [[r["step"], round(r["train_eval_loss"], 4)] for r in evals],
        "median_tokens_per_s": round(sorted(speeds)[len(speeds) // 2], 1),
        "skipped_steps": skipped,
    }


def corpus_benchmark(only: list[str]) -> None:
    """All presets, or (`--only`) rerun some and replace their rows in the saved results."""
    presets = only or list(CORPUS_PRESETS)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [corpus_run(p, lr, Path(tmp)) for lr in LRS for p in presets]
    saved = ROOT / "bench" / "results" / "residual_streams_corpus_cpu.json"
    if only and saved.is_file():
        kept = [r for r in json.loads(saved.read_text())["rows"] if r["preset"] not in only]
        rows = sorted(kept + rows, key=lambda r: (r["lr"], CORPUS_PRESETS.index(r["preset"])))
    for row in rows:
        print(
            f"{row['preset']:13s} lr {row['lr']:g}: validation {row['validation'][0][1]} -> "
            f"{row['validation'][-1][1]}, training sample {row['train_sample'][-1][1]}, "
            f"{row['median_tokens_per_s']:.0f} tokens/s, {row['skipped_steps']} skipped steps"
        )
    save_result("residual_streams_corpus_cpu.json", {"steps": 300, "rows": rows})
    _plot(rows, ROOT / "bench" / "results" / "residual_streams_corpus.png")


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = dict(zip(CORPUS_PRESETS, ("tab:gray", "tab:blue", "tab:orange"), strict=True))
    for row in rows:
        steps, losses = zip(*row["validation"], strict=True)
        style = "-" if row["lr"] == LRS[0] else "--"
        ax.plot(
            steps,
            losses,
            style,
            color=colors[row["preset"]],
            label=f"{row['preset']} lr {row['lr']:g}",
        )
    finish_validation_plot(fig, ax, "Residual streams on the default corpus", path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("step", "corpus", "worker"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="*", default=[], choices=CORPUS_PRESETS)
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"), help="step only")
    parser.add_argument("--variants", nargs="*", default=[], choices=list(VARIANTS), help="step")
    args = parser.parse_args()
    if args.mode == "worker":
        print(json.dumps(measure_step(args.variant, args.repeats, args.precision)))
    elif args.mode == "step":
        step_benchmark(args.repeats, args.precision, args.variants)
    else:
        corpus_benchmark(args.only)


if __name__ == "__main__":
    main()
