"""Peak memory and time of the chunked head + cross-entropy vs computing all logits at once.

Each variant runs forward + backward of the output head and loss on (N, C) hidden states with a
vocabulary of V, in a fresh subprocess (CPU: peak RSS growth; CUDA: max allocated), so the
unchunked baseline is measured in the same run on the same machine. It also times, on one fp32
chunk of logits, the two ways of getting the loss's normalizer and the softmax: logsumexp then a
second exp (`two_pass`, the formula before issue 21) and one softmax whose largest entry gives
logsumexp (`one_softmax`, model/loss.py), interleaved, at the tiny default model's chunk
(512 x 8192) and at this run's vocabulary.

    python bench/chunked_ce.py [--tokens 8192] [--d-model 1024] [--vocab 128256] [--device cpu]
Writes bench/results/chunked_ce_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model.loss import chunked_cross_entropy, normalizer_and_softmax
from trainer.cpu_malloc import keep_freed_memory


def two_pass(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula before issue 21: logsumexp, then exp(logits - lse) in place."""
    lse = torch.logsumexp(logits, dim=-1)
    return lse, logits.sub_(lse[:, None]).exp_()


def time_formulas(rows: int, vocab: int, repeats: int = 15) -> dict:
    """Median ms of each formula on a (rows, vocab) fp32 chunk, interleaved, and their loss gap."""
    torch.manual_seed(0)
    logits = torch.randn(rows, vocab) * 3
    formulas = {"two_pass": two_pass, "one_softmax": normalizer_and_softmax}
    times: dict[str, list[float]] = {name: [] for name in formulas}
    for _ in range(repeats):
        for name, formula in formulas.items():
            chunk = logits.clone()  # two_pass works in place
            start = time.perf_counter()
            formula(chunk)
            times[name].append(time.perf_counter() - start)
    gap = (two_pass(logits.clone())[0] - normalizer_and_softmax(logits)[0]).abs().max()
    row = {f"{name}_ms": 1000 * sorted(t)[repeats // 2] for name, t in times.items()}
    return row | {"rows": rows, "vocab": vocab, "max_logsumexp_difference": float(gap),
                  "speedup": row["two_pass_ms"] / row["one_softmax_ms"]}  # fmt: skip


def measure(tokens: int, d_model: int, vocab: int, chunk: int, device: str, repeats: int) -> dict:
    """Run in the child process: returns peak extra memory (bytes) and mean seconds per step."""
    torch.manual_seed(0)
    dtype = torch.bfloat16
    h = torch.randn(tokens, d_model, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(vocab, d_model, device=device, dtype=dtype) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for _ in range(repeats + 1):  # the first step warms up
        sync()
        start = time.perf_counter()
        chunked_cross_entropy(h, w, targets, chunk).backward()
        sync()
        times.append(time.perf_counter() - start)
        h.grad = w.grad = None
    peak = (
        torch.cuda.max_memory_allocated()
        if device == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {
        "chunk_tokens": chunk,
        "peak_extra_bytes": peak - base,
        "seconds_per_step": sum(times[1:]) / repeats,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--chunks", default="0,4096,1024")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(
            json.dumps(
                measure(
                    args.tokens, args.d_model, args.vocab, args.child, args.device, args.repeats
                )
            )
        )
        return
    keep_freed_memory()  # as the trainer runs on CPU
    formulas = [time_formulas(512, 8192), time_formulas(1024, args.vocab)]
    for f in formulas:
        print(
            f"normalizer + softmax of ({f['rows']}, {f['vocab']}) fp32: two_pass "
            f"{f['two_pass_ms']:.1f} ms, one_softmax {f['one_softmax_ms']:.1f} ms "
            f"({f['speedup']:.2f}x); logsumexp differs by {f['max_logsumexp_difference']:.1e}"
        )
    rows = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        cmd = [
            sys.executable,
            __file__,
            "--child",
            str(chunk),
            "--tokens",
            str(args.tokens),
            "--d-model",
            str(args.d_model),
            "--vocab",
            str(args.vocab),
            "--device",
            args.device,
            "--repeats",
            str(args.repeats),
        ]
        rows.append(
            json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        )
    baseline = rows[0]
    print(
        f"N={args.tokens} C={args.d_model} V={args.vocab} bf16 on {args.device}; logits alone are "
        f"{args.tokens * args.vocab * 4 / 2**30:.2f} GiB in fp32"
    )
    print(f"{'chunk':>8} {'peak extra':>12} {'vs full':>8} {'s/step':>8} {'vs full':>8}")
    for row in rows:
        row["memory_vs_full"] = row["peak_extra_bytes"] / baseline["peak_extra_bytes"]
        row["time_vs_full"] = row["seconds_per_step"] / baseline["seconds_per_step"]
        label = row["chunk_tokens"] or "full"
        print(
            f"{label:>8} {row['peak_extra_bytes'] / 2**30:>10.2f}Gi {row['memory_vs_full']:>8.2f} "
            f"{row['seconds_per_step']:>8.2f} {row['time_vs_full']:>8.2f}"
        )
    machine = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
    }
    out = Path(__file__).parent / "results" / f"chunked_ce_{args.device}.json"
    out.write_text(
        json.dumps(
            {"machine": machine, "args": vars(args), "rows": rows, "formulas": formulas},
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
