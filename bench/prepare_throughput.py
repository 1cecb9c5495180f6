"""Throughput of `data.prepare` (MB/s of UTF-8 text) vs tiktoken's own batch encoder.

The corpus is the Python standard library's sources (the default `source=stdlib`), read as UTF-8
with undecodable files skipped, as the pipeline does. For each tokenizer, in the same run and with
the same number of cores:
- raw: `encoding.encode_ordinary_batch(texts, num_threads=cores)` on the texts already in memory;
- pipeline: `prepare(PrepareConfig(source="stdlib", out=<fresh dir>, tokenizer=..., workers=cores))`
  end to end: reading the files, splitting, tokenizing in worker processes, writing the shards
  and the manifest.
The trained BPE (vocab 8192, rustbpe on the same corpus) is trained once before any timing and
passed to `prepare` as a saved tokenizer directory, so no training is timed. The two
measurements alternate and the best of `--repeats` counts. MB = 10**6 bytes of UTF-8 text.
Two fixed costs inside the pipeline are also timed on their own, to read the ratio by: listing
the corpus files, and starting (and closing) the encoding threads with the tokenizer loaded.

    python bench/prepare_throughput.py [--repeats 3] [--cores N] [--max-documents 0]
Writes bench/results/prepare_throughput_cpu.json (with --copies N: prepare_throughput_cpu_xN.json).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.machine import machine
from data.bpe import train_bpe
from data.config import PrepareConfig
from data.encode_pool import EncodePool
from data.prepare import prepare, token_dtype
from data.sources import stdlib_files
from data.tokenizer import load_tokenizer

TARGET_RATIO = 0.80


def read_corpus(max_documents: int) -> list[str]:
    """The documents `source=stdlib` yields: UTF-8 files in order, undecodable and empty skipped."""
    texts = []
    for index, path in enumerate(stdlib_files()):
        if max_documents and index >= max_documents:
            break
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text:
            texts.append(text)
    return texts


def time_raw(encoding, texts: list[str], cores: int) -> tuple[float, int]:
    start = time.perf_counter()
    ids = encoding.encode_ordinary_batch(texts, num_threads=cores)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(x) for x in ids)


def write_copies(texts: list[str], copies: int, scratch: Path) -> str:
    """`copies` copies of the corpus as a directory source (the same text, `copies` times)."""
    root = scratch / "corpus"
    for c in range(copies):
        folder = root / f"copy{c}"
        folder.mkdir(parents=True)
        for i, text in enumerate(texts):
            (folder / f"{i:05d}.py").write_text(text, encoding="utf-8")
    return str(root)


def time_pipeline(
    tokenizer: str, cores: int, max_documents: int, scratch: Path, source: str
) -> tuple[float, int]:
    out = Path(tempfile.mkdtemp(prefix="prepare-", dir=scratch))
    cfg = PrepareConfig(
        source=source,
        out=str(out),
        tokenizer=tokenizer,
        workers=cores,
        max_documents=max_documents,
        progress=False,
    )
    start = time.perf_counter()
    manifest = prepare(cfg)
    elapsed = time.perf_counter() - start
    tokens = manifest.tokens("train") + manifest.tokens("val")
    shutil.rmtree(out)
    return elapsed, tokens


def fixed_costs(tokenizer_dir: Path, vocab_size: int, cores: int) -> dict:
    """Serial costs inside the pipeline that do not grow with the text: listing the corpus files,
    and starting the encoding threads (with the tokenizer loaded) through one tiny batch each."""
    start = time.perf_counter()
    stdlib_files()
    listing = time.perf_counter() - start
    start = time.perf_counter()
    with EncodePool(cores) as pool:
        pool.start(load_tokenizer(tokenizer_dir), token_dtype("auto", vocab_size))
        for _ in pool.map((i, ["x"]) for i in range(cores)):
            pass
    pool_start = time.perf_counter() - start
    return {"list_files_s": listing, "pool_start_and_close_s": pool_start}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cores", type=int, default=0, help="0 = every available core")
    parser.add_argument("--max-documents", type=int, default=0, help="0 = the whole corpus")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument(
        "--copies", type=int, default=1, help="time N copies of the corpus (a directory source)"
    )
    parser.add_argument(
        "--tokenizers", default="bpe,cl100k_base", help="comma-separated: bpe and/or names"
    )
    parser.add_argument(
        "--bpe-dir", default="", help="reuse a saved trained tokenizer instead of training one"
    )
    parser.add_argument("--scratch", default="", help="directory for the outputs (default: tmp)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    cores = args.cores or len(os.sched_getaffinity(0))
    logging.getLogger("data").setLevel(logging.ERROR)  # skipped-file warnings, once per pass

    texts = read_corpus(args.max_documents)
    text_bytes = sum(len(t.encode("utf-8")) for t in texts)
    print(f"corpus: {len(texts)} documents, {text_bytes / 1e6:.1f} MB of UTF-8; {cores} cores")

    scratch = Path(tempfile.mkdtemp(prefix="prepare-bench-", dir=args.scratch or None))
    rows = []
    try:
        specs = {}
        train_seconds = None
        for name in args.tokenizers.split(","):
            if name != "bpe":
                specs[name] = name
            elif args.bpe_dir:
                specs[f"bpe{args.vocab_size}"] = args.bpe_dir
            else:
                start = time.perf_counter()
                bpe = train_bpe(texts, args.vocab_size, name=f"stdlib-bpe{args.vocab_size}")
                train_seconds = time.perf_counter() - start
                specs[f"bpe{args.vocab_size}"] = str(bpe.save(scratch / "bpe"))
                print(f"trained {bpe} in {train_seconds:.1f} s (not timed below)")

        source = "stdlib"
        if args.copies > 1:
            source = write_copies(texts, args.copies, scratch)
            texts = texts * args.copies
            text_bytes *= args.copies
        for label, spec in specs.items():
            tokenizer = load_tokenizer(spec)
            costs = fixed_costs(
                tokenizer.save(scratch / f"saved-{label}"), tokenizer.vocab_size, cores
            )
            raw_times, pipe_times = [], []
            raw_tokens = pipe_tokens = 0
            for _ in range(args.repeats):
                seconds, raw_tokens = time_raw(tokenizer.encoding, texts, cores)
                raw_times.append(seconds)
                seconds, pipe_tokens = time_pipeline(
                    spec, cores, args.max_documents, scratch, source
                )
                pipe_times.append(seconds)
                print(f"  {label}: raw {raw_times[-1]:.2f} s, pipeline {pipe_times[-1]:.2f} s")
            # every document ends with one EOT in the shards: equal counts mean equal text
            if pipe_tokens != raw_tokens + len(texts):
                raise SystemExit(
                    f"{label}: the pipeline wrote {pipe_tokens} tokens but the raw encoder gives "
                    f"{raw_tokens} + {len(texts)} EOT: not the same text"
                )
            raw_mbs = text_bytes / 1e6 / min(raw_times)
            pipe_mbs = text_bytes / 1e6 / min(pipe_times)
            rows.append(
                {
                    "tokenizer": label,
                    "vocab_size": tokenizer.vocab_size,
                    "documents": len(texts),
                    "text_bytes": text_bytes,
                    "tokens": raw_tokens,
                    "cores": cores,
                    "raw_seconds": raw_times,
                    "pipeline_seconds": pipe_times,
                    "raw_mb_per_s": raw_mbs,
                    "pipeline_mb_per_s": pipe_mbs,
                    "ratio": pipe_mbs / raw_mbs,
                    "meets_target": pipe_mbs / raw_mbs >= TARGET_RATIO,
                    "fixed_costs": costs,
                }
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    print()
    print(
        f"Best of {args.repeats}; {len(texts)} documents, {text_bytes / 1e6:.1f} MB "
        f"(target: pipeline/raw >= {TARGET_RATIO:.2f})"
    )
    print()
    print(
        "| tokenizer | raw encoder MB/s | pipeline MB/s | pipeline/raw | cores "
        "| raw s | pipeline s | file listing s | pool start s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        costs = row["fixed_costs"]
        print(
            f"| {row['tokenizer']} | {row['raw_mb_per_s']:.2f} | {row['pipeline_mb_per_s']:.2f} "
            f"| {row['ratio']:.2f} | {row['cores']} | {min(row['raw_seconds']):.2f} "
            f"| {min(row['pipeline_seconds']):.2f} | {costs['list_files_s']:.2f} "
            f"| {costs['pool_start_and_close_s']:.2f} |"
        )
    result = {
        "machine": machine(("torch", "tiktoken", "rustbpe", "numpy"), cores_used=cores),
        "args": vars(args),
        "target_ratio": TARGET_RATIO,
        "bpe_train_seconds": train_seconds,
        "rows": rows,
    }
    suffix = f"_x{args.copies}" if args.copies > 1 else ""
    out = Path(args.out) / f"prepare_throughput_cpu{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
