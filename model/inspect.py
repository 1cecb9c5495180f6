"""`python -m model.inspect [overrides]`: parameters, FLOPs/token, KV cache and training memory.

    python -m model.inspect                                    # the default (tiny) model
    python -m model.inspect model=llama3_8b seq_len=8192
    python -m model.inspect model=llama2_7b,llama3_8b,deepseek_v3 dtype=bf16   # side by side
    python -m model.inspect model=llama3_70b model.attention.n_kv_heads=64 dp_shard=64 format=json
    python -m model.inspect model=llama3_70b dp_shard=8 tp=8 seq_len=8192 param_dtype=bf16
    python -m model.inspect model=llama3_8b dp_shard=8 cp=4 seq_len=131072 memory_gib=80
    python -m model.inspect model=llama3_70b pp=4 pp_schedule=Interleaved1F1B dp_shard=4 tp=8

Options: model=<preset>[,<preset>...], model.<key>=<value> (any ModelConfig field), seq_len=<T>
(default: 8192, or the model's max_seq_len when shorter), dtype=bf16|fp32|fp8 (the KV cache),
param_dtype=fp32|bf16 (training weights: fp32, or bf16 with an fp32 master copy), format=table|json.
Models are built on the meta device, so the largest presets cost no memory. Sizes print in KiB,
MiB, GiB, TiB (powers of 1024).

The layout planner (model/planner.py): what one rank holds and sends per step under
dp_replicate=<R> dp_shard=<S> cp=<C> tp=<T> ep=<E> (world R x S x C x T), optimizer=adamw|muon,
micro_batch_size=<B> (default 1) and seq_len, activation_checkpoint=none|full (which activations
the total counts; full also counts the recompute's collectives), reshard_after_forward=true|false,
sequence_parallel=true|false (with tp > 1: the residual stream split along the sequence over the
tp ranks, as parallel.sequence_parallel). cp: context parallelism (parallel.cp), each rank
computing seq_len / cp positions of every sequence; memory_gib=<G>: also the longest seq_len
whose per-rank total fits G GiB under that layout (how to choose cp for a context).

Pipeline parallelism (parallel.pp...): pp=<P> (world P x the rest), pp_schedule=GPipe|1F1B|
Interleaved1F1B|LoopedBFS|InterleavedZeroBubble|ZBVZeroBubble|DualPipeV, pp_microbatches=<m>
(0: one per stage), pp_stages_per_rank=<v> (0: the schedule's), pp_layers=<n>,<n>,... (blocks per
stage; default FLOP-balanced). The table then prints the stage split (each stage's pipeline rank
and blocks), each pipeline rank's total and traffic, and in the per-rank rows the heaviest
pipeline rank, per step of m micro-batches.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from typing import Any

from model.accounting import (
    DTYPE_BYTES,
    kv_cache_size,
    param_counts,
    training_flops_per_token,
    training_memory,
)
from model.config import ConfigError, ModelConfig
from model.planner import Layout, largest_seq_len, rank_plan
from model.planner_pipeline import pipeline_rank_plans, pipeline_stages, stage_ranks
from model.presets import load_preset, parse_value, preset_names
from model.stages import canonical_schedule
from model.transformer import build_model

# The README's tables use it; a preset's full context (163,840 for DeepSeek-V3) would make the
# attention term dominate the FLOPs of the default table.
DEFAULT_SEQ_LEN = 8192


@dataclass
class InspectArgs:
    presets: list[str] = field(default_factory=lambda: ["tiny"])
    model_overrides: dict[str, Any] = field(default_factory=dict)
    seq_len: int = 0  # 0 = DEFAULT_SEQ_LEN, or the model's max_seq_len when shorter
    dtype: str = "bf16"  # KV cache
    param_dtype: str = "fp32"  # training weights (bf16 adds an fp32 master copy)
    format: str = "table"
    layout: dict[str, Any] = field(default_factory=dict)  # planner options (model.planner.Layout)
    memory_gib: float = 0.0  # > 0: the longest seq_len whose per-rank total fits it


INT_OPTIONS = ("dp_replicate", "dp_shard", "cp", "tp", "ep", "micro_batch_size")
INT_OPTIONS += ("pp", "pp_microbatches", "pp_stages_per_rank")
TEXT_OPTIONS = ("optimizer", "activation_checkpoint", "pp_schedule")
BOOL_OPTIONS = ("reshard_after_forward", "sequence_parallel")


def parse_args(argv: list[str]) -> InspectArgs:
    args = InspectArgs()
    for item in argv:
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(
                f"expected key=value, got {item!r} (see `python -m model.inspect --help`)"
            )
        if key == "model":
            args.presets = [name.strip() for name in text.split(",") if name.strip()]
        elif key.startswith("model."):
            args.model_overrides[key.removeprefix("model.")] = parse_value(text)
        elif key in ("seq_len", *INT_OPTIONS):
            try:
                number = int(text)
            except ValueError:
                raise ConfigError(f"{key}={text!r} must be an integer") from None
            if key == "seq_len":
                args.seq_len = number
            else:
                args.layout[key] = number
        elif key == "memory_gib":
            try:
                args.memory_gib = float(text)
            except ValueError:
                raise ConfigError(f"memory_gib={text!r} must be a number") from None
            if args.memory_gib <= 0:
                raise ConfigError(f"memory_gib={text} must be > 0")
        elif key == "pp_layers":
            args.layout[key] = _int_list(key, text)
        elif key in ("dtype", "param_dtype", "format"):
            setattr(args, key, text)
        elif key in TEXT_OPTIONS:
            args.layout[key] = text
        elif key in BOOL_OPTIONS:
            if text not in ("true", "false"):
                raise ConfigError(f"{key}={text!r}; choose true or false")
            args.layout[key] = text == "true"
        else:
            raise ConfigError(
                f"unknown option {key!r}; options: model, model.<key>, seq_len, dtype, param_dtype, "
                f"format, memory_gib, pp_layers, "
                f"{', '.join(INT_OPTIONS + TEXT_OPTIONS + BOOL_OPTIONS)}"
            )
    if args.dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype={args.dtype!r}; choose one of: {', '.join(DTYPE_BYTES)}")
    if args.param_dtype not in ("fp32", "bf16"):
        raise ConfigError(f"param_dtype={args.param_dtype!r}; choose fp32 or bf16")
    if args.format not in ("table", "json"):
        raise ConfigError(f"format={args.format!r}; choose table or json")
    if args.seq_len < 0:
        raise ConfigError(f"seq_len={args.seq_len} must be >= 0")
    return args


def _int_list(key: str, text: str) -> tuple[int, ...]:
    """`3,5` or `[3,5]` as (3, 5)."""
    try:
        return tuple(int(part) for part in text.strip("[]").split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"{key}={text!r} must be integers separated by commas") from None


def layout_of(args: InspectArgs, seq_len: int) -> Layout:
    return Layout(param_dtype=args.param_dtype, seq_len=seq_len, **args.layout)


def default_seq_len(cfg: ModelConfig, seq_len: int) -> int:
    """`seq_len` when given, else DEFAULT_SEQ_LEN within the model's context."""
    return seq_len or min(DEFAULT_SEQ_LEN, cfg.max_seq_len)


