"""TokenLoader throughput (tokens/s) vs the tokens/s that training the tiny model consumes.

The dataset is the default corpus (the Python standard library's sources) prepared once into a
temporary directory with a BPE trained on it (vocab 8192), unless `--dataset` names one. The
loader runs with the default run's shapes (seq_len 512, global batch 32) and reads `--batches`
batches after `--warmup` batches (which include worker start-up and the lazy shard checksum):
with num_workers=0 every batch is assembled in the calling process, which gives the per-process
rate; num_workers=1 and 2 are for reference. In the same run, the training rate is timed as
forward + backward + AdamW step of the `tiny` preset on CPU (batch 8 x 512 by default), per
precision (fp32, and bf16 autocast), after warm-up steps. The ratio compares the in-process
loader with the fastest training precision (the stricter comparison).

    python bench/loader_throughput.py [--batches 300] [--steps 5] [--dataset DIR]
Writes bench/results/loader_throughput_cpu.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.machine import machine
from data.config import LoaderConfig, PrepareConfig
from data.loader import TokenLoader
from data.prepare import prepare
from model import build_model
from model.presets import load_preset

REQUIRED_RATIO = 100


def loader_rate(
    dataset: str, workers: int, seq_len: int, global_batch: int, warmup: int, batches: int
) -> dict:
    cfg = LoaderConfig(path=dataset, seq_len=seq_len, num_workers=workers)
    loader = TokenLoader(cfg, global_batch=global_batch)
    stream = iter(loader)
    try:
        for _ in range(warmup):
            next(stream)
        start = time.perf_counter()
        for _ in range(batches):
            next(stream)
        elapsed = time.perf_counter() - start
    finally:
        stream.close()  # stops the DataLoader's workers
    tokens_per_s = batches * global_batch * seq_len / elapsed
    return {
        "num_workers": workers,
        "batches": batches,
        "seconds": elapsed,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_process": tokens_per_s / max(workers, 1),
    }


def training_rate(
    batch: int, seq_len: int, precision: str, warmup: int, steps: int, seed: int = 0
) -> dict:
    torch.manual_seed(seed)
    cfg = load_preset("tiny")
    model = build_model(cfg)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if precision == "bf16"
        else contextlib.nullcontext()
    )
    times = []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        with autocast:
            loss = model(inputs, targets=targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    seconds = sum(times[warmup:]) / steps
    return {
        "precision": "bf16 autocast" if precision == "bf16" else "fp32",
        "batch": batch,
        "seq_len": seq_len,
        "steps": steps,
        "seconds_per_step": seconds,
        "tokens_per_s": batch * seq_len / seconds,
        "final_loss": loss.detach().item(),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dataset", default="", help="a prepared dataset (default: prepare one)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--workers", default="0,1,2", help="num_workers values to time")
    parser.add_argument("--train-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--train-warmup", type=int, default=2)
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    logging.getLogger("data").setLevel(logging.ERROR)  # skipped-file warnings while preparing

    scratch = None
    prepare_seconds = None
    dataset = args.dataset
    if not dataset:
        scratch = Path(tempfile.mkdtemp(prefix="loader-bench-"))
        dataset = str(scratch / "stdlib-bpe8192")
        start = time.perf_counter()
        manifest = prepare(
            PrepareConfig(
                source="stdlib", out=dataset, tokenizer="train", vocab_size=8192, progress=False
            )
        )
        prepare_seconds = time.perf_counter() - start
        print(
            f"prepared {manifest.tokens('train')} training tokens in {dataset} "
            f"({prepare_seconds:.0f} s, BPE training included)"
        )
    try:
        loaders = []
        for workers in (int(w) for w in args.workers.split(",")):
            row = loader_rate(
                dataset, workers, args.seq_len, args.global_batch, args.warmup, args.batches
            )
            loaders.append(row)
            print(f"  loader num_workers={workers}: {row['tokens_per_s']:,.0f} tokens/s")
        training = []
        for precision in args.precisions.split(","):
            row = training_rate(
                args.train_batch, args.seq_len, precision, args.train_warmup, args.steps
            )
            training.append(row)
            print(f"  training {row['precision']}: {row['tokens_per_s']:,.0f} tokens/s")
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)

    fastest = max(training, key=lambda r: r["tokens_per_s"])
    for row in loaders:
        row["ratio_to_training"] = row["tokens_per_s"] / fastest["tokens_per_s"]
        row["ratio_per_process_to_training"] = (
            row["tokens_per_s_per_process"] / fastest["tokens_per_s"]
        )
    in_process = next((r for r in loaders if r["num_workers"] == 0), None)

    print()
    print(
        f"seq_len {args.seq_len}, global batch {args.global_batch}, {args.batches} batches after "
        f"{args.warmup}; training: tiny preset, batch {args.train_batch} x {args.seq_len}, "
        f"forward + backward + AdamW, {torch.get_num_threads()} threads"
    )
    print()
    print("| measured | tokens/s | tokens/s per process | ratio to training | per process |")
    print("|---|---:|---:|---:|---:|")
    for row in loaders:
        print(
            f"| loader, num_workers={row['num_workers']} | {row['tokens_per_s']:,.0f} "
            f"| {row['tokens_per_s_per_process']:,.0f} | {row['ratio_to_training']:,.0f} "
            f"| {row['ratio_per_process_to_training']:,.0f} |"
        )
    for row in training:
        print(f"| training, {row['precision']} | {row['tokens_per_s']:,.0f} | | | |")
    if in_process is not None:
        verdict = "meets" if in_process["ratio_to_training"] > REQUIRED_RATIO else "misses"
        print(
            f"\nin-process loader / fastest training ({fastest['precision']}): "
            f"{in_process['ratio_to_training']:,.0f} ({verdict} the required > {REQUIRED_RATIO})"
        )
    result = {
        "machine": machine(("torch", "tiktoken", "numpy"), torch_threads=torch.get_num_threads()),
        "args": vars(args),
        "dataset": args.dataset or "stdlib, tokenizer=train, vocab_size=8192 (temporary)",
        "prepare_seconds": prepare_seconds,
        "required_ratio": REQUIRED_RATIO,
        "loader": loaders,
        "training": training,
        "ratio_in_process_to_fastest_training": (
            in_process["ratio_to_training"] if in_process else None
        ),
    }
    out = Path(args.out) / "loader_throughput_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
