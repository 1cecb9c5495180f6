"""Engram on this CPU: what the tables cost per step as they grow, and what they buy on the corpus.

`tables`: the training step (bf16 autocast forward + backward, gradient clipping, the optimizer
with row-wise Adam for the tables) of `tiny` with one Engram layer (block 1, 2- and 3-grams,
4 heads each, 32 dims per head) whose tables hold 1e5, 1e6 and 1e7 rows in all, with sparse
table gradients (the default) and with dense ones (the same update), against `tiny` itself, each
in its own process, three rounds round-robin (the fastest kept), the default batch of 8 x 256. Memory is the growth of the process's resident
set from the built model to after the steps (the Adam moments, which are O(table), and the
gradients; building the model peaks higher, so the peak RSS would hide it). Each phase is timed.

`fsdp`: the same step through the trainer's engine with FSDP2 over 2 gloo ranks (one core each,
the same global batch), against one process through the same engine: tables sharded by rows
(units gathered for the forward and reduce-scattered after backward: traffic O(table)) and
replicated (`engram.sharding=replicated`: the sparse row gradients averaged, traffic O(rows
read), each rank holding the whole table).

`corpus`: `python -m trainer model=<preset>` on the default corpus as users run it (300 steps, the
same batches and tokens): `tiny` against `tiny_engram` (the same backbone and FLOPs plus two
Engram layers) and against `tiny` with one multi-token-prediction module (model.mtp.depth=1);
the validation curves and one plot of them.

    python bench/engram.py tables [--repeats 5]
    python bench/engram.py fsdp
    python bench/engram.py corpus [--only tiny_engram]   (reruns those, keeps the rest)
Writes bench/results/engram_{tables,fsdp,corpus}_cpu.json (+ engram_corpus.png).
"""

from __future__ import annotations

import argparse
import json
import os
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
from bench.residual_streams import corpus_run, run_dir_name

ROWS = (10**5, 10**6, 10**7)
HEADS = 8  # 4 per order, 2 orders
CORPUS = {  # name: (preset, trainer overrides)
    "tiny": ("tiny", []),
    "tiny_engram": ("tiny_engram", []),
    "tiny + MTP D=1": ("tiny", ["model.mtp.depth=1"]),
}


def variant(rows: int, sparse: bool) -> dict:
    per_head = rows // HEADS
    return {
        "engram.layers": [1],
        "engram.heads": HEADS // 2,
        "engram.dim": 128,
        "engram.table_sizes": [per_head, per_head],
        "engram.sparse_grad": sparse,
    }


def measure_step(rows: int, sparse: bool, repeats: int) -> dict:
    """In this process: median time of each phase of the step, and peak RSS growth."""
    from model.presets import load_preset
    from model.transformer import build_model
    from optim.builder import build_optimizer
    from optim.config import OptimConfig
    from parallel.grad_norm import clip_grad_norm

    overrides = variant(rows, sparse) if rows else {}
    torch.manual_seed(0)
    model = build_model(load_preset("tiny", overrides), seed=0)
    optimizer = build_optimizer(OptimConfig(), model)
    tokens = torch.randint(0, model.cfg.vocab_size, (8, 257))
    base = resident_mib()
    phases: dict[str, list[float]] = {"forward_backward": [], "clip": [], "optimizer": []}
    for i in range(repeats + 2):
        marks = [time.perf_counter()]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        marks.append(time.perf_counter())
        clip_grad_norm([p for p in model.parameters() if p.grad is not None], 1.0)
        marks.append(time.perf_counter())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        marks.append(time.perf_counter())
        if i >= 2:  # warm-up: the allocator, the optimizer's state
            for times, a, b in zip(phases.values(), marks, marks[1:], strict=False):
                times.append(b - a)
    grown = resident_mib() - base
    out = {name: statistics.median(times) for name, times in phases.items()}
    out["step_seconds"] = sum(out.values())
    tables = [p for n, p in model.named_parameters() if n.endswith("engram.table.weight")]
    out["table_rows"] = sum(t.shape[0] for t in tables)
    out["table_parameters"] = sum(t.numel() for t in tables)
    out["parameters"] = sum(p.numel() for p in model.parameters())
    out["rss_growth_mib"] = grown
    return out