def describe(cfg: ModelConfig, seq_len: int, args: InspectArgs) -> dict[str, Any]:
    """Every number the table shows, as raw values (also the JSON output)."""
    model = build_model(cfg, device="meta")
    params = param_counts(model)
    flops = training_flops_per_token(model, seq_len)
    kv = kv_cache_size(model, args.dtype)
    layout = layout_of(args, seq_len)
    # (each checks the layout first: ConfigError)
    plans = pipeline_rank_plans(model, layout) if layout.pp > 1 else [rank_plan(model, layout)]
    plan = max(plans, key=lambda p: p.total)  # the heaviest pipeline rank (rank_plan's)
    memory = training_memory(params.total, args.param_dtype, layout.dp_shard)
    fits = largest_seq_len(model, layout, args.memory_gib * 2**30) if args.memory_gib else None
    return {
        "layers": cfg.n_layers,
        "layout": cfg.layout_summary(),
        "d_model": cfg.d_model,
        "attention": _mixer_description(model),
        "ffn": _ffn_description(cfg),
        "moe": _moe_description(cfg),
        "engram": _engram_description(model),
        "vocab_size": cfg.vocab_size,
        "position": cfg.position
        if cfg.position != "rope"
        else f"rope (scaling {cfg.rope.scaling}, theta {cfg.rope.theta:g})",
        "params_total": params.total,
        "params_embedding": params.embedding,
        "params_head": params.head,
        "params_blocks": params.blocks,
        "params_memory": params.memory,
        "params_mtp": params.mtp,
        "params_active": params.active,
        "params_active_fraction": params.active / params.total,
        "seq_len": seq_len,
        "train_flops_per_token": flops.total,
        "train_flops_matmul": flops.matmul,
        "train_flops_attention": flops.attention,
        "train_flops_residual": flops.residual,
        "six_n": 6 * params.active,
        "kv_bytes_per_token": kv.bytes_per_token,
        "kv_bytes_per_sequence": kv.per_sequence(seq_len),
        **_long_context_state(cfg, kv, args.dtype),
        "kv_mha_bytes_per_token": kv.mha_bytes_per_token,
        "kv_reduction_vs_mha": kv.reduction,
        "train_state_bytes": memory.total,
        "train_state_bytes_per_device": memory.per_device,
        "kv_dtype": args.dtype,
        "param_dtype": args.param_dtype,
        **{key: getattr(layout, key) for key in LAYOUT_KEYS},
        **plan.as_dict(),
        "pp_rank": plan.pp_rank,
        **(_pipeline_rows(model, layout, plans) if layout.pp > 1 else {}),
        "rank_largest_seq_len": fits,
        "memory_gib": args.memory_gib or None,
    }


