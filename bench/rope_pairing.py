"""RoPE's half pairing on the tiny default model's queries and keys (8 x 256 tokens, 4 query and
2 kv heads of 64, bf16), forward + backward, eager and compiled (Inductor, the trainer's CPU
options), in three forms that give bitwise the same numbers (checked here and in
tests/model/test_rope.py):
  * per_half: x1 cos - x2 sin, x2 cos + x1 sin, concatenated (before issue 21);
  * whole_head_cat: x cos + (-x2, x1) sin over whole heads, (x2, x1) and cos, sin concatenated
    (issue 21's first eager change);
  * paired_halves: each head viewed as its two halves, x cos + swap(x) (-sin, sin), cos and sin
    made contiguous first (model/mixers/rope.py's apply_rope_half now).
Interleaved in one process, each timing the median of 15 rounds of 5 calls. Then the default
training step (the trainer's engine and train_step, tiny preset, 8 x 256, bf16) with the
paired-halves form and with whole_head_cat patched in: two engines in one process taking turns,
compiled (40 pairs) and eager (30 pairs).

    python bench/rope_pairing.py
Writes bench/results/rope_pairing_cpu.json.
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.engines import tiny_cpu_engine
from bench.machine import machine
from data.loader import Batch
from model.mixers.rope import apply_rope_half, base_inv_freq, cos_sin, rope_rotations
from parallel.activation import CPU_INDUCTOR_OPTIONS
from trainer.cpu_malloc import keep_freed_memory
from trainer.hooks import start_hooks
from trainer.step import LossTracker, StepSettings, train_step


def per_half(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """The formula before issue 21: each half rotated separately, then concatenated."""
    r = 2 * rot.shape[-1]
    cos, sin = cos_sin(rot)
    x1, x2 = x[..., : r // 2].float(), x[..., r // 2 : r].float()
    a, b = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return torch.cat([a.to(x.dtype), b.to(x.dtype), x[..., r:]], dim=-1)


def whole_head_cat(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Issue 21's first form: whole heads, with (x2, x1) and the cos, sin rows concatenated."""
    r = 2 * rot.shape[-1]
    cos, sin = cos_sin(rot)  # (B, T, 1, R/2) each
    cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)  # (B, T, 1, R)
    part = x[..., :r].float()
    swapped = torch.cat([part[..., r // 2 :], part[..., : r // 2]], dim=-1)  # (x2, x1)
    out = (part * cos + swapped * sin).to(x.dtype)
    return out if r == x.shape[-1] else torch.cat([out, x[..., r:]], dim=-1)


FORMS = {"per_half": per_half, "whole_head_cat": whole_head_cat, "paired_halves": apply_rope_half}


def forward_backward(fn, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = x.clone().requires_grad_()
    out = fn(leaf)
    out.backward(grad)
    return out.detach(), leaf.grad


def kernel_rows(B: int, T: int, D: int) -> list[dict]:
    """Each form on queries (4 heads) and keys (2 heads) alone: ms per forward + backward."""
    rot = rope_rotations(torch.arange(T).expand(B, T), base_inv_freq(10000.0, D), 1.0)
    fns = {}
    for name, form in FORMS.items():
        fns[f"{name}_eager"] = functools.partial(form, rot=rot)
        fns[f"{name}_compiled"] = torch.compile(  # one static graph per head count, as in a block
            functools.partial(form, rot=rot), options=CPU_INDUCTOR_OPTIONS, dynamic=False
        )
    rows = []
    for heads in (4, 2):  # queries, keys
        gen = torch.Generator().manual_seed(heads)
        x = torch.randn(B, T, heads, D, generator=gen).bfloat16()
        grad = torch.randn(B, T, heads, D, generator=gen).bfloat16()
        results = {name: forward_backward(fn, x, grad) for name, fn in fns.items()}  # + compile
        reference = results["per_half_eager"]
        equal = all(torch.equal(a, b) for r in results.values() for a, b in zip(r, reference))
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(15):
            for name, fn in fns.items():
                start = time.perf_counter()
                for _ in range(5):
                    forward_backward(fn, x, grad)
                times[name].append((time.perf_counter() - start) / 5)
        ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
        rows.append({"heads": heads, "ms": ms, "bitwise_equal": equal})
        print(f"{heads} heads, bitwise equal {equal}: "
              + ", ".join(f"{name} {t:.3f} ms" for name, t in ms.items()))  # fmt: skip
    return rows


def default_engine(compiled: bool, rope_form=None):
    """The trainer's engine for the tiny preset (bf16 autocast, AdamW); rope_form, if given,
    replaces every attention layer's RoPE function."""
    engine = tiny_cpu_engine("bf16", compile=compiled)
    if rope_form is not None:
        for module in engine.model.modules():
            if getattr(module, "apply_rope", None) is not None:
                module.apply_rope = rope_form
    return engine


def step_ab(compiled: bool, pairs: int, B: int, T: int) -> dict:
    """The default training step (8 x 256, clip 1.0) with model/mixers/rope.py's form and with
    whole_head_cat in its place: two engines in one process, one step each in turn (the order
    swapped every pair, after 3 untimed steps each); medians and the median ratio of the pairs."""
    engines = {
        "paired_halves": default_engine(compiled),
        "whole_head_cat": default_engine(compiled, whole_head_cat),
    }
    x = torch.randint(0, 8192, (B, T))
    batch = Batch(x, torch.roll(x, -1, 1), torch.zeros_like(x, dtype=torch.int32))
    settings = StepSettings(grad_clip=1.0)
    hooks = {name: start_hooks(engine, 0.0, None) for name, engine in engines.items()}
    times: dict[str, list[float]] = {name: [] for name in engines}
    for i in range(3 + pairs):
        order = list(engines.items()) if i % 2 == 0 else list(engines.items())[::-1]
        for name, engine in order:
            start = time.perf_counter()
            train_step(engine, batch, settings, LossTracker(0.0), hooks[name])
            if i >= 3:
                times[name].append(time.perf_counter() - start)
    ratios = [o / n for o, n in zip(times["whole_head_cat"], times["paired_halves"])]
    row = {
        "compiled": compiled,
        "pairs": pairs,
        "median_ms": {name: 1000 * statistics.median(t) for name, t in times.items()},
        "whole_head_cat_over_paired_halves": statistics.median(ratios),
    }
    print(json.dumps(row))
    return row


def main() -> None:
    keep_freed_memory()  # as the trainer runs on CPU
    B, T, D = 8, 256, 64
    rows = kernel_rows(B, T, D)
    steps = [step_ab(True, 40, B, T), step_ab(False, 30, B, T)]
    report = {
        "benchmark": "rope_pairing",
        "machine": machine(torch_threads=torch.get_num_threads()),
        "shape": {"batch": B, "seq_len": T, "head_dim": D, "dtype": "bfloat16"},
        "rows": rows,
        "default_step": steps,
    }
    out = ROOT / "bench" / "results" / "rope_pairing_cpu.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