def resident_mib() -> float:
    """The process's resident set now (Linux /proc), MiB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def tables_benchmark(repeats: int, rounds: int = 3) -> None:
    """Every case in its own process, `rounds` times round-robin (this machine's noise comes in
    bursts); each case keeps its fastest round."""
    cases = [(0, True)] + [(rows, sparse) for rows in ROWS for sparse in (True, False)]
    best: dict[tuple[int, bool], dict] = {}
    for _ in range(rounds):
        for rows, sparse in cases:
            command = [sys.executable, __file__, "worker", "--rows", str(rows)]
            command += ["--repeats", str(repeats)] + ([] if sparse else ["--dense"])
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            kept = best.get((rows, sparse))
            if kept is None or row["step_seconds"] < kept["step_seconds"]:
                best[(rows, sparse)] = row
    results = []
    for (rows, sparse), row in best.items():
        row["case"] = "tiny" if not rows else f"{rows:.0e} rows, {'sparse' if sparse else 'dense'}"
        results.append(row)
    base = results[0]["step_seconds"]
    for row in results:
        row["time_vs_tiny"] = row["step_seconds"] / base
        print(
            f"{row['case']:22s} {row['parameters']:>12,} params  step {row['step_seconds']:.3f} s "
            f"({row['time_vs_tiny']:.2f}x; fwd+bwd {row['forward_backward']:.3f}, clip "
            f"{row['clip']:.3f}, optimizer {row['optimizer']:.3f})  resident "
            f"+{row['rss_growth_mib']:.0f} MiB"
        )
    body = {"batch": [8, 256], "precision": "bf16", "rounds": rounds, "rows": results}
    save_result("engram_tables_cpu.json", body)


def engine_step_times(
    rank: int, world: int, rows: int, sharding: str = "rows", steps: int = 4
) -> list[float]:
    """Training steps through the trainer's engine (FSDP2 when world > 1) on this rank's slice
    of a fixed global batch of 8 x 256."""
    import torch.distributed as dist

    from data.loader import Batch
    from model.presets import load_preset
    from optim.config import OptimConfig
    from parallel.config import ParallelConfig
    from parallel.mesh import ParallelDims
    from trainer.build import build_training_engine
    from trainer.config import TrainerConfig
    from trainer.hooks import start_hooks
    from trainer.step import LossTracker, StepSettings, train_step

    overrides = variant(rows, True) | {"engram.sharding": sharding} if rows else {}
    cfg = load_preset("tiny", overrides)
    dims = ParallelDims.resolve(ParallelConfig(), world)
    tcfg = TrainerConfig(precision="bf16", batch_size=8, compile="false")
    engine = build_training_engine(
        cfg, tcfg, ParallelConfig(), OptimConfig(warmup_steps=0), dims, torch.device("cpu"), 0
    )
    tokens = torch.randint(0, cfg.vocab_size, (8, 257), generator=torch.Generator().manual_seed(0))
    part = tokens[rank * 8 // world : (rank + 1) * 8 // world]
    batch = Batch(part[:, :-1], part[:, 1:], torch.zeros_like(part[:, 1:]))
    settings, tracker, times = StepSettings(grad_clip=1.0), LossTracker(0.0), []
    hooks = start_hooks(engine, 0.0, None)
    for _ in range(2 + steps):
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        train_step(engine, batch, settings, tracker, hooks)
        times.append(time.perf_counter() - start)
    return times[2:]


def fsdp_benchmark() -> None:
    from bench.ranks import run_on_ranks

    cores = len(os.sched_getaffinity(0))
    results = []
    for rows in (0, *ROWS):
        row = {"table_rows": rows}
        cases = [("one_process", 1, "rows"), ("fsdp2_rows", 2, "rows")]
        cases += [("fsdp2_replicated", 2, "replicated")] if rows else []
        for name, world, sharding in cases:
            times = run_on_ranks(world, cores, engine_step_times, rows, sharding)
            row[name] = statistics.median(times)
        results.append(row)
        print(
            f"{rows:>10,} rows: "
            + ", ".join(f"{k} {v:.3f} s" for k, v in row.items() if k != "table_rows")
        )
    save_result("engram_fsdp_cpu.json", {"batch": [8, 256], "precision": "bf16", "rows": results})


def corpus_benchmark(only: list[str]) -> None:
    names = only or list(CORPUS)
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for name in names:
            preset, overrides = CORPUS[name]
            row = corpus_run(preset, 3e-3, Path(tmp), overrides, tag=name) | {"name": name}
            if "MTP" in name:  # its module drafts for self-speculative decoding
                row["speculative"] = acceptance(Path(tmp) / run_dir_name(name))
            rows.append(row)
    saved = ROOT / "bench" / "results" / "engram_corpus_cpu.json"
    if only and saved.is_file():
        kept = [r for r in json.loads(saved.read_text())["rows"] if r["name"] not in only]
        rows = sorted(kept + rows, key=lambda r: list(CORPUS).index(r["name"]))
    base = next((r for r in rows if r["name"] == "tiny"), None)
    for row in rows:
        if base is not None:
            row["time_vs_tiny"] = base["median_tokens_per_s"] / row["median_tokens_per_s"]
        print(
            f"{row['name']:15s} validation {row['validation'][0][1]} -> {row['validation'][-1][1]}"
            f", {row['median_tokens_per_s']:.0f} tokens/s, {row['wall_seconds']} s"
        )
        if "speculative" in row:
            print(f"{'':15s} speculative decoding: {row['speculative']}")
    save_result("engram_corpus_cpu.json", {"steps": 300, "lr": 3e-3, "rows": rows})
    _plot(rows, ROOT / "bench" / "results" / "engram_corpus.png")


def acceptance(run_dir: Path, prompts: int = 16, prompt_len: int = 64, new: int = 64) -> dict:
    """Self-speculative greedy decoding with the run's final model on validation prompts (the
    first `prompt_len` tokens of `prompts` validation windows): the drafts' acceptance rate,
    main-model forwards per generated token, and the wall time against plain greedy decoding."""
    from data.config import LoaderConfig
    from data.loader import TokenLoader
    from model.generate import generate
    from model.mtp.speculative import speculative_generate
    from trainer.checkpoint.weights import newest_model

    _, extra, model = newest_model(run_dir, "decoded")
    model.eval()
    data = Path(extra["tokenizer_dir"]).parent
    loader = TokenLoader(
        LoaderConfig(path=str(data), seq_len=256), global_batch=8, dp_rank=0, dp_size=1, seed=0
    )
    rows = torch.cat([b.inputs for b in loader.validation()])[:prompts, :prompt_len]
    drafted = accepted = forwards = tokens = 0
    plain_s = spec_s = 0.0
    for row in rows:
        start = time.perf_counter()
        expected = generate(model, row[None], new, temperature=0)
        plain_s += time.perf_counter() - start
        start = time.perf_counter()
        got, stats = speculative_generate(model, row[None], new)
        spec_s += time.perf_counter() - start
        assert torch.equal(got, expected), "speculative decoding must give the greedy output"
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
        forwards, tokens = forwards + stats.main_forwards + 1, tokens + new
    return {
        "prompts": len(rows),
        "new_tokens": new,
        "acceptance": accepted / drafted,
        "main_forwards_per_token": forwards / tokens,
        "speedup_vs_greedy": plain_s / spec_s,
    }


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for row in rows:
        steps, losses = zip(*row["validation"], strict=True)
        ax.plot(steps, losses, label=row["name"])
    finish_validation_plot(fig, ax, "Engram and MTP on the default corpus", path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("tables", "fsdp", "corpus", "worker"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dense", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="*", default=[], choices=list(CORPUS))
    args = parser.parse_args()
    if args.mode == "worker":
        print(json.dumps(measure_step(args.rows, not args.dense, args.repeats)))
    elif args.mode == "tables":
        tables_benchmark(args.repeats)
    elif args.mode == "fsdp":
        fsdp_benchmark()
    else:
        corpus_benchmark(args.only)


if __name__ == "__main__":
    main()