LAYOUT_KEYS = ("dp_replicate", "dp_shard", "cp", "tp", "ep", "micro_batch_size", "optimizer")
LAYOUT_KEYS += ("sequence_parallel", "pp")


def _pipeline_rows(model: Any, layout: Layout, plans: list[Any]) -> dict[str, Any]:
    """The schedule, each stage's rank and blocks (`pp_stage_<i>`), and each pipeline rank's
    total and traffic (`pp_rank_<r>_total`, `pp_rank_<r>_comm`)."""
    stages = pipeline_stages(model, layout)
    rows: dict[str, Any] = {
        "pp_schedule": canonical_schedule(layout.pp_schedule),
        "pp_microbatches": layout.micro_batches,
        "pp_stages": len(stages),
    }
    for stage, rank in zip(stages, stage_ranks(layout, stages), strict=True):
        rows[f"pp_stage_{stage.index}"] = f"rank {rank}: " + stage.describe().split(": ", 1)[1]
    for plan in plans:
        rows[f"pp_rank_{plan.pp_rank}_total"] = plan.total
        rows[f"pp_rank_{plan.pp_rank}_comm"] = plan.comm
    return rows


def _layers(first: int, last: int) -> str:
    return f"layer {first}" if first == last else f"layers {first}-{last}"


def _ffn_description(cfg: ModelConfig) -> str:
    text = f"{cfg.ffn.kind} {cfg.ffn_hidden}"
    dense = cfg.moe.first_k_dense
    if not cfg.moe.enabled:
        return text
    return f"{text} ({_layers(0, dense - 1)})" if dense else "none (every layer is MoE)"


def _moe_description(cfg: ModelConfig) -> str:
    moe = cfg.moe
    if not moe.enabled:
        return "none"
    text = f"{_layers(moe.first_k_dense, cfg.n_layers - 1)}: {moe.n_routed_experts} x {cfg.expert_hidden}"
    text += f", top-{moe.top_k}"
    if moe.n_groups > 1:
        text += f" ({moe.topk_groups} of {moe.n_groups} groups)"
    if moe.n_shared_experts:
        text += f", +{moe.n_shared_experts} shared"
    return text


def _engram_description(model: Any) -> str:
    """The Engram layers and their tables, e.g. 'layers 1, 3: 8 heads x 32 over n-grams 2..3,
    481,360 rows'."""
    found = [b.engram for b in model.layers.values() if b.engram is not None]
    if not found:
        return "none"
    layers = ", ".join(str(e.layer_id) for e in found)
    rows = sum(e.table.weight.shape[0] for e in found)
    return f"layer{'s' if len(found) > 1 else ''} {layers}: {found[0].describe()}, {rows:,} rows"


LONG_CONTEXTS = (32768, 131072)


def _long_context_state(cfg: ModelConfig, kv: Any, dtype: str) -> dict[str, int]:
    """Generation state of one sequence at 32k and 128k tokens, and of the all-attention twin
    (every layer attention.kind, the rest unchanged): what a hybrid's linear layers save."""
    twin_cfg = dataclasses.replace(cfg, layer_types=[], layer_pattern=[], full_attention_every=0)
    twin = kv_cache_size(build_model(twin_cfg, device="meta"), dtype)
    out = {}
    for tokens in LONG_CONTEXTS:
        name = f"{tokens // 1024}k"
        out[f"state_bytes_{name}"] = kv.per_sequence(tokens)
        out[f"attention_twin_state_bytes_{name}"] = twin.per_sequence(tokens)
    return out


def _runs(items: list[Any]) -> list[tuple[int, int, Any]]:
    """(first, last, item) for each run of equal consecutive items."""
    runs: list[tuple[int, int, Any]] = []
    for i, item in enumerate(items):
        if runs and runs[-1][2] == item:
            runs[-1] = (runs[-1][0], i, item)
        else:
            runs.append((i, i, item))
    return runs


