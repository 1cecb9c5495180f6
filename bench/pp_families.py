"""Every preset family trained by `torchrun -m trainer parallel.pp=2 parallel.pp_schedule=...`
(gloo ranks on CPU) against one process, end to end: pipeline parallelism's demonstration
(issue 58).

    python bench/pp_families.py [case ...] [--steps 6]

Each case trains a small fp32 model (bench/cp_families.py's settings: d_model 64, 4 query / 2 kv
heads, seq_len 32, batch 4, the default corpus, packed documents masked) for --steps steps through
the public command, once in one process and once over pipeline stages (pp=2 with one schedule of
torch.distributed.pipelining, some composed with data, expert or context parallelism and
activation checkpointing), and compares the logged training losses step by step. Both runs use
the same micro-batches (trainer.micro_batch_size: the pipeline's sequences per micro-batch), so
they sum the same per-micro-batch gradients and differ only in summation order: a case passes at
TOLERANCE, the issue's 1e-5 relative (the MoE case too: NOTES). Writes bench/results/pp_families_cpu.json (the whole default run) or
pp_families_cpu_partial.json; exits 1 if any run fails or any case diverges.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.cp_families import COMMON
from bench.machine import save_result
from bench.tp_families import (
    DEFAULT_STEPS,
    compare_losses,
    parse_cases,
    summary,
    train,
    worst_of,
)

TOLERANCE = 1e-5  # same micro-batches, fp32: only the order of the gradient sums differs
BATCH = 4  # COMMON's trainer.batch_size
L4 = ["model.n_layers=4"]  # 4 stages (two per rank) need 4 layers; COMMON has 2
PP2 = ["parallel.pp=2"]


def schedule(name: str) -> list[str]:
    return [*PP2, f"parallel.pp_schedule={name}"]


# name -> (overrides of both runs, the pipeline run's parallel overrides, its ranks, its
# micro-batches per data rank: at least the stages, a multiple of pp for the interleaved ones)
CASES: dict[str, tuple[list[str], list[str], int, int]] = {
    "tiny_1f1b": (["model=tiny"], schedule("1F1B"), 2, 2),
    "tiny_gpipe": (["model=tiny"], schedule("GPipe"), 2, 2),
    "tiny_untied_interleaved": (
        ["model=tiny", "model.tie_embeddings=false", *L4],
        schedule("Interleaved1F1B"),
        2,
        4,
    ),
    # the V's last stage (rank 0) holds the head, tied to rank 0's embedding: a copy
    "tiny_zbv": (["model=tiny", *L4], schedule("ZBVZeroBubble"), 2, 4),
    "tiny_moe_ep2": (["model=tiny_moe", *L4], [*PP2, "parallel.ep=2"], 4, 2),  # x dp_shard 2
    "tiny_mla": (["model=tiny_mla"], PP2, 2, 2),
    "tiny_hybrid_cp2": (["model=tiny_hybrid", *L4], [*PP2, "parallel.cp=2"], 4, 2),
    "tiny_mhc_dualpipev": (["model=tiny_mhc", *L4], schedule("DualPipeV"), 2, 4),
    "tiny_attnres_izb": (
        ["model=tiny_attnres", *L4],
        [*schedule("InterleavedZeroBubble"), "parallel.activation_checkpoint=full"],
        2,
        4,
    ),
    "tiny_engram": (["model=tiny_engram", *L4], PP2, 2, 2),  # engram layers [1, 3]
    "tiny_mtp": (["model=tiny", "model.mtp.depth=1"], schedule("1F1B"), 2, 2),
    # max logits about 0.1 over the first steps: tau 0.1 clips some heads (bench/cp_families.py)
    "tiny_muonclip_dp2": (
        ["model=tiny", "optim=muonclip", "optim.qk_clip_tau=0.1"],
        [*PP2, "parallel.dp_shard=2"],
        4,
        2,
    ),
}
NOTES = {
    "tiny_moe_ep2": "pp 2 x dp_shard 2 (= ep 2): the Switch balance loss is taken over each "
    "forward's tokens, which under data parallelism are each rank's own (bench/tp_families.py's "
    "note); here both runs forward the same micro-batches of 1 sequence, so it is exact (measured "
    "1.1e-7, where bench/cp_families.py's dp_shard 2 x cp 2 with whole local batches gave 7.4e-5)",
}


def data_ranks(parallel: list[str], ranks: int) -> int:
    """Data-parallel ranks of the pipeline run: what pp, cp and tp leave of the world."""
    sizes = dict(option.removeprefix("parallel.").split("=") for option in parallel)
    return ranks // (int(sizes["pp"]) * int(sizes.get("cp", 1)) * int(sizes.get("tp", 1)))


def mesh_words(parallel: list[str]) -> tuple[str, ...]:
    """What the pipeline run's log must show: pp, and cp when it has one."""
    sizes = dict(option.removeprefix("parallel.").split("=") for option in parallel)
    return (f"pp {sizes['pp']}", *([f"cp {sizes['cp']}"] if "cp" in sizes else []))


