"""Hugging Face import and export: time and peak memory against model size, streamed (a part at a
time: today's path) against the whole model in one process (the path before), in the same run.

Models: Llama-shaped dense decoders from ~20M to ~0.85B parameters (vocabulary 32000, SwiGLU,
GQA). Each measurement runs in a fresh process; memory is the growth of its peak resident set
(VmHWM) over its resident set when the measured work starts (imports and process groups are
before it):

  export     a DCP training checkpoint (fp32 weights) -> a bf16 HF directory in 2 GB files:
             streamed = `python -m trainer.export` (a layer at a time); whole = the checkpoint
             read into one model, then `save_hf`
  import     `load_hf` in one process (the whole model, in the checkpoint's bf16), every weight
             then read once (safetensors maps the files: untouched, nothing would be loaded)
  2 ranks    the FSDP2 engine on 2 gloo ranks: seeded (no checkpoint: the cost of building
             the engine itself), init_from=hf: streamed (each rank converts a part at a time
             and keeps its shard) and whole (each rank reads the whole checkpoint into memory
             and converts it: the path before)

    python bench/hf_io.py [--sizes tiny,100m,400m,1b]
Writes bench/results/hf_io_cpu.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
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


def rss_mib(field: str = "VmRSS") -> float:
    """This process's resident set (VmRSS) or its peak (VmHWM; ru_maxrss would also count the
    parent's, which a forked child keeps through exec)."""
    status = Path("/proc/self/status").read_text()
    return int(next(ln for ln in status.splitlines() if ln.startswith(field)).split()[1]) / 1024


def checkpoint_job(size: str, root: str, hf: str, result: dict) -> None:
    """The model (seeded) as a DCP training checkpoint and a bf16 HF directory."""
    import dataclasses

    from model.hf import save_hf
    from model.transformer import build_model
    from trainer.checkpoint.save import Checkpointer

    model = build_model(model_config(size), seed=0)

    class Weights:
        def state_dict(self) -> dict:
            return {"model": model.state_dict()}

    extra = {"model_config": dataclasses.asdict(model.cfg), "step": 1}
    Checkpointer(Path(root), 0, keep=1).save(1, Weights(), extra)
    save_hf(model, hf, dtype=torch.bfloat16)
    result["params"] = sum(p.numel() for p in model.parameters())


def export_job(mode: str, root: str, out: str, result: dict) -> None:
    from model.hf import save_hf
    from trainer.checkpoint.weights import newest_model
    from trainer.export import ExportConfig, export

    before, start = rss_mib(), time.perf_counter()
    if mode == "streamed":
        export(ExportConfig(path=root, out=out, max_shard_size="2GB", overwrite=True))
    else:
        _, _, model = newest_model(Path(root), "exported")
        save_hf(model, out, dtype=torch.bfloat16, max_shard_bytes=2 * 10**9, overwrite=True)
    result.update(seconds=time.perf_counter() - start, grew_mib=rss_mib("VmHWM") - before)


def import_job(out: str, result: dict) -> None:
    from model.hf import load_hf

    before, start = rss_mib(), time.perf_counter()
    model = load_hf(out)
    # safetensors maps the files: reading every weight once makes the load real (and resident)
    with torch.no_grad():
        checksum = sum(float(p.float().sum()) for p in model.parameters())
    result.update(
        seconds=time.perf_counter() - start,
        grew_mib=rss_mib("VmHWM") - before,
        checksum=checksum,
    )


def ranks_job(rank: int, world: int, mode: str, size: str, out: str) -> dict:
    from model.hf import from_hf_state_dict, read_hf_state_dict
    from optim.config import OptimConfig
    from parallel.config import ParallelConfig
    from parallel.mesh import ParallelDims
    from trainer.build import build_training_engine
    from trainer.config import TrainerConfig
    from trainer.hf_init import hf_weights_reader

    cfg = model_config(size)
    parallel = ParallelConfig()
    dims = ParallelDims.resolve(parallel, world)
    readers = {
        "seeded": None,
        "streamed": hf_weights_reader(f"hf:{out}", cfg),
        # the path before: every rank reads the whole checkpoint into memory, then converts it
        "whole": lambda: [
            from_hf_state_dict({n: t.clone() for n, t in read_hf_state_dict(out).items()}, cfg)
        ],
    }
    before, start = rss_mib(), time.perf_counter()
    build_training_engine(
        cfg, TrainerConfig(batch_size=world, compile="false"), parallel, OptimConfig(), dims,
        torch.device("cpu"), 0, readers[mode],
    )  # fmt: skip
    grew = [None] * world
    torch.distributed.all_gather_object(grew, rss_mib("VmHWM") - before)
    return {"seconds": time.perf_counter() - start, "grew_mib_per_rank": max(grew)}


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


def _ranks_with_a_retry(cores: int, mode: str, size: str, hf: str) -> dict:
    """run_on_ranks(ranks_job), once more if a rank died (gloo's teardown has aborted a rank
    now and then on this machine: "terminate called without an active exception")."""
    try:
        return run_on_ranks(2, cores, ranks_job, mode, size, hf)
    except mp.ProcessExitedException as err:
        print(f"{mode}: {err}; running it again", flush=True)
        return run_on_ranks(2, cores, ranks_job, mode, size, hf) | {"retried": str(err)}


def measure(size: str, cores: int) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"hf_io_{size}_"))
    try:
        root, hf = str(workdir / "checkpoints"), str(workdir / "hf")
        row = {"size": size, **in_process(checkpoint_job, size, root, hf)}
        row["checkpoint_mib"] = sum(f.stat().st_size for f in Path(hf).iterdir()) / 2**20
        for mode in ("streamed", "whole"):
            row[f"export_{mode}"] = in_process(export_job, mode, root, str(workdir / mode))
        row["import"] = in_process(import_job, hf)
        for mode in ("seeded", "streamed", "whole"):
            row[f"ranks_{mode}"] = _ranks_with_a_retry(cores, mode, size, hf)
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
        print(_line(rows[-1]), flush=True)
    out = ROOT / "bench" / "results" / "hf_io_cpu.json"
    out.write_text(
        json.dumps({"machine": machine(("torch", "safetensors")), "rows": rows}, indent=2)
    )
    print(f"wrote {out}")


def _line(row: dict) -> str:
    def cell(result: dict, key: str = "grew_mib") -> str:
        return f"{result['seconds']:5.1f}s +{result[key]:6.0f} MiB"

    ranks = {
        m: cell(row[f"ranks_{m}"], "grew_mib_per_rank") for m in ("seeded", "streamed", "whole")
    }
    return (
        f"{row['size']:>5} {row['params'] / 1e6:7.1f}M ckpt {row['checkpoint_mib']:6.0f} MiB | "
        f"export streamed {cell(row['export_streamed'])} whole {cell(row['export_whole'])} | "
        f"import {cell(row['import'])} | 2 ranks seeded {ranks['seeded']} streamed "
        f"{ranks['streamed']} whole {ranks['whole']}"
    )


if __name__ == "__main__":
    main()