def _mixer_description(model: Any) -> str:
    """Each mixer's own description, once per run of layers that share it."""
    lines = [block.attn.describe() for block in model.layers.values()]
    runs = _runs(lines)
    if len(runs) == 1:
        return lines[0]
    return "; ".join(f"{_layers(a, b)}: {line}" for a, b, line in runs)


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def format_bytes(n: float) -> str:
    """Binary units up to PiB: 1024 GiB and more print in TiB."""
    for unit, size in (
        ("PiB", 2**50),
        ("TiB", 2**40),
        ("GiB", 2**30),
        ("MiB", 2**20),
        ("KiB", 2**10),
    ):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


RANK_MEMORY = (
    "weights",
    "grads",
    "master",
    "optimizer",
    "activations",
    "activations_checkpointed",
    "transient",
    "total",
)
RANK_COMM = ("comm_all_gather", "comm_reduce_scatter", "comm_hsdp_all_reduce", "comm_tp")
RANK_COMM += ("comm_ep", "comm_cp", "comm_pp", "comm")

ROWS: list[tuple[str, str, Any]] = [
    ("Shape", "layers", str),
    ("Shape", "layout", str),
    ("Shape", "d_model", str),
    ("Shape", "attention", str),
    ("Shape", "ffn", str),
    ("Shape", "moe", str),
    ("Shape", "engram", str),
    ("Shape", "vocab_size", str),
    ("Shape", "position", str),
    ("Parameters", "params_total", lambda n: f"{_count(n)} ({n:,})"),
    ("Parameters", "params_embedding", _count),
    ("Parameters", "params_head", _count),
    ("Parameters", "params_blocks", _count),
    ("Parameters", "params_memory", _count),
    ("Parameters", "params_mtp", _count),
    ("Parameters", "params_active", _count),
    ("Parameters", "params_active_fraction", lambda r: f"{100 * r:.1f}%"),
    ("Training FLOPs / token", "seq_len", str),
    ("Training FLOPs / token", "train_flops_per_token", _count),
    ("Training FLOPs / token", "train_flops_matmul", _count),
    ("Training FLOPs / token", "train_flops_attention", _count),
    ("Training FLOPs / token", "train_flops_residual", _count),
    ("Training FLOPs / token", "six_n", _count),
    ("KV cache", "kv_bytes_per_token", format_bytes),
    ("KV cache", "kv_bytes_per_sequence", format_bytes),
    ("KV cache", "kv_mha_bytes_per_token", format_bytes),
    ("KV cache", "kv_reduction_vs_mha", lambda r: f"{r:.1f}x"),
    ("KV cache", "state_bytes_32k", format_bytes),
    ("KV cache", "attention_twin_state_bytes_32k", format_bytes),
    ("KV cache", "state_bytes_128k", format_bytes),
    ("KV cache", "attention_twin_state_bytes_128k", format_bytes),
    ("AdamW training state", "train_state_bytes", format_bytes),
    ("AdamW training state", "train_state_bytes_per_device", format_bytes),
    *(("Per rank: memory", f"rank_{key}", format_bytes) for key in RANK_MEMORY),
    *(("Per rank: sent per step", f"rank_{key}", format_bytes) for key in RANK_COMM),
    ("Per rank: longest context", "rank_largest_seq_len", lambda n: "-" if n is None else f"{n:,}"),
]

