"""What a first `trainer.compile=true` run pays before its faster steps start, and what that
means for the default 300-step command: the limit on target 1 of issue 21 (the default command
>= 1.4x transformers' eager tokens/s, compile time included).

Each round runs three fresh processes on the default tiny model (8 x 256 tokens, bf16 autocast,
the trainer's engine and train_step), one after another:
  * cold: TMPDIR and TORCHINDUCTOR_CACHE_DIR empty, as on a new machine (with Inductor's
    default options it keeps a precompiled C++ header under TMPDIR, outside its cache);
  * warm: the same directories again (every later run on that machine);
  * eager: trainer.compile=false.
The C++ compiler Inductor calls is a logging wrapper (CXX), so each g++ call's wall time is
recorded (kernels or graphs, a precompiled header if any) and the time at least one ran.
Transformers' eager step (as users run it) is timed between rounds.

Derived per round: compile seconds = first step - the median later step; the steps after
which compiling pays back; the default run's time compiled (cold, warm) and eager against
transformers; and the compile budget a 300-step run leaves for 1.4x transformers.

    python bench/compile_cost.py [--rounds 2] [--steps 8]
Writes bench/results/compile_cost_cpu.json.
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
from bench.default_speed import transformers_tokens_per_s
from bench.machine import machine

BATCH, SEQ_LEN, DEFAULT_STEPS, TARGET = 8, 256, 300, 1.4
WRAPPER = """#!/usr/bin/env bash
start=$EPOCHREALTIME
g++ "$@"
rc=$?
echo "$start $EPOCHREALTIME $*" >> "{log}"
exit $rc
"""


def child(mode: str, steps: int) -> None:
    """One process: build the engine, time `steps` training steps, print one JSON line."""

    from bench.engines import time_train_steps, tiny_cpu_engine
    from trainer.cpu_malloc import keep_freed_memory

    keep_freed_memory()  # as `python -m trainer` on CPU
    engine = tiny_cpu_engine("bf16", compile=mode != "eager")
    seconds = time_train_steps(engine, 8192, steps, BATCH, SEQ_LEN)
    from torch._dynamo.utils import compilation_time_metrics, counters

    phases = {k: sum(v) for k, v in compilation_time_metrics.items()}  # nested phases overlap
    print(
        json.dumps(
            {
                "step_seconds": seconds,
                "phases_seconds": {k: v for k, v in phases.items() if v >= 0.5},
                "unique_graphs": counters["stats"]["unique_graphs"],
                "fx_graph_cache": {
                    k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph")
                },
            }
        )
    )


def compiler_calls(log: Path) -> dict:
    """The g++ calls one process made: count and seconds per kind, and the wall time during
    which at least one ran (they run in parallel, one per core)."""
    if not log.exists():
        return {"calls": 0, "busy_seconds": 0.0}
    calls = []
    for line in log.read_text().splitlines():
        start, end, args = line.split(" ", 2)
        kind = "header" if "c++-header" in args else "kernel" if ".cpp" in args else "other"
        calls.append((float(start), float(end), kind))
    log.unlink()
    kinds: dict[str, dict] = {}
    for start, end, kind in calls:
        entry = kinds.setdefault(kind, {"calls": 0, "seconds": 0.0})
        entry["calls"] += 1
        entry["seconds"] += end - start
    busy, reach = 0.0, float("-inf")
    for start, end, _ in sorted(calls):  # union of the intervals
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return {"calls": len(calls), "busy_seconds": busy, "by_kind": kinds}


def run_child(mode: str, steps: int, tmp: Path) -> dict:
    log = tmp / "gxx.log"
    env = os.environ | {
        "TMPDIR": str(tmp),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"),
        "CXX": str(tmp / "gxx"),
    }
    cmd = [sys.executable, __file__, "--child", mode, "--steps", str(steps)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{mode} child failed:\n{done.stderr[-4000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row["steady_step_seconds"] = statistics.median(row["step_seconds"][2:])
    row["compile_seconds"] = row["step_seconds"][0] - row["steady_step_seconds"]
    row["compiler"] = compiler_calls(log)
    return row


def round_of_runs(steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="compile_cost_") as name:
        tmp = Path(name)  # no spaces: the C++ compiler gets this path
        (tmp / "gxx").write_text(WRAPPER.format(log=tmp / "gxx.log"))
        (tmp / "gxx").chmod(0o755)
        runs = {mode: run_child(mode, steps, tmp) for mode in ("cold", "warm", "eager")}
    return runs


def default_run_ratios(runs: dict, transformers_step: float) -> dict:
    """A 300-step run's training time (compile included) and its speed against transformers."""
    eager = runs["eager"]["steady_step_seconds"]
    compiled = (runs["cold"]["steady_step_seconds"] + runs["warm"]["steady_step_seconds"]) / 2
    saved = eager - compiled
    out = {
        "transformers_step_seconds": transformers_step,
        "eager_step_seconds": eager,
        "compiled_step_seconds": compiled,
        "compile_budget_for_target_seconds": DEFAULT_STEPS
        * (transformers_step / TARGET - compiled),
    }
    for mode in ("cold", "warm"):
        cost = runs[mode]["compile_seconds"]
        out[f"{mode}_pays_back_after_steps"] = cost / saved if saved > 0 else None
        out[f"{mode}_default_run_vs_transformers"] = (
            DEFAULT_STEPS * transformers_step / (DEFAULT_STEPS * compiled + cost)
        )
    out["eager_default_run_vs_transformers"] = transformers_step / eager
    out["zero_cost_compile_vs_transformers"] = transformers_step / compiled
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per process")
    parser.add_argument("--child", choices=("cold", "warm", "eager"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps)
        return
    tokens = BATCH * SEQ_LEN
    transformers = [tokens / transformers_tokens_per_s(steps=args.steps)]
    rounds = []
    for r in range(args.rounds):
        runs = round_of_runs(args.steps)
        transformers.append(tokens / transformers_tokens_per_s(steps=args.steps))
        bracket = (transformers[-2] + transformers[-1]) / 2  # before and after this round
        rounds.append({"runs": runs, "default_run": default_run_ratios(runs, bracket)})
        print(f"round {r}", json.dumps(rounds[-1]["default_run"]), flush=True)
    result = {
        "benchmark": "compile_cost",
        "machine": machine(("torch", "numpy", "transformers")),
        "args": {k: v for k, v in vars(args).items() if k != "child"},
        "batch": BATCH,
        "seq_len": SEQ_LEN,
        "default_steps": DEFAULT_STEPS,
        "target": TARGET,
        "transformers_step_seconds_all": transformers,
        "rounds": rounds,
    }
    out = ROOT / "bench" / "results" / "compile_cost_cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
