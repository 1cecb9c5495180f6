"""The training-step part of bench/gpu_check.py (issues 18 and 21): MFU of a ~1B dense model and
of a MoE model on one GPU, the step's time split, and the profiler's top kernels.

Each model trains through the trainer's own pieces (build_model, compile_model as
`trainer.compile=true` does, build_optimizer, FSDP2Engine in one process with bf16 autocast over
fp32 weights = `trainer.precision=bf16`, trainer.step.train_step): a few warm-up steps, then timed
steps on random tokens. MFU = training FLOPs per token (model/accounting.py, the number the
trainer logs) x tokens/s / the data-sheet bf16 peak (trainer/mfu.py). The split times a forward
alone and a forward + backward against the whole step (the rest: clipping and the optimizer).
The issue's target: >= 45% MFU for the dense model on an H100/H200-class GPU.

  dense_1b   Llama-3.2-1B's shape: d 2048, 16 layers, 32 query / 8 kv heads of 64, SwiGLU 8192,
             vocab 128256 tied; B 4 x T 4096
  moe        d 1024, 12 layers (the first dense), 64 routed experts of 512 (top 8) + 1 shared,
             16 / 4 heads of 64, vocab 32768; B 8 x T 2048
  dense_1b_muonclip_triton / _sdpa   the dense model under MuonClip with attention.backend
             triton (max logits from the kernel) and sdpa (recomputed): the QK-clip cost
  dense_1b_float8_<recipe> / moe_float8_<recipe>   the same models with trainer.precision=float8
             (parallel/float8.py: torchao, filter auto) against the bf16 case of the same run:
             tokens/s and the losses of the same steps on the same batch (issue 59's target:
             >= 1.2x bf16's tokens/s for the dense model at the same loss trajectory)

`small=True` shrinks every model to run the same code on CPU (a dry run).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

DENSE_1B = {
    "d_model": 2048, "n_layers": 16, "vocab_size": 128256, "max_seq_len": 4096,
    "attention.n_heads": 32, "attention.n_kv_heads": 8, "ffn.hidden": 8192,
    "loss_chunk_tokens": 4096,
}  # fmt: skip
# the hybrid's Gated DeltaNet at the width of dense_1b's attention (10.5M parameters a layer):
# 8 query/key heads of 128, 16 value heads of 64 (Qwen3-Next's 2 value heads per key head)
GDN_1B = {"gdn.n_heads": 8, "gdn.n_v_heads": 16, "gdn.head_dim": 128, "gdn.v_head_dim": 64}
# Engram in 2 of the 16 blocks with the demo's tables (5 x vocab rows per head), raw token ids
ENGRAM_1B = {"engram.layers": [1, 8], "engram.heads": 8, "engram.dim": 512,
             "engram.table_sizes": [], "engram.compress_tokens": False}  # fmt: skip


@dataclass(frozen=True)
class TrainModel:
    """A model of the GPU session: preset + overrides, batch x seq_len tokens a step."""

    preset: str
    overrides: dict
    batch: int
    seq_len: int
    optimizer: str = "adamw"
    activation_checkpoint: str = "none"  # parallel.activation_checkpoint
    # MoE models too large for a GPU's memory at n_layers: the layers kept per GiB (None: all)
    layers_for_memory: tuple[tuple[float, int], ...] | None = None


MODELS = {
    # Llama-3.2-1B's shape: 32 query / 8 kv heads of 64, SwiGLU 8192, vocab 128256 tied
    "dense_1b": TrainModel("tiny", DENSE_1B, 4, 4096),
    # the 1.2B MoE of the first GPU runs: 64 experts of 512, top 8 + 1 shared, first layer dense
    "moe": TrainModel(
        "tiny_moe",
        {
            "d_model": 1024, "n_layers": 12, "vocab_size": 32768, "max_seq_len": 2048,
            "attention.n_heads": 16, "attention.n_kv_heads": 4, "ffn.hidden": 4096,
            "moe.n_routed_experts": 64, "moe.top_k": 8, "moe.expert_hidden": 512,
            "loss_chunk_tokens": 4096,
        },
        8, 2048,
    ),
    # fine-grained MoE filling one GPU: d 2048, 64 experts of 1024, top 6 + 1 shared, 16 heads
    # of 128 over 4 kv heads, the first layer dense; 12 layers (4.9B parameters, 0.9B active:
    # 74 GiB of fp32 weights, gradients and AdamW states) on GPUs with >= 130 GiB, else 8 (3.3B)
    "moe_fine": TrainModel(
        "tiny_moe",
        DENSE_1B | {
            "attention.n_heads": 16, "attention.n_kv_heads": 4,
            "moe.n_routed_experts": 64, "moe.top_k": 6, "moe.expert_hidden": 1024,
        },
        4, 4096, layers_for_memory=((130.0, 12), (0.0, 8)),
    ),
    # the 2026 layers at dense_1b's size, against its step time
    "hybrid_1b": TrainModel("tiny_hybrid", DENSE_1B | GDN_1B | {"gdn.kernel": "torch"}, 4, 4096),
    "hybrid_1b_fla": TrainModel("tiny_hybrid", DENSE_1B | GDN_1B | {"gdn.kernel": "fla"}, 4, 4096),
    "attnres_1b": TrainModel("tiny_attnres", DENSE_1B | {"attnres.block_layers": 2}, 4, 4096),
    "mhc_1b": TrainModel("tiny_mhc", DENSE_1B, 4, 4096),
    "engram_1b": TrainModel("tiny_engram", DENSE_1B | ENGRAM_1B, 4, 4096),
    # long context: one sequence of 32k tokens, selective activation checkpointing
    "dense_1b_32k": TrainModel(
        "tiny", DENSE_1B | {"max_seq_len": 32768}, 1, 32768, activation_checkpoint="selective"
    ),
}  # fmt: skip
SMALL = {"d_model": 64, "n_layers": 2, "vocab_size": 256, "max_seq_len": 64, "ffn.hidden": 128,
         "attention.n_heads": 4, "attention.n_kv_heads": 2, "loss_chunk_tokens": 64}  # fmt: skip
KEPT_SMALL = {"moe.top_k", "gdn.kernel", "engram.compress_tokens"}  # the rest: the preset's


def model_overrides(spec: TrainModel, small: bool, device: torch.device) -> dict:
    """The preset's overrides at the GPU's size, or the dry run's tiny one (same features)."""
    if small:
        kept = {k: v for k, v in spec.overrides.items() if "." not in k or k in KEPT_SMALL}
        kept = {k: v for k, v in kept.items() if not k.startswith("attention.")}
        extra = {"engram.layers": [1]} if "engram.layers" in spec.overrides else {}
        if "gdn.kernel" in spec.overrides:  # the hybrid's pattern: 3 GDN layers, then attention
            extra["n_layers"] = 4
        return kept | SMALL | extra
    if spec.layers_for_memory and device.type == "cuda":
        gib = torch.cuda.get_device_properties(device).total_memory / 2**30
        layers = next(n for least, n in spec.layers_for_memory if gib >= least)
        return spec.overrides | {"n_layers": layers}
    return spec.overrides


