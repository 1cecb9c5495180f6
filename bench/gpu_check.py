"""The prepared checks a GPU session runs once: a list of named checks, each a function that
returns a dict (its numbers, or why it was skipped), run one by one with any error recorded, all
saved in one JSON file with the machine description.

Checks (in this order, sharing one time budget):
  flash_attention  the Triton FlashAttention kernel checked (outputs, gradients, max logits;
      documents, MLA dims) and timed against SDPA (cuDNN, FlashAttention-2) and FlexAttention
      (bench/gpu_attention.py)
  train_mfu  MFU of a ~1B dense and a MoE model through the trainer's step (compiled blocks),
      the step's split, the profiler's top kernels; MuonClip with the kernel's max logits vs
      SDPA + recomputation; trainer.precision=float8 (tensorwise, rowwise, mxfp8 where the GPU
      has it) against bf16: tokens/s and the losses of the same steps (bench/gpu_train.py)
  fused_kernels  RMSNorm (+ add), RoPE (both pairings), SwiGLU kernels vs torch eager and
      torch.compile (bench/gpu_kernels.py)
  fused_cross_entropy_memory  the head + cross-entropy at vocab 128k: logits materialized vs
      chunked (model/loss.py) vs liger-kernel (bench/gpu_kernels.py)
  delta_rule_fla_vs_torch  the gated delta rule on fla-core's Triton kernels (model/mixers/fla_ops.py)
      vs our torch chunked form (model/mixers/delta_rule.py): Gated DeltaNet (B 2, T 4096, 16 value
      heads, Dk = Dv = 128, per-head decay) and KDA (16 heads of 128, per-channel decay); forward
      and forward + backward time and peak memory, the max abs difference of outputs, final
      states and gradients (fp32 and bf16 inputs; an fp64 torch reference for fp32), packed
      documents with initial states (fla's varlen path), one decoded token, and the layers with
      kernel=fla vs kernel=torch. Skipped, with the reason, without CUDA or fla-core; where
      fla's gated backward is wrong (Hopper with triton 3.4-3.7.0, model/mixers/fla_ops.py), its
      forward and decoding only.
  engram_offload  Engram tables of 1e7 rows on the GPU vs in pinned host memory (the rows a step
      reads copied over): step times after a same-loss check, and the copy of one step's rows
      alone (bench/gpu_engram.py).

    python bench/gpu_check.py [--out PATH] [--only NAME ...] [--train-cases NAME ...]
                              [--budget-s 420] [--list] [--dry-run]
On CUDA writes bench/results/gpu_check.json (or --out); on CPU prints only, unless --out is given.
--dry-run runs the issue-18 checks' code on CPU on tiny shapes (no numbers worth keeping).
Exits 0 unless --strict and a check raised.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

if "--dry-run" in sys.argv:  # the interpreter must be on before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.machine import machine
from model.mixers.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from model.mixers.fla_ops import fla_available, fla_gated_delta_rule
from model.mixers.gdn import l2_normalize

DEFAULT_OUT = ROOT / "bench" / "results" / "gpu_check.json"
Check = Callable[["Budget"], dict]
CHECKS: dict[str, Check] = {}


def check(name: str) -> Callable[[Check], Check]:
    """Registers a check under `name` (run in registration order)."""

    def register(fn: Check) -> Check:
        CHECKS[name] = fn
        return fn

    return register


class Budget:
    """The wall-clock time left to the whole run: checks skip their optional parts when it runs
    out, so one slow compile does not cost the session its device time."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def allows(self, seconds: float) -> bool:
        return self.left() > seconds


def cuda_skip_reason(need_fla: bool = False) -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA (torch.cuda.is_available() is False)"
    if need_fla and not fla_available():
        return "fla-core is not installed (pip install lmforge[fla])"
    return None


