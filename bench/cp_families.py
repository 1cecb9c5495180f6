"""Every preset family trained by `torchrun -m trainer parallel.cp=...` (gloo ranks on CPU)
against one process, end to end: context parallelism's demonstration (issue 57).

    python bench/cp_families.py [case ...] [--steps 6]

Each case trains a small fp32 model (bench/tp_families.py's settings: d_model 64, 4 query / 2 kv
heads, seq_len 32, batch 4, the default corpus, packed documents masked: trainer.doc_mask=true)
for --steps steps through the public command, once in one process and once split over the
sequence (cp=2 or 4, some composed with data, tensor or expert parallelism and activation
checkpointing), and compares the logged training losses step by step. A case passes when the
largest relative difference is at most bench/tp_families.py's TOLERANCE. Writes
bench/results/cp_families_cpu.json (the whole default run) or cp_families_cpu_partial.json;
exits 1 if any run fails or any case diverges.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.machine import save_result
from bench.tp_families import (
    DEFAULT_STEPS,
    SMALL,
    TOLERANCE,
    compare_losses,
    parse_cases,
    summary,
    train,
    worst_of,
)

COMMON = [*SMALL, "trainer.doc_mask=true"]  # documents packed in a row cross the chunks
CP2, CP4 = ["parallel.cp=2"], ["parallel.cp=4"]
# name -> (overrides of both runs, the split run's parallel overrides, its ranks)
CASES: dict[str, tuple[list[str], list[str], int]] = {
    "tiny": (["model=tiny"], CP2, 2),
    "tiny_window": (["model=tiny", "model.attention.sliding_window=8"], CP4, 4),
    "tiny_hsdp": (["model=tiny"], [*CP2, "parallel.dp_replicate=2"], 4),
    "tiny_mla": (["model=tiny_mla"], [*CP2, "parallel.activation_checkpoint=full"], 2),
    "tiny_hybrid": (["model=tiny_hybrid", "model.n_layers=4"], CP4, 4),
    "tiny_kda": (
        ["model=tiny_kda", "model.n_layers=4"],
        [*CP2, "parallel.activation_checkpoint=selective"],
        2,
    ),
    "tiny_moe_ep2": (["model=tiny_moe"], [*CP2, "parallel.ep=2"], 4),
    "tiny_attnres": (["model=tiny_attnres"], CP2, 2),
    "tiny_mhc": (["model=tiny_mhc"], [*CP2, "parallel.activation_checkpoint=full"], 2),
    "tiny_engram": (["model=tiny_engram", "model.n_layers=4"], CP2, 2),
    "tiny_mtp": (["model=tiny", "model.mtp.depth=1"], CP2, 2),
    "tiny_muon": (["model=tiny", "optim=muon"], [*CP2, "parallel.dp_shard=2"], 4),
    # max logits about 0.1 over the first steps: tau 0.1 clips some heads
    "tiny_muonclip": (
        ["model=tiny", "optim=muonclip", "optim.qk_clip_tau=0.1"],
        [*CP2, "parallel.tp=2"],
        4,
    ),
}
NOTES = {
    "tiny_moe_ep2": "dp_shard 2 x cp 2: the Switch balance loss is taken over each rank's own "
    "tokens (as under data parallelism: bench/tp_families.py's note), so it differs slightly",
}


def mesh_words(parallel: list[str], ranks: int) -> tuple[str, ...]:
    """What the split run's log must show: its cp size, and tp when it has one."""
    sizes = dict(option.removeprefix("parallel.").split("=") for option in parallel)
    words = [f"cp {sizes['cp']}"]
    return (*words, *([f"tp {sizes['tp']}"] if "tp" in sizes else []))


def run_case(name: str, steps: int, tmp: Path) -> dict:
    both, parallel, ranks = CASES[name]
    common = [*COMMON, f"trainer.max_steps={steps}", *both]
    result: dict = {"overrides": both, "parallel": parallel, "ranks": ranks}
    result |= {"note": NOTES[name]} if name in NOTES else {}
    try:
        result["one_process"] = summary(*train(common, 1, tmp / f"{name}_one"))
        split = train([*common, *parallel], ranks, tmp / f"{name}_cp", mesh_words(parallel, ranks))
        result["split"] = summary(*split)
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        return result | {"error": str(error), "pass": False}
    return result | compare_losses(result["one_process"]["loss"], result["split"]["loss"], steps)


def main(argv: list[str]) -> int:
    names, steps = parse_cases(argv, CASES)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            r = results[name] = run_case(name, steps, Path(tmp))
            diff = f"{r['max_rel_diff']:.2e}" if "max_rel_diff" in r else "failed"
            layout = " ".join(o.removeprefix("parallel.") for o in r["parallel"])
            seconds = r.get("one_process", {}).get("seconds"), r.get("split", {}).get("seconds")
            print(f"{name:<14} {layout:<48} {diff:>9} {'pass' if r['pass'] else 'FAIL'} {seconds}")
    full = names == list(CASES) and steps == DEFAULT_STEPS
    body = {
        "command": " ".join(["python bench/cp_families.py", *argv]),
        "steps": steps,
        "tolerance": TOLERANCE,
        "common_overrides": COMMON,
        "max_rel_diff": worst_of(results),
        "all_pass": all(r["pass"] for r in results.values()),
        "cases": results,
    }
    save_result("cp_families_cpu.json" if full else "cp_families_cpu_partial.json", body)
    for name, r in results.items():
        if "error" in r:
            print(f"{name} failed: {r['error']}", file=sys.stderr)
    return 0 if body["all_pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