LABELS = {
    "params_total": "total",
    "params_embedding": "embedding",
    "params_head": "output head (untied)",
    "params_blocks": "blocks (backbone)",
    "params_memory": "memory tables (Engram)",
    "params_mtp": "MTP modules",
    "params_active": "active per token",
    "params_active_fraction": "active / total",
    "train_flops_per_token": "total (6N + attention)",
    "train_flops_matmul": "matmuls (6 x weights)",
    "train_flops_attention": "attention (causal)",
    "train_flops_residual": "residual stream (AttnRes, mHC)",
    "six_n": "6N (for comparison)",
    "kv_bytes_per_token": "per token",
    "kv_bytes_per_sequence": "per sequence of seq_len",
    "kv_mha_bytes_per_token": "MHA equivalent per token",
    "kv_reduction_vs_mha": "reduction vs MHA",
    "state_bytes_32k": "per sequence at 32k tokens",
    "attention_twin_state_bytes_32k": "  all-attention twin at 32k",
    "state_bytes_128k": "per sequence at 128k tokens",
    "attention_twin_state_bytes_128k": "  all-attention twin at 128k",
    "train_state_bytes": "weights + grads + master + Adam",
    "train_state_bytes_per_device": "per device (over dp_shard)",
    "rank_weights": "weights",
    "rank_grads": "gradients",
    "rank_master": "fp32 master (param_dtype bf16)",
    "rank_optimizer": "optimizer state",
    "rank_activations": "activations (no checkpointing)",
    "rank_activations_checkpointed": "activations (full checkpointing)",
    "rank_transient": "gathered weights + loss chunk",
    "rank_total": "total (activation_checkpoint)",
    "rank_comm_all_gather": "FSDP2 all-gather (dp_shard)",
    "rank_comm_reduce_scatter": "FSDP2 reduce-scatter (dp_shard)",
    "rank_comm_hsdp_all_reduce": "HSDP all-reduce (dp_replicate)",
    "rank_comm_tp": "TP all-reduce/gather (tp)",
    "rank_comm_ep": "EP all-to-all (ep)",
    "rank_comm_cp": "CP K/V all-gather, states (cp)",
    "rank_comm_pp": "PP stage boundaries, embedding (pp)",
    "pp_rank": "pipeline rank in the rows above",
    "rank_largest_seq_len": "seq_len whose total fits memory_gib",
    "rank_comm": "total",
}


def _pipeline_table_rows(result: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """The stage split and each pipeline rank's total and traffic (the same count of stages and
    ranks for every preset: the layout sets them)."""
    group = "Pipeline (pp)"
    rows = [(group, "pp_rank", str)]
    rows += [(group, f"pp_stage_{i}", str) for i in range(result["pp_stages"])]
    ranks = sum(1 for key in result if key.startswith("pp_rank_") and key.endswith("_total"))
    for r in range(ranks):
        rows += [
            (group, f"pp_rank_{r}_total", format_bytes),
            (group, f"pp_rank_{r}_comm", format_bytes),
        ]
    return rows


def _pipeline_label(key: str) -> str | None:
    """`stage 3`, `rank 1 total`, `rank 1 sent per step` for the pipeline rows."""
    if key.startswith("pp_stage_"):
        return f"stage {key.removeprefix('pp_stage_')}"
    if key.startswith("pp_rank_") and key.count("_") == 3:
        rank, what = key.removeprefix("pp_rank_").split("_")
        return f"rank {rank} " + ("total" if what == "total" else "sent per step")
    return None


def render_table(results: dict[str, dict[str, Any]], args: InspectArgs) -> None:
    from rich.console import Console
    from rich.table import Table

    seq_len = args.seq_len or f"min({DEFAULT_SEQ_LEN}, context)"
    layout = layout_of(args, 1)
    first = next(iter(results.values()))
    pipeline = ""
    if layout.pp > 1:
        pipeline = (
            f"pp {layout.pp} ({first['pp_schedule']}, {first['pp_stages']} stages, "
            f"{first['pp_microbatches']} micro-batches per step) x "
        )
    table = Table(
        title=f"Model inspection (seq_len {seq_len}, KV cache {args.dtype}, "
        f"weights {args.param_dtype}); per rank of {pipeline}dp_replicate {layout.dp_replicate} x "
        f"dp_shard {layout.dp_shard} x cp {layout.cp} x tp {layout.tp} ({layout.world} ranks"
        f"{', sequence parallel' if layout.sequence_parallel else ''}), ep {layout.ep}, "
        f"micro-batch {layout.micro_batch_size}, {layout.optimizer}, "
        f"activation_checkpoint {layout.activation_checkpoint}"
    )
    table.add_column("")
    table.add_column("")
    for name in results:
        table.add_column(name, justify="right")
    section = None
    rows = ROWS + (_pipeline_table_rows(first) if layout.pp > 1 else [])
    for group, key, fmt in rows:
        if group != section:
            table.add_section()
            section = group
        label = LABELS.get(key) or _pipeline_label(key) or key.replace("_", " ")
        table.add_row(
            group if key == next(k for g, k, _ in rows if g == group) else "",
            label,
            *(fmt(r[key]) for r in results.values()),
        )
    Console(width=max(110, 62 + 44 * len(results))).print(table)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        print("presets:", ", ".join(preset_names()))
        return 0
    try:
        args = parse_args(argv)
        results = {}
        for name in args.presets:
            cfg = load_preset(name, args.model_overrides)
            results[name] = describe(cfg, default_seq_len(cfg, args.seq_len), args)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.format == "json":
        print(json.dumps(results, indent=2))
    else:
        render_table(results, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
