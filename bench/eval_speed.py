"""Evaluation and sampling cost in a compiled run (trainer.compile=true) of the default tiny
model on CPU: what compiling them costs and what it saves, to decide when the trainer compiles
them (trainer/config.py: compiles_evaluation).

Measured in one process, from an empty compile cache (a first run):
  * an evaluation batch (8 x 256, no_grad, bf16 autocast): eager with the loss through the
    autograd Function (the path evaluations took before the loss-only one: it computed both head
    gradients), eager with the loss alone (today), and compiled (after its compile, timed);
  * the trainer's sample (48 new tokens from a 1-token prompt): compiled (cold, then warm) and
    eager.
Eager and compiled evaluation batches take turns over several rounds (this machine drifts).

    python bench/eval_speed.py [--rounds 7]
Writes bench/results/eval_speed_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="eval_speed_"))

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import model.loss as loss_module
from bench.machine import machine
from model.generate import generate
from model.presets import load_preset
from optim.config import OptimConfig
from parallel.config import ParallelConfig
from parallel.mesh import ParallelDims
from trainer.build import build_training_engine
from trainer.config import TrainerConfig
from trainer.cpu_malloc import keep_freed_memory

BATCH, SEQ_LEN, SAMPLE_TOKENS = 8, 256, 48  # conf/trainer/default.yaml, trainer.sample_tokens
EAGER = "force_eager"


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def through_the_function(h, weight, targets, chunk):
    """The loss as evaluations computed it before: FusedLinearCrossEntropy under no_grad."""
    h, targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    h = h.to(torch.get_autocast_dtype("cpu"))
    with torch.autocast("cpu", enabled=False):
        return loss_module.FusedLinearCrossEntropy.apply(h, weight, targets, chunk)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    keep_freed_memory()  # as `python -m trainer` on CPU
    torch.manual_seed(0)
    dims = ParallelDims.resolve(ParallelConfig(), 1)
    engine = build_training_engine(
        load_preset("tiny"),
        TrainerConfig(precision="bf16", compile=True),
        ParallelConfig(),
        OptimConfig(),
        dims,
        torch.device("cpu"),
        0,
    )
    model = engine.model.eval()
    x = torch.randint(0, 8192, (BATCH, SEQ_LEN))
    y = torch.randint(0, 8192, (BATCH, SEQ_LEN))

    def evaluate() -> None:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            model(x, y)

    def sample() -> None:
        with torch.no_grad():
            gen = torch.Generator().manual_seed(0)
            prompt = torch.tensor([[1]])
            generate(model, prompt, SAMPLE_TOKENS, temperature=0.8, top_k=50, generator=gen)

    compile_eval = timed(evaluate)  # cold: Dynamo + Inductor for the no-grad graphs
    compile_sample = timed(sample)
    warm_sample = timed(sample)
    with torch.compiler.set_stance(EAGER):
        eager_sample = timed(sample)
        timed(evaluate)
    times: dict[str, list[float]] = {"compiled": [], "eager": [], "eager_loss_function": []}
    for _ in range(args.rounds):
        times["compiled"].append(timed(evaluate))
        with torch.compiler.set_stance(EAGER):
            times["eager"].append(timed(evaluate))
            real = model.loss_fn
            model.loss_fn = through_the_function
            times["eager_loss_function"].append(timed(evaluate))
            model.loss_fn = real
    batch = {name: statistics.median(t) for name, t in times.items()}
    saved = batch["eager"] - batch["compiled"]
    result = {
        "benchmark": "eval_speed",
        "machine": machine(),
        "args": vars(args),
        "eval_batch_seconds": batch,
        "eval_batch_seconds_all": times,
        "eval_compile_seconds": compile_eval - batch["compiled"],
        "eval_compile_pays_back_after_batches": (compile_eval - batch["compiled"]) / saved
        if saved > 0
        else None,
        "sample_seconds": {
            "compiled_first_call": compile_sample,
            "compiled_warm": warm_sample,
            "eager": eager_sample,
        },
    }
    out = ROOT / "bench" / "results" / "eval_speed_cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