def build(
    name: str,
    small: bool,
    device: torch.device,
    compile_blocks: bool,
    extra: dict | None = None,
    float8: str = "",
):
    """(engine, batch, flops per token) for one of MODELS; `float8`: a trainer.float8.recipe."""
    from data.loader import Batch
    from model.accounting import training_flops_per_token
    from model.presets import load_preset
    from model.transformer import build_model
    from optim.builder import build_optimizer
    from optim.config import OptimConfig
    from optim.qk_clip import enable_qk_clip
    from parallel.activation import apply_activation_checkpointing, compile_model
    from parallel.engine import FSDP2Engine

    spec = MODELS[name]
    overrides = model_overrides(spec, small, device) | (extra or {})
    batch, seq_len = (2, 32) if small else (spec.batch, spec.seq_len)
    optim_name = "muonclip" if "attention.backend" in (extra or {}) else spec.optimizer
    model = build_model(load_preset(spec.preset, overrides), device=device, seed=0)
    if optim_name == "muonclip":
        enable_qk_clip(model)
    plan = None
    if float8:  # as the trainer converts: before compile (the small shapes: every matmul)
        from parallel.config import Float8Config
        from parallel.float8 import convert_to_float8

        cfg = Float8Config(recipe=float8, filter="all" if small else "auto")
        plan = convert_to_float8(model, cfg, device, sharded=False)
    apply_activation_checkpointing(model, spec.activation_checkpoint)  # the trainer's order
    if compile_blocks:
        compile_model(model, device.type)
    opt = build_optimizer(OptimConfig(name=optim_name, lr=1e-4), model)
    engine = FSDP2Engine(model, opt, "float8" if float8 else "bf16", device)
    engine.float8 = plan
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(
        0, model.cfg.vocab_size, (batch, seq_len + 1), device=device, generator=gen
    )
    data = Batch(tokens[:, :-1], tokens[:, 1:], torch.zeros_like(tokens[:, 1:]))
    return engine, data, training_flops_per_token(model, seq_len).total


def peak_flops(device: torch.device) -> tuple[float, str]:
    from trainer.mfu import device_peak

    return device_peak(device, torch.bfloat16, 0.0)


def step_times(engine, data, qk_clip: bool, sync: Callable, steps: int) -> dict:
    """Median seconds of a forward, a forward + backward, and a whole train_step."""
    from model.training_hooks import objective_with
    from trainer.hooks import start_hooks
    from trainer.step import LossTracker, StepSettings, train_step

    settings = StepSettings(grad_clip=1.0)
    hooks = start_hooks(engine, 100.0 if qk_clip else 0.0, None)
    objective = objective_with(hooks)  # the MoE balance losses, as train_step adds them

    def forward():
        with torch.no_grad(), engine.autocast():
            engine.model(data.inputs, data.targets)

    def forward_backward():
        engine.forward_backward(data.inputs, data.targets, None, 1, True, objective)
        engine.zero_grad()

    losses = []

    def step():
        losses.append(train_step(engine, data, settings, LossTracker(0.0), hooks).loss)

    def median(fn) -> float:
        times = []
        for _ in range(steps):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    step()  # the optimizer's state exists from here
    return {
        "forward_s": median(forward),
        "forward_backward_s": median(forward_backward),
        "step_s": median(step),
        "losses": [round(float(x), 4) for x in losses],  # the steps on the same batch
    }