def run_case(name: str, steps: int, tmp: Path) -> dict:
    both, parallel, ranks, micro_batches = CASES[name]
    micro = BATCH // (data_ranks(parallel, ranks) * micro_batches)  # sequences per micro-batch
    # both runs: the same micro-batches; the pipeline run names its count too (the trainer
    # refuses the pair when they disagree)
    both = [*both, f"trainer.micro_batch_size={micro}"]
    pipeline = [*parallel, f"parallel.pp_microbatches={micro_batches}"]
    common = [*COMMON, f"trainer.max_steps={steps}", *both]
    result: dict = {"overrides": both, "parallel": pipeline, "ranks": ranks}
    result |= {"note": NOTES[name]} if name in NOTES else {}
    try:
        result["one_process"] = summary(*train(common, 1, tmp / f"{name}_one"))
        split = train([*common, *pipeline], ranks, tmp / f"{name}_pp", mesh_words(parallel))
        result["pipeline"] = summary(*split)
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        return result | {"error": str(error), "pass": False}
    verdict = compare_losses(result["one_process"]["loss"], result["pipeline"]["loss"], steps)
    if "max_rel_diff" in verdict:  # compare_losses judges at bench/tp_families.py's 1e-4
        verdict["pass"] = verdict["max_rel_diff"] <= TOLERANCE
    return result | verdict


def layout(r: dict) -> str:
    """`pp=2 pp_schedule=GPipe pp_microbatches=2 (2 ranks)`: the pipeline run, for the table."""
    options = " ".join(o.removeprefix("parallel.") for o in r["parallel"])
    return f"{options} ({r['ranks']} ranks)"


def main(argv: list[str]) -> int:
    names, steps = parse_cases(argv, CASES)
    results = {}
    print(f"{'case':<24} {'pipeline layout':<92} {'max rel diff':>12}  verdict  seconds (1, pp)")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            r = results[name] = run_case(name, steps, Path(tmp))
            diff = f"{r['max_rel_diff']:.2e}" if "max_rel_diff" in r else "failed"
            seconds = r.get("one_process", {}).get("seconds"), r.get("pipeline", {}).get("seconds")
            verdict = "pass" if r["pass"] else "FAIL"
            print(f"{name:<24} {layout(r):<92} {diff:>12}  {verdict:<7}  {seconds}", flush=True)
    full = names == list(CASES) and steps == DEFAULT_STEPS
    body = {
        "command": " ".join(["python bench/pp_families.py", *argv]),
        "steps": steps,
        "tolerance": TOLERANCE,
        "common_overrides": COMMON,
        "max_rel_diff": worst_of(results),
        "all_pass": all(r["pass"] for r in results.values()),
        "cases": results,
    }
    save_result("pp_families_cpu.json" if full else "pp_families_cpu_partial.json", body)
    for name, r in results.items():
        if "error" in r:
            print(f"{name} failed: {r['error']}", file=sys.stderr)
    return 0 if body["all_pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
