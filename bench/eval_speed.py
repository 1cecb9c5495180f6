"""Evaluation and sampling cost in a compiled run (trainer.compile=true) of the default tiny
model on CPU: what compiling them costs and what it saves, to decide when the trainer compiles
them (trainer/config.py: EVAL_COMPILE_MIN_BATCHES, trainer.compile_eval).

Measured in one process, from an empty compile cache (a first run), after one compiled training
step (so that Dynamo's and Inductor's one-time start-up is not counted against evaluation):
  * the no-grad graphs' compile, cold and again from the cache on disk (after a Dynamo reset);
  * an evaluation batch (8 x 256, no_grad, bf16 autocast): eager with the loss through the
    autograd Function (the path evaluations took before the loss-only one: it computed both head
    gradients), eager with the loss alone (today), and compiled;
  * the trainer's sample (48 new tokens from a 1-token prompt): its compile, then compiled and
    eager.
The variants take turns over several rounds, in a rotating order (this machine drifts).

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
from bench.engines import tiny_cpu_engine
from bench.machine import machine
from data.loader import Batch
from model.generate import generate
from trainer.cpu_malloc import keep_freed_memory
from trainer.hooks import start_hooks
from trainer.step import LossTracker, StepSettings, train_step

BATCH, SEQ_LEN, SAMPLE_TOKENS = (
    8,
    256,
    48,
)  # the defaults: trainer.batch_size, data.seq_len, trainer.sample_tokens
EAGER = "force_eager"


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def through_the_function(h, weight, targets, chunk):
    """The loss as evaluations computed it before: the fused Function (both gradients) under
    no_grad."""
    h, targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    h = h.to(torch.get_autocast_dtype("cpu"))

    def compute(h, weight, want_grad):
        return loss_module.chunked_loss(h, weight, targets, chunk, want_grad=want_grad)

    with torch.autocast("cpu", enabled=False):
        return loss_module.GradientsInForward.apply(h, weight, compute)


def take_turns(variants: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds of each variant per round, the order rotating from round to round."""
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(timed(variants[name]))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    keep_freed_memory()  # as `python -m trainer` on CPU
    engine = tiny_cpu_engine("bf16", compile=True)
    hooks = start_hooks(engine, 0.0, None)
    model = engine.model
    x = torch.randint(0, 8192, (BATCH, SEQ_LEN))
    y = torch.randint(0, 8192, (BATCH, SEQ_LEN))
    batch = Batch(x, y, torch.zeros_like(x, dtype=torch.int32))
    training_compile = timed(
        lambda: train_step(engine, batch, StepSettings(grad_clip=1.0), LossTracker(0.0), hooks)
    )

    def evaluate() -> None:
        model.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            model(x, y)
        model.train()

    def sample() -> None:
        model.eval()
        with torch.no_grad():
            gen = torch.Generator().manual_seed(0)
            generate(
                model, torch.tensor([[1]]), SAMPLE_TOKENS, temperature=0.8, top_k=50, generator=gen
            )
        model.train()

    def eager(fn):
        def run() -> None:
            with torch.compiler.set_stance(EAGER):
                fn()

        return run

    def loss_through_the_function() -> None:
        real, model.loss_fn = model.loss_fn, through_the_function
        try:
            eager(evaluate)()
        finally:
            model.loss_fn = real

    compile_eval = timed(evaluate)  # cold: Dynamo + Inductor for the no-grad graphs
    compile_sample = timed(sample)
    evals = take_turns(
        {
            "compiled": evaluate,
            "eager": eager(evaluate),
            "eager_loss_function": loss_through_the_function,
        },
        args.rounds,
    )
    samples = take_turns({"compiled": sample, "eager": eager(sample)}, args.rounds)
    torch._dynamo.reset()  # forget the compiled code; Inductor's on-disk cache stays
    compile_eval_warm = timed(evaluate)
    batch_s = {name: statistics.median(t) for name, t in evals.items()}
    sample_s = {name: statistics.median(t) for name, t in samples.items()}
    saved = batch_s["eager"] - batch_s["compiled"]
    cold = compile_eval - batch_s["compiled"]
    result = {
        "benchmark": "eval_speed",
        "machine": machine(),
        "args": vars(args),
        "training_step_compile_seconds": training_compile,
        "eval_batch_seconds": batch_s,
        "eval_batch_seconds_all": evals,
        "eval_compile_seconds": cold,
        "eval_compile_seconds_warm_cache": compile_eval_warm - batch_s["compiled"],
        "eval_compile_pays_back_after_batches": cold / saved if saved > 0 else None,
        "sample_compile_seconds": compile_sample - sample_s["compiled"],
        "sample_seconds": sample_s,
        "sample_seconds_all": samples,
    }
    out = ROOT / "bench" / "results" / "eval_speed_cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    skip = ("machine", "eval_batch_seconds_all", "sample_seconds_all")
    print(json.dumps({k: v for k, v in result.items() if k not in skip}, indent=2))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