def top_kernels(engine, data, count: int = 15) -> list[dict]:
    """The profiler's CUDA kernels of one train step, by total time."""
    from torch.profiler import ProfilerActivity, profile

    from trainer.hooks import start_hooks
    from trainer.step import LossTracker, StepSettings, train_step

    hooks = start_hooks(engine, 0.0, None)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        train_step(engine, data, StepSettings(grad_clip=1.0), LossTracker(0.0), hooks)
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events) or 1.0
    return [
        {
            "name": e.key[:120],
            "ms": round(e.device_time_total / 1e3, 3),
            "share": round(e.device_time_total / total, 4),
            "calls": e.count,
        }
        for e in events[:count]
    ]


def train_case(
    name: str,
    small: bool,
    device: torch.device,
    sync: Callable,
    compile_blocks: bool = True,
    extra: dict | None = None,
    profile: bool = False,
    float8: str = "",
) -> dict:
    torch._dynamo.reset()  # each case compiles as in a fresh process (no shared recompile limit)
    graphs = torch._dynamo.utils.counters["stats"]  # cumulative over the process: take the change
    graphs_before = graphs["unique_graphs"]
    torch._dynamo.utils.counters["graph_break"].clear()  # this case's breaks, by reason
    if device.type == "cuda":
        gc.collect()  # an earlier case's engine held only by a reference cycle: freed first
        torch.cuda.reset_peak_memory_stats()  # this case's peak, not the process's
    engine, data, flops_per_token = build(name, small, device, compile_blocks, extra, float8)
    from model.accounting import param_counts

    start = time.perf_counter()
    from trainer.hooks import start_hooks
    from trainer.step import LossTracker, StepSettings, train_step

    qk_clip = extra is not None and "attention.backend" in extra
    hooks = start_hooks(engine, 100.0 if qk_clip else 0.0, None)
    for _ in range(1 if small else 2):  # warm-up: compile, autotuning, allocator
        train_step(engine, data, StepSettings(grad_clip=1.0), LossTracker(0.0), hooks)
    sync()
    warmup_s = time.perf_counter() - start
    # a dry run (small) passes through each timed call once: its code, not its speed
    times = step_times(engine, data, qk_clip, sync, steps=1 if small else 3)
    tokens = data.inputs.numel()
    peak, source = peak_flops(device)
    cfg = engine.model.cfg
    result = {
        "model": {
            "preset": MODELS[name].preset,
            "d_model": cfg.d_model,
            "n_layers": cfg.n_layers,
            "batch": data.inputs.shape[0],
            "seq_len": data.inputs.shape[1],
            "activation_checkpoint": MODELS[name].activation_checkpoint,
        },
        "tokens_per_step": tokens,
        "params": sum(p.numel() for p in engine.model.parameters()),
        "active_params": param_counts(engine.model).active,
        "flops_per_token": flops_per_token,
        "warmup_s": round(warmup_s, 1),
        **{k: v if k == "losses" else round(v, 4) for k, v in times.items()},
        "tokens_per_s": round(tokens / times["step_s"]),
        "mfu": round(flops_per_token * tokens / times["step_s"] / peak, 4),
        "peak_flops": peak,
        "peak_source": source,
        "dynamo_graphs": graphs["unique_graphs"] - graphs_before,
        "graph_breaks": {
            reason.split("\n")[0][:160]: count
            for reason, count in torch._dynamo.utils.counters["graph_break"].items()
        },
    }
    if engine.float8 is not None:
        result["float8"] = engine.float8.summary()
    if device.type == "cuda":
        result["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if profile:
            result["top_kernels"] = top_kernels(engine, data)
            result["host_syncs_per_step"] = host_syncs(engine, data)
    return result


def host_syncs(engine, data) -> dict:
    """The CUDA host syncs of one train step (torch.cuda.set_sync_debug_mode's warnings), by
    the op that waited: what stalls the GPU's queue between kernels."""
    import warnings

    from trainer.hooks import start_hooks
    from trainer.step import LossTracker, StepSettings, train_step

    hooks = start_hooks(engine, 0.0, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            train_step(engine, data, StepSettings(grad_clip=1.0), LossTracker(0.0), hooks)
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs: dict[str, int] = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            where = f"{str(w.message)[:80]} ({w.filename.rsplit('/', 1)[-1]}:{w.lineno})"
            syncs[where] = syncs.get(where, 0) + 1
    return {"total": sum(syncs.values()), "by_call": syncs}
