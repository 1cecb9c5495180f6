"""How much MFU the tiny model's own matmuls allow on this machine: an upper bound for any
implementation of the training step.

Every GEMM of one training step of the `tiny` preset (forward y = x W^T, backward dX = dY W and
dW = dY^T X, for each projection of each layer and the chunked output head) is timed alone in
the step's compute dtype (--precision: auto = what `trainer.precision=auto` takes on this CPU,
bf16 where it has bf16 instructions, else fp32) at its real shape, and causal attention forward
+ backward at the real (B, H, T, D) through the fastest kernel for that shape
(bench/attention_kernels.py: SDPA, SDPA's math kernel, the plain matmul kernel eager or
compiled). A step cannot be faster than the sum of those times (elementwise work, norms, RoPE,
the loss, the optimizer and framework overhead only add to it), so model FLOPs / that sum, over
the matmul peak measured in that dtype, bounds the achievable MFU.

In the same run, the trainer's own step (engine and step function, bf16 autocast or fp32, AdamW,
as `python -m trainer` runs it) is timed eager with `model.attention.backend` auto and sdpa, and
with `trainer.compile=true`: its ratio to the bound is what the framework adds. transformers'
eager `LlamaForCausalLM` step on the same model (bench/train_throughput.py's) takes its turns
with them, under the same allocator setting (glibc keeping freed blocks, which helps its step
too): its ratio to the bound is the most any implementation could gain over it on this machine.
This machine's speed drifts by 10-25% within minutes, so the bound and the steps are measured in
--rounds rounds: the four steps taking turns between two measurements of the bound, each step
against the mean of the bound just before and just after it, and the median and range of the
rounds are reported. This brackets the steps as closely as the bound's own length allows (about
5 s each side); it narrows the machine's drift, it does not cancel it. Then, closer still, the
compiled step takes turns with a quick pass over the same bound (quick_bound, about a second)
for --pairs pairs, each ratio within its pair.

    python bench/mfu_ceiling.py [--batch 16] [--seq-len 256] [--rounds 5] [--pairs 30]
        [--precision auto|bf16|fp32]
Writes bench/results/mfu_ceiling_cpu_<batch>x<seq_len>[_fp32].json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.attention_kernels import KERNELS, kernel_seconds
from bench.machine import machine
from bench.train_throughput import build as build_throughput_step
from data.loader import Batch
from model.accounting import training_flops_per_token
from model.presets import load_preset
from model.transformer import build_model
from optim.config import OptimConfig
from parallel.config import ParallelConfig
from parallel.mesh import ParallelDims
from parallel.precision import compute_dtype, resolve_precision
from trainer.build import build_training_engine
from trainer.config import TrainerConfig
from trainer.cpu_malloc import keep_freed_memory
from trainer.hooks import start_hooks
from trainer.mfu import measure_matmul_peak
from trainer.step import LossTracker, StepSettings, train_step


def median_seconds(fn: Callable[[], object], repeats: int = 7) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each callable, timed in turns (a, b, c, a, b, c, ...) after one
    untimed turn, so that a drift of the machine's speed falls on all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for turn in range(repeats + 1):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if turn:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def linear_seconds(tokens: int, d_in: int, d_out: int, dtype: torch.dtype) -> float:
    """Forward + both backward GEMMs of y = x W^T with x (tokens, d_in), W (d_out, d_in)."""
    x = torch.randn(tokens, d_in, dtype=dtype)
    w = torch.randn(d_out, d_in, dtype=dtype)
    dy = torch.randn(tokens, d_out, dtype=dtype)
    forward = median_seconds(lambda: x @ w.t())
    grad_input = median_seconds(lambda: dy @ w)
    grad_weight = median_seconds(lambda: dy.t() @ x)
    return forward + grad_input + grad_weight


STEP_CONFIGS = {  # name -> (attention backend, compile); None: transformers' eager step
    "auto": ("auto", False),
    "sdpa": ("sdpa", False),
    "auto_compiled": ("auto", True),
    "transformers": None,
}


def trainer_step(
    batch: int, seq_len: int, precision: str, backend: str, compile: bool
) -> Callable[[], object]:
    """One training step of the trainer's own engine on the tiny preset (bf16 autocast or fp32,
    AdamW, gradient clipping), as a callable; compiled engines compile on their first call."""
    cfg = load_preset("tiny", {"attention.backend": backend})
    tcfg = TrainerConfig(batch_size=batch, compile=compile, precision=precision)
    dims = ParallelDims.resolve(ParallelConfig(), 1)
    engine = build_training_engine(
        cfg, tcfg, ParallelConfig(), OptimConfig(), dims, torch.device("cpu"), 0
    )
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1))
    data = Batch(tokens[:, :-1], tokens[:, 1:], torch.zeros_like(tokens[:, 1:]))
    tracker, settings = LossTracker(0.0), StepSettings(grad_clip=1.0)
    hooks = start_hooks(engine, 0.0, None)
    return lambda: train_step(engine, data, settings, tracker, hooks)


def step_callable(args: argparse.Namespace, how: tuple[str, bool] | None) -> Callable[[], object]:
    """The trainer's step for a STEP_CONFIGS entry, or transformers' eager step (None)."""
    if how is not None:
        return trainer_step(args.batch, args.seq_len, args.precision, *how)
    step = build_throughput_step("transformers", args.precision)
    x, y = (
        torch.randint(0, load_preset("tiny").vocab_size, (args.batch, args.seq_len)) for _ in "xy"
    )
    return lambda: step(x, y)


def layer_shapes(cfg) -> list[tuple[int, int]]:
    """(d_in, d_out) of every projection of one layer: q, k, v, o, gate, up, down."""
    C, H, K, D = cfg.d_model, cfg.attention.n_heads, cfg.n_kv_heads, cfg.head_dim
    shapes = [(C, H * D), (C, K * D), (C, K * D), (H * D, C)]
    return [*shapes, (C, cfg.ffn_hidden), (C, cfg.ffn_hidden), (cfg.ffn_hidden, C)]


def head_chunks(tokens: int, chunk: int) -> dict[int, int]:
    """{rows: how many chunks of that many rows} as model.loss.chunked_loss splits the head
    (chunk 0 or at least `tokens`: one chunk; a shorter last chunk)."""
    step = chunk if 0 < chunk < tokens else tokens
    sizes = [min(step, tokens - start) for start in range(0, tokens, step)]
    return {rows: sizes.count(rows) for rows in sorted(set(sizes))}


def bound_seconds(args: argparse.Namespace) -> dict:
    """The lower bound's parts: every projection and head GEMM alone, attention's kernels."""
    cfg = load_preset("tiny")
    tokens = args.batch * args.seq_len
    C, H, K, D = cfg.d_model, cfg.attention.n_heads, cfg.n_kv_heads, cfg.head_dim
    dtype = compute_dtype(args.precision)
    per_layer = sum(linear_seconds(tokens, d_in, d_out, dtype) for d_in, d_out in layer_shapes(cfg))
    head = sum(
        count * linear_seconds(rows, C, cfg.vocab_size, dtype)
        for rows, count in head_chunks(tokens, cfg.loss_chunk_tokens).items()
    )
    kernels = kernel_seconds((args.batch, H, K, args.seq_len, D), dtype)
    fastest = min(kernels, key=kernels.get)
    seconds = {
        "projection_gemms_all_layers": cfg.n_layers * per_layer,
        "head_gemms": head,
        "attention_all_layers": cfg.n_layers * kernels[fastest],
    }
    seconds["lower_bound_step"] = sum(seconds.values())
    return {"seconds": seconds, "attention_kernel_seconds_per_layer": kernels, "fastest": fastest}


def quick_bound(args: argparse.Namespace, attention: str) -> Callable[[], float]:
    """The bound in one pass of about a second, to take turns with a step: every GEMM of
    bound_seconds and the `attention` kernel (fwd + bwd), each the faster of two calls right
    after an untimed one on the same operands (hot caches, as bound_seconds times them), times
    its count in the step. Taking turns with bound_seconds (4 rounds of 1 and 4): 243-286 ms
    (median 267) against 262-267 ms at 8 x 256, the same bound measured in a fifth of the time."""
    cfg = load_preset("tiny")
    tokens, L, dtype = args.batch * args.seq_len, cfg.n_layers, compute_dtype(args.precision)
    C, H, K, D = cfg.d_model, cfg.attention.n_heads, cfg.n_kv_heads, cfg.head_dim
    shapes = [(L, tokens, d_in, d_out) for d_in, d_out in layer_shapes(cfg)]
    shapes += [
        (n, rows, C, cfg.vocab_size)
        for rows, n in head_chunks(tokens, cfg.loss_chunk_tokens).items()
    ]
    jobs: list[tuple[int, Callable[[], object]]] = []  # (count in the step, call)
    for count, rows, d_in, d_out in shapes:
        x, w = torch.randn(rows, d_in, dtype=dtype), torch.randn(d_out, d_in, dtype=dtype)
        dy = torch.randn(rows, d_out, dtype=dtype)
        jobs += [(count, lambda x=x, w=w: x @ w.t()), (count, lambda dy=dy, w=w: dy @ w)]
        jobs.append((count, lambda dy=dy, x=x: dy.t() @ x))
    q = torch.randn(args.batch, H, args.seq_len, D, dtype=dtype, requires_grad=True)
    k, v = (
        torch.randn(args.batch, K, args.seq_len, D, dtype=dtype, requires_grad=True) for _ in "kv"
    )
    grad, kernel = torch.randn_like(q), KERNELS[attention]
    jobs.append((L, lambda: kernel(q, k, v).backward(grad)))

    def measure() -> float:
        total = 0.0
        for count, call in jobs:
            call()
            times = []
            for _ in range(2):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            total += count * min(times)
        return total

    return measure


def paired_ratios(bound: Callable[[], float], step: Callable[[], object], pairs: int) -> dict:
    """The step and the quick bound taking turns (the order swapped every pair, after two
    untimed pairs): each pair's ratio within about a second of the machine's drift."""
    ratios, bounds, steps = [], [], []
    for index in range(pairs + 2):
        if index % 2:
            limit = bound()
        start = time.perf_counter()
        step()
        elapsed = time.perf_counter() - start
        if not index % 2:
            limit = bound()
        if index >= 2:
            ratios.append(elapsed / limit)
            bounds.append(limit)
            steps.append(elapsed)
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    return {"pairs": pairs, "step_over_bound": {"median": median, "quartiles": [q1, q3],
            "min": min(ratios), "max": max(ratios)},
            "bound_seconds_median": statistics.median(bounds),
            "step_seconds_median": statistics.median(steps)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5, help="bound + steps measured this often")
    parser.add_argument("--pairs", type=int, default=30, help="compiled step / quick bound pairs")
    parser.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp32"))
    args = parser.parse_args()
    if args.rounds < 1 or args.pairs < 2:
        parser.error(f"--rounds {args.rounds} --pairs {args.pairs}: need rounds >= 1, pairs >= 2")
    args.precision = resolve_precision(args.precision, torch.device("cpu"))
    keep_freed_memory()  # as python -m trainer runs on CPU (trainer.cpu_malloc=keep)
    cfg = load_preset("tiny")
    model = build_model(cfg, device="meta")
    flops = training_flops_per_token(model, args.seq_len).total * args.batch * args.seq_len
    peak = measure_matmul_peak(torch.device("cpu"), compute_dtype(args.precision), seconds=2.0)
    steps = {name: step_callable(args, how) for name, how in STEP_CONFIGS.items()}
    for step in steps.values():
        step()  # compiles the compiled engine (cached on disk after the first run)
    rounds = []
    before = bound_seconds(args)
    for index in range(args.rounds):  # the machine drifts: each round's ratios are its own
        times = interleaved_medians(steps, repeats=7)
        after = bound_seconds(args)  # (also the next round's bound before)
        limits = [b["seconds"]["lower_bound_step"] for b in (before, after)]
        limit = sum(limits) / 2  # the steps against the bound just before and just after them
        bound = min(before, after, key=lambda b: b["seconds"]["lower_bound_step"])  # its parts
        rounds.append(bound | {"bound_before_and_after_seconds": limits,
                               "trainer_step_seconds": times,
                               "trainer_step_over_bound": {n: t / limit for n, t in times.items()}})  # fmt: skip
        ratios = ", ".join(f"{n} {t * 1e3:.1f} ms = {t / limit:.2f}x" for n, t in times.items())
        print(f"round {index}: bound {limits[0] * 1e3:.1f} / {limits[1] * 1e3:.1f} ms; {ratios}")
        before = after
    fastest = statistics.mode(r["fastest"] for r in rounds)
    quick = quick_bound(args, fastest)
    paired = paired_ratios(quick, steps["auto_compiled"], args.pairs)
    paired_hf = paired_ratios(quick, steps["transformers"], args.pairs)
    over = {n: [r["trainer_step_over_bound"][n] for r in rounds] for n in STEP_CONFIGS}
    last = rounds[-1]
    gemms = [
        r["seconds"]["projection_gemms_all_layers"] + r["seconds"]["head_gemms"] for r in rounds
    ]
    bounds = [r["seconds"]["lower_bound_step"] for r in rounds]
    report = {
        "benchmark": "mfu_ceiling",
        "args": vars(args),
        "machine": machine(torch_threads=torch.get_num_threads()),
        "precision": args.precision,
        "matmul_peak_flops": peak,  # in the precision's compute dtype
        "step_flops": flops,
        "rounds": rounds,
        "trainer_step_over_bound": {
            n: {"median": statistics.median(v), "min": min(v), "max": max(v)}
            for n, v in over.items()
        },
        "compiled_step_paired_with_quick_bound": paired | {"attention_kernel": fastest},
        # transformers' step over the bound: the largest speedup over it that any step could have
        "transformers_step_paired_with_quick_bound": paired_hf | {"attention_kernel": fastest},
        # medians over the rounds, against the peak measured once before them
        "mfu_ceiling_gemms_only": statistics.median(flops / t / peak for t in gemms),
        "mfu_ceiling_gemms_and_attention": statistics.median(flops / t / peak for t in bounds),
    }
    for key, value in last["seconds"].items():
        print(f"{key:32s} {value * 1e3:8.1f} ms (last round)")
    kernels = last["attention_kernel_seconds_per_layer"]
    print(f"attention per layer: { {k: round(v * 1e3, 1) for k, v in kernels.items()} } ms")
    for name, stats in report["trainer_step_over_bound"].items():
        print(f"trainer step ({name}) over the bound: median {stats['median']:.2f}x "
              f"({stats['min']:.2f}-{stats['max']:.2f}x over {args.rounds} rounds)")  # fmt: skip
    ratio = paired["step_over_bound"]
    print(f"compiled step over the quick bound, {args.pairs} pairs: median {ratio['median']:.2f}x "
          f"(quartiles {ratio['quartiles'][0]:.2f}-{ratio['quartiles'][1]:.2f}x; bound "
          f"{paired['bound_seconds_median'] * 1e3:.1f} ms, step {paired['step_seconds_median'] * 1e3:.1f} ms)")  # fmt: skip
    ratio = paired_hf["step_over_bound"]
    print(f"transformers' eager step over the quick bound, {args.pairs} pairs: median "
          f"{ratio['median']:.2f}x (quartiles {ratio['quartiles'][0]:.2f}-"
          f"{ratio['quartiles'][1]:.2f}x): no step can be faster than that over it here")  # fmt: skip
    print(f"{args.precision} matmul peak {peak / 1e12:.3f} TFLOP/s; step {flops / 1e9:.1f} GFLOP")
    print(f"MFU ceiling, GEMMs alone:            {100 * report['mfu_ceiling_gemms_only']:.1f}%")
    print(f"MFU ceiling, GEMMs + attention: {100 * report['mfu_ceiling_gemms_and_attention']:.1f}%")
    suffix = "_fp32" if args.precision == "fp32" else ""
    name = f"mfu_ceiling_cpu_{args.batch}x{args.seq_len}{suffix}.json"
    out = Path(__file__).parent / "results" / name
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