def sub_case(results: dict, name: str, fn: Callable[[], dict], budget: Budget, need_s: float):
    """results[name] = fn(), or why not (time budget, an error); a CUDA OOM frees the cache."""
    if not budget.allows(need_s):
        results[name] = {"skipped": f"time budget: {budget.left():.0f} s left, needs ~{need_s} s"}
        return
    start = time.monotonic()
    try:
        results[name] = fn()
    except Exception as error:  # recorded: the other sub-cases still run
        results[name] = {"error": f"{type(error).__name__}: {error}"[:2000]}
        traceback.print_exc()
    finally:
        torch.cuda.empty_cache()
    results[name]["seconds"] = round(time.monotonic() - start, 2)
    print(f"  {name}: {json.dumps(results[name])[:400]}", flush=True)


# ---- issue 18: attention kernel, training-step MFU, fused kernels ----------------------------

DRY_RUN = False  # --dry-run: the code paths of the checks below on CPU, on tiny shapes


def device_or_reason() -> tuple[str, str | None]:
    """("cuda", None), ("cpu", None) in a dry run, or why the check cannot run."""
    if DRY_RUN:
        return "cpu", None
    return "cuda", cuda_skip_reason()


def runner(budget: Budget) -> Callable:
    """sub_case bound to the run's budget: (results, name, fn, need_s)."""
    return lambda results, name, fn, need_s: sub_case(results, name, fn, budget, need_s)


@check("flash_attention")
def flash_attention(budget: Budget) -> dict:
    device, reason = device_or_reason()
    if reason:
        return {"skipped": reason}
    from bench.gpu_attention import check_cases, timing_cases

    run = runner(budget)
    return {
        "checks": check_cases(DRY_RUN, device, run),
        "timing": timing_cases(DRY_RUN, device, timed, run),
    }


@check("train_mfu")
def train_mfu(budget: Budget) -> dict:
    device, reason = device_or_reason()
    if reason:
        return {"skipped": reason}
    run, dev, results = runner(budget), torch.device(device), {}
    cases = train_cases(dev, not DRY_RUN)  # compiled blocks: trainer.compile=true (slow on CPU)
    for name in TRAIN_CASES or DEFAULT_TRAIN_CASES:
        run(results, name, *cases[name])
    results.update(train_comparisons(results))
    return results


def train_cases(dev: torch.device, compile_blocks: bool) -> dict[str, tuple[Callable, float]]:
    """train_mfu's sub-cases: name -> (what it runs, seconds it needs on an H100/H200)."""
    from bench.gpu_train import train_case

    def case(model: str, **kwargs) -> Callable[[], dict]:
        return lambda: train_case(model, DRY_RUN, dev, sync, compile_blocks, **kwargs)

    cases = {
        "dense_1b": (case("dense_1b", profile=True), 60),
        "moe": (case("moe", profile=True), 60),
        "moe_fine": (case("moe_fine", profile=True), 90),
        # the MoE step without compiled blocks: a number even where compilation fails
        "moe_eager": (lambda: train_case("moe", DRY_RUN, dev, sync, False, profile=True), 60),
        "hybrid_1b_fla": (fla_train_case(dev, compile_blocks), 120),
    }
    for model in ("hybrid_1b", "attnres_1b", "mhc_1b", "engram_1b", "dense_1b_32k"):
        cases[model] = (case(model, profile=True), 90)
    for name, recipe in FLOAT8_CASES.items():  # against dense_1b / moe of the same run
        model = name.split("_float8_")[0]
        cases[name] = (float8_case(model, recipe, dev, compile_blocks), 90)
    for backend in ("triton", "sdpa"):
        extra = {"attention.backend": backend}
        cases[f"dense_1b_muonclip_{backend}"] = (case("dense_1b", extra=extra), 60)
    return cases


def fla_train_case(dev: torch.device, compile_blocks: bool) -> Callable[[], dict]:
    """The hybrid on fla-core's kernels, or why this machine cannot train on them."""

    def run_case() -> dict:
        from bench.gpu_train import train_case
        from model.mixers.fla_ops import training_blocker

        if not fla_available():
            return {"skipped": "fla-core is not installed (pip install lmforge[fla])"}
        if dev.type != "cuda":
            return {"skipped": "fla-core's kernels need CUDA"}
        blocker = training_blocker(dev.index)
        if blocker:
            return {"skipped": blocker}
        return train_case("hybrid_1b_fla", DRY_RUN, dev, sync, compile_blocks, profile=True)

    return run_case


