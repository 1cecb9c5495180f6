"""In-loop downstream evaluation on the default run: what it costs against training, and what the
default model scores against chance.

One run, the default one (`python -m trainer`: the `tiny` preset, 300 steps of 8 x 256 tokens on
the default corpus and its BPE) with `eval.downstream.tasks=[hellaswag,arc_easy,piqa]`,
`eval.downstream.limit=200` and `eval.downstream.every=150` (so evaluations at steps 0, 150 and
300). From its metrics.jsonl and train.log:
  * each evaluation's requests (one per answer choice) and questions per second, and the tokens
    it scored per second (forward only, length-packed batches of <= 8 x 256 tokens);
  * the baseline in the same run: the training step's tokens per second (median of its logged
    intervals after the first, which holds the compile);
  * the share of the time since the previous evaluation that each took (the loop's own log line);
  * the scores after the run's last step against each task's chance level, with the binomial
    standard error of a chance-level score over the questions scored. A 6.5M-parameter model
    trained on 614k tokens of Python source is expected to score at chance on English
    commonsense questions: the point is the machinery, not the numbers.
Downstream evaluation does not change training (no random draws, no weight change), so the model
scored at step 300 is the default run's (its validation loss is printed beside the one in
bench/results/default_run_cpu.json).

    python bench/downstream_eval.py [--limit 200] [--every 150] [--steps 300]
Writes bench/results/downstream_eval_cpu.json (or downstream_eval_cpu_<steps>steps.json when
--steps is not the default).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.machine import save_result
from data.config import PrepareConfig
from data.manifest import Manifest
from data.tokenizer import load_tokenizer
from trainer.downstream.tasks import build_tasks

TASKS = ["hellaswag", "arc_easy", "piqa"]
SEQ_LEN, DEFAULT_STEPS = 256, 300  # data.seq_len, trainer.max_steps
SHARE = re.compile(r"downstream at step (\d+) \(([\d.]+) s, ([\d.]+)% of the time since the last")


def default_dataset() -> Path:
    """The default corpus's prepared directory (what `python -m trainer` reads without data.path;
    the run prepares it on first use)."""
    return PrepareConfig(progress=False).output_dir()


def request_counts(tokenizer_dir: Path, limit: int) -> dict[str, dict[str, int]]:
    """Per task, as the loop builds it: questions, requests, tokens scored (unpadded; the
    loop's length-packed batches add a few percent of padding) and its chance level."""
    tokenizer = load_tokenizer(tokenizer_dir)
    counts = {}
    for task in build_tasks(TASKS, tokenizer, SEQ_LEN, limit):
        requests = task.all_requests()
        counts[task.name] = {
            "metric": task.metric_type,
            "questions": task.questions,
            "requests": len(requests),
            "tokens": sum(len(r.tokens) for r in requests),
            "chance": task.chance,
        }
    return counts


class LoadSampler(threading.Thread):
    """The 1-minute load average every 10 s while the run goes: other jobs on this 2-core
    machine slow whichever part of the run they overlap (the record says when they did)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[tuple[float, float]] = []
        self.done = threading.Event()
        self.start_time = time.perf_counter()

    def run(self) -> None:
        while not self.done.wait(10.0):
            elapsed = round(time.perf_counter() - self.start_time)
            self.samples.append((elapsed, round(os.getloadavg()[0], 2)))


def run(args: argparse.Namespace, run_dir: Path) -> tuple[list[dict], str, float]:
    """(metrics.jsonl rows, train.log, wall seconds) of the default run with downstream tasks."""
    command = [
        sys.executable, "-m", "trainer", f"hydra.run.dir={run_dir}",
        f"eval.downstream.tasks=[{','.join(TASKS)}]", f"eval.downstream.limit={args.limit}",
        f"eval.downstream.every={args.every}",
    ]  # fmt: skip
    if args.steps != DEFAULT_STEPS:
        command.append(f"trainer.max_steps={args.steps}")
    env = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, (run_dir / "train.log").read_text(), wall


def evaluations(rows: list[dict], log: str, counts: dict) -> list[dict]:
    """Each evaluation's time, throughput and share of the interval before it."""
    shares = {int(m[1]): float(m[3]) / 100 for m in SHARE.finditer(log)}
    total = {k: sum(c[k] for c in counts.values()) for k in ("questions", "requests", "tokens")}
    out = []
    for row in (r for r in rows if "downstream_s" in r):
        seconds = row["downstream_s"]
        out.append(
            {
                "step": row["step"],
                "seconds": round(seconds, 2),
                "requests_per_s": round(total["requests"] / seconds, 1),
                "questions_per_s": round(total["questions"] / seconds, 1),
                "tokens_per_s": round(total["tokens"] / seconds),
                "share_of_interval": shares.get(row["step"]),
            }
        )
    return out


def scores(rows: list[dict], counts: dict) -> list[dict]:
    """The last evaluation's accuracies against chance (and the standard error at chance)."""
    last = [r for r in rows if "downstream_s" in r][-1]
    out = []
    for task, c in counts.items():
        chance, n = c["chance"], c["questions"]
        error = math.sqrt(chance * (1 - chance) / n)
        for metric in dict.fromkeys([c["metric"], "acc", "len_norm"]):
            value = last[f"downstream/{task}/{metric}"]
            out.append(
                {
                    "task": task,
                    "metric": metric,
                    "step": last["step"],
                    "value": round(value, 4),
                    "chance": round(chance, 4),
                    "standard_error_at_chance": round(error, 4),
                    "standard_errors_from_chance": round((value - chance) / error, 2),
                }
            )
    return out


def table(header: list[str], rows: list[list]) -> str:
    cells = [header] + [[("-" if v is None else str(v)) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=200, help="questions per task")
    parser.add_argument("--every", type=int, default=150, help="steps between evaluations")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="trainer.max_steps")
    args = parser.parse_args()
    load, sampler = os.getloadavg()[0], LoadSampler()
    sampler.start()
    with tempfile.TemporaryDirectory() as tmp:
        rows, log, wall = run(args, Path(tmp) / "run")
    sampler.done.set()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    counts = request_counts(Manifest.load(default_dataset()).tokenizer_dir, args.limit)
    train = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][1:]  # the first: compile
    train_tps = statistics.median(train)
    evals = evaluations(rows, log, counts)
    final = scores(rows, counts)
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    reference = json.loads((ROOT / "bench/results/default_run_cpu.json").read_text())
    body = {
        "command": "python bench/downstream_eval.py " + " ".join(sys.argv[1:]),
        "run": f"python -m trainer eval.downstream.tasks=[{','.join(TASKS)}] "
        f"eval.downstream.limit={args.limit} eval.downstream.every={args.every}"
        + (f" trainer.max_steps={args.steps}" if args.steps != DEFAULT_STEPS else ""),
        "args": vars(args),
        "load_average_before": load,
        "load_average_during": sampler.samples,
        "wall_seconds": round(wall, 1),
        # CPU seconds of the run / wall seconds: about trainer.threads (2) when nothing else ran
        "run_cpu_seconds_per_wall_second": round((usage.ru_utime + usage.ru_stime) / wall, 2),
        "log": [line for line in log.splitlines() if "downstream" in line or "done:" in line],
        "tasks": counts,
        "training_tokens_per_s": round(train_tps),
        "evaluations": evals,
        "scored_tokens_per_s_over_training_tokens_per_s": [
            round(e["tokens_per_s"] / train_tps, 2) for e in evals
        ],
        "scores": final,
        "final_val_loss": round(val[-1], 4),
        "default_run_final_val_loss": reference["validation"][-1][1],
        "note": "a 6.5M-parameter model trained on 614k tokens of Python source is expected to "
        "score at chance on these English tasks; the point is the machinery",
    }
    suffix = "" if args.steps == DEFAULT_STEPS else f"_{args.steps}steps"
    save_result(f"downstream_eval_cpu{suffix}.json", body)
    print(f"\n{body['run']}: {wall:.0f} s; training {train_tps:,.0f} tokens/s (median)")
    print(
        f"each evaluation: {sum(c['questions'] for c in counts.values())} questions, "
        f"{sum(c['requests'] for c in counts.values())} requests, "
        f"{sum(c['tokens'] for c in counts.values()):,} tokens\n"
    )
    print(
        table(
            ["step", "seconds", "requests/s", "questions/s", "tokens/s", "x training", "share"],
            [
                [
                    e["step"],
                    e["seconds"],
                    e["requests_per_s"],
                    e["questions_per_s"],
                    f"{e['tokens_per_s']:,}",
                    round(e["tokens_per_s"] / train_tps, 2),
                    None if e["share_of_interval"] is None else f"{e['share_of_interval']:.1%}",
                ]
                for e in evals
            ],
        )
    )
    print()
    print(
        table(
            ["task", "metric", "step", "score", "chance", "(score-chance)/SE"],
            [
                [s[k] for k in ("task", "metric", "step", "value", "chance")]
                + [s["standard_errors_from_chance"]]
                for s in final
            ],
        )
    )
    print(
        f"\nfinal validation loss {val[-1]:.4f} (the default run's: "
        f"{body['default_run_final_val_loss']}). {body['note']}."
    )


if __name__ == "__main__":
    main()
