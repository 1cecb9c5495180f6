"""Hugging Face import and export: time and peak memory against model size, one process and 2
ranks (the path `init_from=hf:<dir>` takes today).

Models: Llama-shaped dense decoders from ~7M to ~1B parameters (vocabulary 32000, SwiGLU, GQA),
weights exported in bf16. Each measurement runs in a fresh process, so its peak resident memory
(ru_maxrss) is its own:

  export     build the model (fp32, seeded) and `save_hf` it (bf16 safetensors, sharded at 5 GiB)
  import     `load_hf` in one process (the whole model, in the checkpoint's bf16), every weight
             then read once (safetensors maps the files: untouched, nothing would be loaded)
  2 ranks    the FSDP2 engine on 2 gloo ranks started from the checkpoint (init_from=hf:): each
             rank reads and converts the whole checkpoint today, then keeps its shard

    python bench/hf_io.py [--sizes tiny,100m,400m,1b]
Writes bench/results/hf_io_cpu.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.machine import machine
from bench.ranks import run_on_ranks

SIZES = {  # name: (d_model, n_layers, heads, kv heads)
    "tiny": (256, 4, 4, 2),
    "100m": (768, 12, 12, 4),
    "400m": (1024, 24, 16, 4),
    "1b": (2048, 16, 16, 4),
}
VOCAB = 32000


def model_config(size: str):
    from model import AttentionConfig, ModelConfig

    d, layers, heads, kv = SIZES[size]
    return ModelConfig(
        vocab_size=VOCAB,
        d_model=d,
        n_layers=layers,
        max_seq_len=2048,
        attention=AttentionConfig(n_heads=heads, n_kv_heads=kv),
    )


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def export_job(size: str, out: str, result: dict) -> None:
    from model.hf import save_hf
    from model.transformer import build_model

    model = build_model(model_config(size), seed=0)
    before = peak_mib()
    start = time.perf_counter()
    save_hf(model, out, dtype=torch.bfloat16)
    result.update(
        seconds=time.perf_counter() - start,
        peak_mib=peak_mib(),
        peak_before_mib=before,
        params=sum(p.numel() for p in model.parameters()),
    )


def import_job(out: str, result: dict) -> None:
    from model.hf import load_hf

    start = time.perf_counter()
    model = load_hf(out)
    # safetensors maps the files: reading every weight once makes the load real (and resident)
    with torch.no_grad():
        checksum = sum(float(p.float().sum()) for p in model.parameters())
    result.update(seconds=time.perf_counter() - start, peak_mib=peak_mib(), checksum=checksum)


def ranks_job(rank: int, world: int, size: str, out: str) -> dict:
    from optim.config import OptimConfig
    from parallel.config import ParallelConfig
    from parallel.mesh import ParallelDims
    from trainer.build import build_training_engine
    from trainer.config import TrainerConfig
    from trainer.hf_init import hf_weights_reader

    cfg = model_config(size)
    parallel = ParallelConfig()
    dims = ParallelDims.resolve(parallel, world)
    start = time.perf_counter()
    reader = hf_weights_reader(f"hf:{out}", cfg)
    build_training_engine(
        cfg, TrainerConfig(batch_size=world), parallel, OptimConfig(), dims,
        torch.device("cpu"), 0, reader,
    )  # fmt: skip
    peaks = [None] * world
    torch.distributed.all_gather_object(peaks, peak_mib())
    return {"seconds": time.perf_counter() - start, "peak_mib_per_rank": max(peaks)}


def in_process(target, *args) -> dict:
    """Run `target(*args, result)` in a fresh spawned process and return its result dict."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        result = manager.dict()
        process = ctx.Process(target=target, args=(*args, result))
        process.start()
        process.join()
        if process.exitcode != 0:
            raise RuntimeError(f"{target.__name__} failed with exit code {process.exitcode}")
        return dict(result)


def measure(size: str, cores: int) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"hf_io_{size}_"))
    try:
        out = str(workdir / "hf")
        row = {"size": size, "export": in_process(export_job, size, out)}
        row["params"] = row["export"].pop("params")
        row["checkpoint_mib"] = sum(f.stat().st_size for f in Path(out).iterdir()) / 2**20
        row["import"] = in_process(import_job, out)
        row["two_ranks"] = run_on_ranks(2, cores, ranks_job, size, out)
        return row
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--cores", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for size in args.sizes.split(","):
        rows.append(measure(size, args.cores))
        row = rows[-1]
        print(
            f"{size:>5} {row['params'] / 1e6:8.1f}M  ckpt {row['checkpoint_mib']:8.0f} MiB | "
            f"export {row['export']['seconds']:6.1f}s peak {row['export']['peak_mib']:7.0f} MiB | "
            f"import {row['import']['seconds']:6.1f}s peak {row['import']['peak_mib']:7.0f} MiB | "
            f"2 ranks {row['two_ranks']['seconds']:6.1f}s peak/rank "
            f"{row['two_ranks']['peak_mib_per_rank']:7.0f} MiB",
            flush=True,
        )
    out = ROOT / "bench" / "results" / "hf_io_cpu.json"
    out.write_text(
        json.dumps({"machine": machine(("torch", "safetensors")), "rows": rows}, indent=2)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