# the 2026 layers and long context against the plain model of the same run (issue 60's targets:
# step time within 1.15x, mHC 1.3x; T 32k >= 40% MFU, the same model at T 4096 >= 50%)
STEP_TARGETS = {"hybrid_1b": 1.15, "hybrid_1b_fla": 1.15, "attnres_1b": 1.15,
                "engram_1b": 1.15, "mhc_1b": 1.3}  # fmt: skip


def train_comparisons(results: dict) -> dict:
    """Each case against its baseline in `results` (the same session): float8's speed-up and
    loss gap over bf16, the 2026 layers' step time over dense_1b's; {} where one is missing."""
    out: dict = {}
    for name in FLOAT8_CASES:
        base, got = results.get(name.split("_float8_")[0], {}), results.get(name, {})
        if "tokens_per_s" in base and "tokens_per_s" in got:
            gaps = [abs(a - b) for a, b in zip(got["losses"], base["losses"])]
            out[name] = {
                "speedup_vs_bf16": round(got["tokens_per_s"] / base["tokens_per_s"], 3),
                "max_loss_gap_vs_bf16": round(max(gaps), 4) if gaps else None,
            }
    base = results.get("dense_1b", {})
    for name, target in STEP_TARGETS.items():
        got = results.get(name, {})
        if "step_s" in base and "step_s" in got:
            ratio = got["step_s"] / base["step_s"]
            out[name] = {"step_time_vs_dense_1b": round(ratio, 3), "target": target,
                         "met": ratio <= target}  # fmt: skip
    return {"comparisons": out} if out else {}


# trainer.precision=float8 sub-cases (issue 59), in the order they run after dense_1b and moe
FLOAT8_CASES = {
    "dense_1b_float8_tensorwise": "tensorwise",
    "moe_float8_rowwise": "rowwise",
    "dense_1b_float8_rowwise": "rowwise",
    "dense_1b_float8_mxfp8": "mxfp8",
}


def float8_case(model: str, recipe: str, dev: torch.device, compile_blocks: bool) -> Callable:
    """A float8 training sub-case, or why this GPU cannot run the recipe."""
    from bench.gpu_train import train_case

    def run_case() -> dict:
        from model.errors import ConfigError
        from parallel.float8 import check_float8_device, require_torchao

        try:
            require_torchao()
            check_float8_device(recipe, dev)
        except ConfigError as error:  # its one line: why this GPU cannot run the recipe
            return {"skipped": str(error)}
        return train_case(model, DRY_RUN, dev, sync, compile_blocks, profile=True, float8=recipe)

    return run_case


TRAIN_CASES: list[str] | None = None  # --train-cases: these sub-cases of train_mfu, in order
TRAIN_CASE_NAMES = ["dense_1b", "moe", "moe_fine", "moe_eager", "hybrid_1b", "hybrid_1b_fla"]
TRAIN_CASE_NAMES += ["attnres_1b", "mhc_1b", "engram_1b", "dense_1b_32k", *FLOAT8_CASES]
TRAIN_CASE_NAMES += ["dense_1b_muonclip_triton", "dense_1b_muonclip_sdpa"]
DEFAULT_TRAIN_CASES = [name for name in TRAIN_CASE_NAMES if name != "moe_eager"]


@check("fused_kernels")
def fused_kernels(budget: Budget) -> dict:
    device, reason = device_or_reason()
    if reason:
        return {"skipped": reason}
    from bench.gpu_kernels import fused_kernels as measure

    return measure(DRY_RUN, device, timed, runner(budget))


@check("fused_cross_entropy_memory")
def fused_cross_entropy_memory(budget: Budget) -> dict:
    device, reason = device_or_reason()
    if reason:
        return {"skipped": reason}
    from bench.gpu_kernels import cross_entropy_memory

    return cross_entropy_memory(DRY_RUN, device, timed, runner(budget))


# ---- delta_rule_fla_vs_torch ----------------------------------------------------------------

