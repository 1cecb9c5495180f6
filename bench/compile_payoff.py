"""Does `trainer.compile=true` pay on this CPU, per model preset? The steady training step of
each tiny preset eager and compiled, each in a fresh process (the trainer's engine and
train_step, 8 x 256 tokens, `trainer.precision` as given), the two alternating round by round;
the median step after the warm-up counts, and the first compiled step minus it is the compile
time of that process (small when Inductor's cache on disk is warm: pass --cold for an empty
cache per process). Also the graph breaks and the graphs dynamo compiled.

Derived per preset: compiled / eager step (paired by round) and the steps a compile of that
length takes to pay back (compile seconds / seconds saved a step; none if it never does).

    python bench/compile_payoff.py [--presets tiny tiny_moe ...] [--rounds 2] [--steps 16]
        [--precision auto] [--cold]
Writes bench/results/compile_payoff_cpu[_<precision>].json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.machine import machine

BATCH, SEQ_LEN, WARMUP = 8, 256, 3
PRESETS = ("tiny", "tiny_moe", "tiny_mla", "tiny_hybrid", "tiny_mhc", "tiny_attnres", "tiny_engram")


def child(preset: str, compiled: bool, precision: str, steps: int) -> None:
    """One process: the preset's engine, `steps` training steps timed, one JSON line."""
    from bench.engines import cpu_engine, time_train_steps
    from model.presets import load_preset
    from trainer.cpu_malloc import keep_freed_memory

    keep_freed_memory()  # as `python -m trainer` on CPU
    engine = cpu_engine(preset, precision, compile=compiled)
    vocab_size = load_preset(preset).vocab_size
    seconds = time_train_steps(engine, vocab_size, steps, BATCH, SEQ_LEN)
    from torch._dynamo.utils import counters

    breaks = sum(counters["graph_break"].values())
    graphs = counters["stats"]["unique_graphs"]
    print(json.dumps({"step_seconds": seconds, "graph_breaks": breaks, "graphs": graphs}))


def run_child(preset: str, compiled: bool, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", preset, "--precision", args.precision]
    cmd += ["--steps", str(args.steps)] + (["--compiled"] if compiled else [])
    with tempfile.TemporaryDirectory(prefix="compile_payoff_") as tmp:
        env = os.environ | ({"TORCHINDUCTOR_CACHE_DIR": tmp} if args.cold else {})
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{preset} compiled={compiled} failed:\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row["steady_step_seconds"] = statistics.median(row["step_seconds"][WARMUP:])
    row["first_step_extra_seconds"] = row["step_seconds"][0] - row["steady_step_seconds"]
    return row


def summarize(rounds: list[dict]) -> dict:
    """Paired ratios over the rounds, and the payback of the compiled process's first step."""
    ratios = [
        r["compiled"]["steady_step_seconds"] / r["eager"]["steady_step_seconds"] for r in rounds
    ]
    eager = statistics.median(r["eager"]["steady_step_seconds"] for r in rounds)
    compiled = statistics.median(r["compiled"]["steady_step_seconds"] for r in rounds)
    extra = statistics.median(
        r["compiled"]["first_step_extra_seconds"] - r["eager"]["first_step_extra_seconds"]
        for r in rounds
    )
    saved = eager - compiled
    return {
        "compiled_over_eager": ratios,
        "compiled_over_eager_median": statistics.median(ratios),
        "eager_step_seconds": eager,
        "compiled_step_seconds": compiled,
        "compile_seconds": extra,
        "payback_steps": round(extra / saved) if saved > 0 else None,
        "graph_breaks": rounds[0]["compiled"]["graph_breaks"],
        "graphs": rounds[0]["compiled"]["graphs"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp32"))
    parser.add_argument("--cold", action="store_true", help="an empty compile cache per process")
    parser.add_argument("--out", default="", help="JSON path (default under bench/results)")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.compiled, args.precision, args.steps)
    if args.steps <= WARMUP + 1:
        raise SystemExit(f"--steps {args.steps}: need more than {WARMUP + 1} (warm-up + one)")
    import torch

    from parallel.precision import resolve_precision

    precision = resolve_precision(args.precision, torch.device("cpu"))
    report = {"benchmark": "compile_payoff", "machine": machine(), "args": vars(args)}
    report |= {"precision": precision, "batch": BATCH, "seq_len": SEQ_LEN, "presets": {}}
    for preset in args.presets:
        rounds = []
        for index in range(args.rounds):
            order = (False, True) if index % 2 == 0 else (True, False)
            runs = {("compiled" if c else "eager"): run_child(preset, c, args) for c in order}
            rounds.append(runs)
        report["presets"][preset] = {"summary": summarize(rounds), "rounds": rounds}
        s = report["presets"][preset]["summary"]
        print(
            f"{preset:14s} eager {s['eager_step_seconds']:.3f} s  compiled "
            f"{s['compiled_step_seconds']:.3f} s  ratio {s['compiled_over_eager_median']:.2f}  "
            f"compile {s['compile_seconds']:.1f} s  payback {s['payback_steps']}  "
            f"breaks {s['graph_breaks']}",
            flush=True,
        )
    suffix = "" if args.precision == "auto" else f"_{args.precision}"
    out = Path(args.out or ROOT / "bench" / "results" / f"compile_payoff_cpu{suffix}.json")
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