DEVICE = "cuda"  # a dry run of the code paths may set "cpu" (with a stand-in for fla)
B, T, H, D = 2, 4096, 16, 128  # the rule's benchmark shape
LAYER_T, LAYER_HEADS = 1024, 8  # tokens and value heads (of D) of the layer comparison


def delta_inputs(per_channel: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 inputs as the layers prepare them: q, k L2-normalized (q x D^-1/2), decays like
    -exp(A_log) softplus(a + dt_bias) (rates 1..16 as KDA, time steps around 0.01), beta in (0, 1)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    kw = dict(device=DEVICE, generator=gen)
    q = l2_normalize(torch.randn(B, H, T, D, **kw)) * D**-0.5
    k = l2_normalize(torch.randn(B, H, T, D, **kw))
    v = torch.randn(B, H, T, D, **kw)
    shape = (B, H, T, D) if per_channel else (B, H, T)
    rate = 1.0 + 15.0 * torch.rand(H, 1, *((1,) if per_channel else ()), **kw)
    g = -rate * F.softplus(torch.randn(shape, **kw) - 4.6)  # softplus(-4.6) ~ 0.01
    beta = torch.sigmoid(torch.randn(B, H, T, **kw))
    return dict(q=q, k=k, v=v, g=g, beta=beta)


def torch_rule(q, k, v, g, beta, initial=None, doc_starts=None):
    return chunk_gated_delta_rule(q, k, v, g, beta, initial, doc_starts, chunk=64)


def fwd_bwd(rule, x: dict, cotangents: tuple | None, extra: tuple = ()):
    """(o, final, grads of (o . do + final . dS) w.r.t. every leaf in x) or, without
    cotangents, a no-grad forward."""
    if cotangents is None:
        with torch.no_grad():
            return (*rule(*x.values(), *extra), None)
    leaves = [t.detach().requires_grad_() for t in x.values()]
    extra = tuple(
        t.detach().requires_grad_() if torch.is_tensor(t) and t.is_floating_point() else t
        for t in extra
    )
    o, final = rule(*leaves, *extra)
    do, dS = cotangents
    loss = (o.to(do.dtype) * do).sum() + (final.to(dS.dtype) * dS).sum()
    wrt = leaves + [t for t in extra if torch.is_tensor(t) and t.requires_grad]
    return o.detach(), final.detach(), torch.autograd.grad(loss, wrt)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], warmup: int = 2, repeats: int = 5) -> dict:
    """Median and min wall time of fn after warm-up (each synchronized), and the peak memory
    it allocates above what was allocated before it (CUDA only; a CPU dry run has none). A dry
    run calls fn once: its code paths, not its speed."""
    if DRY_RUN:
        warmup, repeats = 0, 1
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    result = {
        "median_ms": round(1e3 * statistics.median(times), 3),
        "min_ms": round(1e3 * min(times), 3),
    }
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        result["peak_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
    return result


def differences(got: tuple, ref: tuple, names: list[str]) -> dict:
    """Max abs difference per tensor, and relative to the reference's max abs value."""
    out = {}
    for name, a, b in zip(names, got, ref):
        a, b = a.double(), b.double()
        diff = (a - b).abs().max().item()
        scale = b.abs().max().item()
        out[name] = {"max_abs": diff, "rel_to_max": diff / scale if scale else math.inf}
    out["worst_rel"] = max(v["rel_to_max"] for v in out.values())
    return out


def flat(result: tuple) -> tuple:
    o, final, grads = result
    return (o, final, *(grads or ()))


def grad_names(x: dict, extra: tuple = ()) -> list[str]:
    return (
        ["o", "final"]
        + [f"d{n}" for n in x]
        + ["dinitial"] * any(torch.is_tensor(t) and t.is_floating_point() for t in extra)
    )


def delta_rule_cases(per_channel: bool, results: dict) -> dict[str, tuple[Callable, float]]:
    """The sub-cases of one decay kind: name -> (function returning its dict, rough seconds it
    needs on an H200 with fla's kernels still to compile); the shape goes into results."""
    results["shape"] = {
        "B": B,
        "T": T,
        "H": H,
        "Dk": D,
        "Dv": D,
        "decay": "per channel" if per_channel else "per head",
    }
    x = delta_inputs(per_channel)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    cot = (
        torch.randn(B, H, T, D, device=DEVICE, generator=gen),
        torch.randn(B, H, D, D, device=DEVICE, generator=gen),
    )
    names = grad_names(x)
    keep: dict = {}

    def forward_times() -> dict:
        return {
            "torch_forward": timed(lambda: fwd_bwd(torch_rule, x, None)),
            "fla_forward": timed(lambda: fwd_bwd(fla_gated_delta_rule, x, None)),
        }

    def fp32() -> dict:
        ref = fwd_bwd(torch_rule, x, cot)
        got = fwd_bwd(fla_gated_delta_rule, x, cot)
        keep["torch_fp32"], keep["fla_fp32"] = ref, got
        return {
            "torch": timed(lambda: fwd_bwd(torch_rule, x, cot)),
            "fla": timed(lambda: fwd_bwd(fla_gated_delta_rule, x, cot)),
            **forward_times(),
            "fla_vs_torch": differences(flat(got), flat(ref), names),
        }

    def bf16() -> dict:
        """fla on bf16 q, k, v (g, beta fp32, as the layers compute them) vs torch on the same
        values in fp32."""
        xb = {n: (t.bfloat16() if n in "qkv" else t) for n, t in x.items()}
        xr = {n: t.float() for n, t in xb.items()}
        ref = fwd_bwd(torch_rule, xr, cot)
        got = fwd_bwd(fla_gated_delta_rule, xb, cot)
        return {
            "inputs": "q, k, v bf16; g, beta fp32",
            "torch": timed(lambda: fwd_bwd(torch_rule, xr, cot)),
            "fla": timed(lambda: fwd_bwd(fla_gated_delta_rule, xb, cot)),
            "fla_vs_torch": differences(flat(got), flat(ref), names),
        }

    def fp64_reference() -> dict:
        """How far each fp32 result is from the fp64 torch chunked form."""
        if "fla_fp32" not in keep:
            return {"skipped": "the fp32 case did not finish"}
        ref = flat(
            fwd_bwd(
                torch_rule, {n: t.double() for n, t in x.items()}, tuple(c.double() for c in cot)
            )
        )
        return {
            "torch_fp32_vs_fp64": differences(flat(keep["torch_fp32"]), ref, names),
            "fla_fp32_vs_fp64": differences(flat(keep["fla_fp32"]), ref, names),
        }

    def documents() -> dict:
        """fla's varlen path: packed documents, a random initial state per row, row 1 continuing
        its state into its first document (no start at t = 0); fp32, forward + backward."""
        starts = torch.zeros(B, T, dtype=torch.bool, device=DEVICE)
        at = [round(T * f) for f in (0.17, 0.49, 0.977, 0.366, 0.814)]
        starts[0, [0, at[0], at[0] + 1, at[1], at[2]]] = True  # a document of one token
        starts[1, [at[3], at[4]]] = True
        initial = 0.1 * torch.randn(B, H, D, D, device=DEVICE, generator=gen)
        extra = (initial, starts)
        ref = fwd_bwd(torch_rule, x, cot, extra)
        got = fwd_bwd(fla_gated_delta_rule, x, cot, extra)
        return {
            "documents": {
                "row 0": starts[0].nonzero().flatten().tolist(),
                "row 1": starts[1].nonzero().flatten().tolist(),
            },
            "fla_vs_torch": differences(flat(got), flat(ref), grad_names(x, extra)),
            "torch": timed(lambda: fwd_bwd(torch_rule, x, cot, extra), 1, 3),
            "fla": timed(lambda: fwd_bwd(fla_gated_delta_rule, x, cot, extra), 1, 3),
        }

    def decode() -> dict:
        """One token with a state: fla's fused recurrent op vs our recurrent form."""
        x1 = {n: t[:, :, :1].contiguous() for n, t in x.items()}
        initial = 0.1 * torch.randn(B, H, D, D, device=DEVICE, generator=gen)
        with torch.no_grad():
            ref = recurrent_gated_delta_rule(*x1.values(), initial)
            got = fla_gated_delta_rule(*x1.values(), initial)
            step = {
                "torch": timed(lambda: recurrent_gated_delta_rule(*x1.values(), initial), 3, 20),
                "fla": timed(lambda: fla_gated_delta_rule(*x1.values(), initial), 3, 20),
            }
        return {"fla_vs_torch": differences(got, ref, ["o", "final"]), **step}

    def forward() -> dict:
        """No-grad forward only (where fla's backward cannot run): outputs and times."""
        ref = fwd_bwd(torch_rule, x, None)
        got = fwd_bwd(fla_gated_delta_rule, x, None)
        return {
            "fla_vs_torch": differences(flat(got), flat(ref), ["o", "final"]),
            **forward_times(),
        }

    return {
        "fp32": (fp32, 20),
        "forward": (forward, 15),
        "documents_initial_state": (documents, 20),
        "decode": (decode, 10),
        "bf16": (bf16, 20),
        "fp64_reference": (fp64_reference, 15),
    }


def layer_case(kind: str) -> dict:
    """A layer with kernel=fla vs kernel=torch (same weights, fp32, d_model 1024 = 8 value heads
    of 128; GDN with 4 query/key heads): three packed documents in a batch of 2, forward and
    backward (the parameters' gradients), then a prefill of 64 and 4 decoded tokens with a state."""
    from model.config import GDNConfig, KDAConfig
    from model.init import InitStds
    from model.mixers.gdn import GatedDeltaNet
    from model.mixers.kda import KimiDeltaAttention
    from model.mixers.masks import AttentionContext, document_starts, positions_in_documents
    from model.mixers.mixer import LayerDims

    width = LAYER_HEADS * D
    dims = LayerDims(width, 1e-6, None)
    layers = []
    for kernel in ("torch", "fla"):
        torch.manual_seed(0)
        if kind == "gdn":
            cfg = GDNConfig(
                n_heads=LAYER_HEADS // 2, n_v_heads=LAYER_HEADS, head_dim=D, kernel=kernel
            )
            layer = GatedDeltaNet(cfg, dims)
        else:
            cfg = KDAConfig(n_heads=LAYER_HEADS, head_dim=D, kernel=kernel)
            layer = KimiDeltaAttention(cfg, dims)
        layer = layer.to(DEVICE)
        with torch.no_grad():
            layer.init_weights(InitStds(0.02, 0.02, 0.02))
        layers.append(layer)
    layers[1].load_state_dict(layers[0].state_dict())
    Tl = LAYER_T
    doc_ids = torch.zeros(2, Tl, dtype=torch.long, device=DEVICE)
    doc_ids[0, Tl * 3 // 10 :] = 1
    doc_ids[0, Tl * 9 // 10 :] = 2
    doc_ids[1, Tl // 2 :] = 1
    ctx = AttentionContext(
        positions_in_documents(doc_ids), None, None, True, 0, doc_starts=document_starts(doc_ids)
    )
    x = torch.randn(2, Tl, width, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(2))
    outs, grads = [], []
    for layer in layers:
        y = layer(x, ctx)
        y.square().mean().backward()
        outs.append(y.detach())
        grads.append(torch.cat([p.grad.flatten() for p in layer.parameters()]))
    result = {
        "documents_forward": differences(outs[1:], outs[:1], ["y"]),
        "documents_param_grads": differences(grads[1:], grads[:1], ["grads"]),
    }
    with torch.no_grad():
        states = [layer.new_state(2, 0, torch.float32, torch.device(DEVICE)) for layer in layers]
        steps = []
        for t, width in ((0, 64), (64, 1), (65, 1), (66, 1), (67, 1)):
            pos = torch.arange(t, t + width, device=DEVICE)[None].expand(2, -1)
            c = AttentionContext(pos, None, None, t == 0, t)
            ys = [layer(x[:, t : t + width], c, s) for layer, s in zip(layers, states)]
            steps.append(differences(ys[1:], ys[:1], ["y"])["worst_rel"])
        result["prefill_then_decode_worst_rel"] = steps
        result["final_state"] = differences([states[1].state], [states[0].state], ["state"])
    return result


@check("delta_rule_fla_vs_torch")
def delta_rule_fla_vs_torch(budget: Budget) -> dict:
    reason = cuda_skip_reason(need_fla=True)
    if reason:
        return {"skipped": reason}
    import importlib.metadata

    from model.mixers.fla_ops import training_blocker

    results: dict = {"fla_core": importlib.metadata.version("fla-core"), "gdn": {}, "kda": {}}
    plans = {
        "gdn": delta_rule_cases(False, results["gdn"]),
        "kda": delta_rule_cases(True, results["kda"]),
    }
    blocker = training_blocker(torch.device(DEVICE).index)
    if blocker:  # fla's backward raises (or is wrong) here: its forward only, no wasted autotuning
        results["backward_skipped"] = blocker
    wanted = ("forward", "decode") if blocker else tuple(n for n in plans["gdn"] if n != "forward")
    plans = {kind: {name: plan[name] for name in wanted} for kind, plan in plans.items()}
    for name in plans["gdn"]:  # by priority, both kinds before the next sub-case
        for kind, plan in plans.items():
            print(f" {kind}:", flush=True)
            fn, need_s = plan[name]
            sub_case(results[kind], name, fn, budget, need_s)
    del plans  # the kept tensors
    for kind in () if blocker else ("gdn", "kda"):  # the layers train: not where blocked
        sub_case(results[kind], "layer", lambda k=kind: layer_case(k), budget, 15)
    return results


@check("engram_offload")
def engram_offload(budget: Budget) -> dict:
    reason = cuda_skip_reason()
    if reason:
        return {"skipped": reason}
    if not budget.allows(40):
        return {"skipped": f"time budget: {budget.left():.0f} s left, needs ~40 s"}
    from bench.gpu_engram import engram_offload as measure

    return measure(timed)


# ---- the runner -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help=f"default {DEFAULT_OUT} on CUDA")
    parser.add_argument("--only", nargs="+", choices=sorted(CHECKS), default=None)
    parser.add_argument("--budget-s", type=float, default=420.0, help="total wall-clock budget")
    parser.add_argument("--list", action="store_true", help="print the checks' names and exit")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a check raised")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="run the issue-18 checks' code on CPU on tiny shapes (Triton's interpreter)",
    )
    parser.add_argument(
        "--train-cases",
        nargs="+",
        choices=TRAIN_CASE_NAMES,
        default=None,
        help="train_mfu's sub-cases to run, in order (default: all but moe_eager)",
    )
    args = parser.parse_args(argv)
    global DRY_RUN, TRAIN_CASES
    DRY_RUN, TRAIN_CASES = args.dry_run, args.train_cases
    if args.list:
        print("\n".join(CHECKS))
        return 0
    budget = Budget(args.budget_s)
    cuda = torch.cuda.is_available()
    extra = {}
    if cuda:
        extra = {"gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda}
    report = {
        "benchmark": "gpu_check",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": machine(("torch", "triton", "fla-core"), **extra),
        "checks": {},
    }
    failed = False
    out = args.out or (DEFAULT_OUT if cuda else None)
    for name in args.only or CHECKS:
        print(f"{name}:", flush=True)
        start = time.monotonic()
        try:
            result = CHECKS[name](budget)
        except Exception as error:
            failed = True
            traceback.print_exc()
            result = {"error": f"{type(error).__name__}: {error}"[:2000]}
        result["seconds"] = round(time.monotonic() - start, 2)
        report["checks"][name] = result
        print(f"{name}: {json.dumps(result)[:300]}", flush=True)
        if out is not None:  # after every check: a run killed at its time limit keeps the rest
            write_report(report, out)
    if out is None:
        print(json.dumps(report, indent=2))
        print("no CUDA: printed only (pass --out PATH to write a file)")
    else:
        print(f"wrote {out}")
    return 1 if failed and args.strict else 0


def write_report(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(out)


if __name__ == "__main__":
    sys.exit(main())
