"""MoE layer forward + backward throughput: ours, the textbook per-expert loop, and transformers'
Qwen3-MoE sparse block, all with the same weights, in one run.

Fine-grained shapes (E experts, top-k, d_model C, expert hidden F, N tokens), weights and inputs
in --dtype (auto: bf16 where the device multiplies bf16 natively, else fp32), no shared expert
(Qwen3-MoE has none). Every variant routes with softmax + top-k + renormalization. Rows:
  ours                     MoE layer, experts impl "auto" (on CPU: the padded batch in bf16; in fp32
                           threaded GLU for small groups, else grouped_mm; GPU: grouped_mm)
  ours_padded_bmm          the same layer with the experts' padded batched GEMM
  ours_threaded_mm         the same layer with the per-expert GEMMs one per thread (CPU)
  ours_grouped_mm          the same layer with torch._grouped_mm experts (the GPU path)
  ours_loop                the same layer with the per-expert loop fallback
  textbook_loop            `for e in range(E): where(topk == e)`, one nn.Linear SwiGLU per expert
  transformers             Qwen3MoeSparseMoeBlock, its default (eager) experts
  transformers_grouped_mm  the same with config._experts_implementation = "grouped_mm"
  dense_same_flops         a dense SwiGLU over the N k routed rows with one expert's weights: the
                           same matmul FLOPs without routing, a ceiling for the expert compute
  expert_gemms_alone       the N k rows split evenly over the E experts (perfect balance, no
                           router, sort, padding or combine) through one batched GEMM per
                           projection: the floor of any grouped expert computation here, whose
                           gap to dense_same_flops is the per-expert GEMMs' own cost
  <ours variant>_baseline  with --baseline-tree DIR: that variant with the MoE layer of another
                           checkout (`git archive <commit> | tar -x -C DIR`), same weights: a
                           change measured against its baseline in one run
The variants step in turn, round after round (one warm-up round, then --repeats), so a drift in
the machine's speed reaches all of them alike; each reports its median step and its median
speed relative to the dense FFN of the same round (parameter gradients cleared each step, as an
optimizer would). Outputs are checked against ours (relative Frobenius error), so a fast wrong
variant would show. The process keeps freed memory for reuse as the trainer does on CPU
(--malloc keep; trainer/cpu_malloc.py): with glibc's defaults every large activation here is
fresh pages, and ours and the dense FFN ran 16-21% slower.

    python bench/moe_layer.py [--tokens 4096] [--experts 64] [--top-k 8] [--d-model 512]
                              [--hidden 256] [--repeats 9] [--device cpu] [--malloc keep]
                              [--dtype auto|bf16|fp32|autocast] [--baseline-tree DIR]
                              [--combine auto|gather]
--dtype autocast keeps weights and input in fp32 and runs the forwards under bf16 autocast, as
trainer.precision=bf16 does (the GPU runs). --combine gather takes the combine that CUDA runs (a
gather, a product and a sum) on CPU too, where "auto" takes embedding_bag (model/moe/slots.py).
Writes bench/results/moe_layer_<device>[_fp32|_autocast].json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.machine import machine
from model import FFNConfig, ModelConfig, MoEConfig
from model.moe import MoE
from parallel.precision import compute_dtype, resolve_precision
from trainer.cpu_malloc import keep_freed_memory


def build_ours(args: argparse.Namespace, dtype: torch.dtype, package=None) -> MoE:
    """The MoE layer (of `package`, a baseline checkout's `model` modules, when given)."""
    pkg = package or SimpleNamespace(
        ModelConfig=ModelConfig, FFNConfig=FFNConfig, MoEConfig=MoEConfig, MoE=MoE
    )
    cfg = pkg.ModelConfig(
        vocab_size=64,
        d_model=args.d_model,
        n_layers=1,
        ffn=pkg.FFNConfig(hidden=args.hidden),
        moe=pkg.MoEConfig(
            n_routed_experts=args.experts, top_k=args.top_k, expert_hidden=args.hidden
        ),
    )
    torch.manual_seed(0)
    layer = pkg.MoE(cfg, layer_id=0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.05)
    return layer.to(args.device, dtype)


def baseline_package(tree: str) -> SimpleNamespace:
    """ModelConfig, FFNConfig, MoEConfig and MoE of the checkout at `tree`, imported beside this
    one: this tree's `model` modules leave sys.modules while that tree's import, and come back
    after (the baseline's classes keep their own modules)."""
    ours = {n: m for n, m in sys.modules.items() if n == "model" or n.startswith("model.")}
    for name in ours:
        del sys.modules[name]
    sys.path.insert(0, str(Path(tree).resolve()))
    try:
        import model as theirs
        from model.moe import MoE as their_moe

        assert Path(theirs.__file__).resolve().is_relative_to(Path(tree).resolve()), tree
        return SimpleNamespace(
            ModelConfig=theirs.ModelConfig,
            FFNConfig=theirs.FFNConfig,
            MoEConfig=theirs.MoEConfig,
            MoE=their_moe,
            slots=sys.modules["model.moe.slots"],
        )
    finally:
        sys.path.pop(0)
        for name in [n for n in sys.modules if n == "model" or n.startswith("model.")]:
            del sys.modules[name]
        sys.modules.update(ours)


class TextbookMoE(nn.Module):
    """The loop every tutorial writes: one SwiGLU module per expert, `where` over the top-k ids."""

    def __init__(self, ours: MoE) -> None:
        super().__init__()
        self.router = ours.router  # the same routing as ours; only the expert compute differs
        self.experts = nn.ModuleList()
        for w_gate, w_up, w_down in zip(
            ours.experts.w_gate, ours.experts.w_up, ours.experts.w_down
        ):
            expert = nn.ModuleDict(
                {
                    "gate": nn.Linear(w_gate.shape[0], w_gate.shape[1], bias=False),
                    "up": nn.Linear(w_gate.shape[0], w_gate.shape[1], bias=False),
                    "down": nn.Linear(w_gate.shape[1], w_gate.shape[0], bias=False),
                }
            )
            with torch.no_grad():
                expert["gate"].weight.copy_(w_gate.T)
                expert["up"].weight.copy_(w_up.T)
                expert["down"].weight.copy_(w_down.T)
            self.experts.append(expert.to(w_gate.dtype))

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        routing = self.router(flat)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token_idx, slot = torch.where(routing.topk_idx == e)
            if token_idx.numel() == 0:
                continue
            h = flat[token_idx]
            y = expert["down"](F.silu(expert["gate"](h)) * expert["up"](h))
            weight = routing.topk_weight[token_idx, slot, None].to(y.dtype)
            out.index_add_(0, token_idx, y * weight)
        return out.view(B, T, C)


def build_transformers(ours: MoE, implementation: str | None) -> nn.Module:
    from transformers import Qwen3MoeConfig
    from transformers.utils import logging

    logging.set_verbosity_error()  # its note that a standalone block uses the default experts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    e = ours.experts
    E, C, F_ = e.w_gate.shape
    cfg = Qwen3MoeConfig(
        hidden_size=C,
        moe_intermediate_size=F_,
        num_experts=E,
        num_experts_per_tok=ours.top_k,
        norm_topk_prob=True,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    cfg._experts_implementation = implementation
    block = Qwen3MoeSparseMoeBlock(cfg).to(e.w_gate.device, e.w_gate.dtype)
    with torch.no_grad():
        block.gate.weight.copy_(ours.router.gate.weight)
        block.experts.gate_up_proj.copy_(torch.cat([e.w_gate, e.w_up], dim=2).transpose(1, 2))
        block.experts.down_proj.copy_(e.w_down.transpose(1, 2))
    return block


class DenseSameFlops(nn.Module):
    """A dense SwiGLU over the N k routed token copies with expert 0's weights (no routing)."""

    def __init__(self, ours: MoE) -> None:
        super().__init__()
        e = ours.experts
        self.top_k = ours.top_k
        self.w_gate, self.w_up, self.w_down = (
            nn.Parameter(w[0].detach().clone()) for w in (e.w_gate, e.w_up, e.w_down)
        )

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1]).repeat_interleave(self.top_k, dim=0)
        y = (F.silu(rows @ self.w_gate) * (rows @ self.w_up)) @ self.w_down
        return y.view(*x.shape[:-1], self.top_k, -1).sum(dim=-2)


class ExpertGemmsAlone(DenseSameFlops):
    """The N k token copies dealt evenly to the E experts (row r to expert r // (N k / E)), each
    expert's SwiGLU through batched GEMMs over (E, N k / E, C): no routing at all."""

    def __init__(self, ours: MoE) -> None:
        nn.Module.__init__(self)
        e = ours.experts
        self.top_k = ours.top_k
        self.w_gate, self.w_up, self.w_down = (
            nn.Parameter(w.detach().clone()) for w in (e.w_gate, e.w_up, e.w_down)
        )

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1]).repeat_interleave(self.top_k, dim=0)
        grouped = rows.view(self.w_gate.shape[0], -1, rows.shape[-1])  # (E, N k / E, C)
        h = F.silu(torch.bmm(grouped, self.w_gate)) * torch.bmm(grouped, self.w_up)
        y = torch.bmm(h, self.w_down).view(-1, self.top_k, x.shape[-1])
        return y.sum(dim=-2).view(x.shape)


def one_step(
    fn: nn.Module, x: Tensor, grad: Tensor, device: str, autocast: bool = False
) -> tuple[float, Tensor]:
    """Seconds of one forward + backward (gradients cleared first, as an optimizer would);
    `autocast`: the forward under bf16 autocast (the gradient cast to the output's dtype)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    x.grad = None
    fn.zero_grad(set_to_none=True)
    sync()
    start = time.perf_counter()
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        out = fn(x)
    out.backward(grad.to(out.dtype))
    sync()
    return time.perf_counter() - start, out.detach()


def interleaved_times(
    variants: dict[str, tuple[nn.Module, Callable[[], None]]],
    x: Tensor,
    grad: Tensor,
    repeats: int,
    device: str,
    autocast: bool = False,
) -> tuple[dict[str, list[float]], dict[str, Tensor]]:
    """Every variant steps once per round, round after round (the first round warms up), so a
    drift in the machine's speed reaches all of them alike. variants: name -> (module, a call
    that prepares it, e.g. sets the experts' impl)."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    outs: dict[str, Tensor] = {}
    for step in range(repeats + 1):
        for name, (module, prepare) in variants.items():
            prepare()
            seconds, outs[name] = one_step(module, x, grad, device, autocast)
            if step:
                times[name].append(seconds)
    return times, outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--variants",
        default="ours,ours_grouped_mm,ours_padded_bmm,ours_threaded_mm,ours_loop,textbook_loop,transformers,"
        "transformers_grouped_mm,dense_same_flops,expert_gemms_alone",
    )
    parser.add_argument(
        "--out", default="", help="JSON path (default results/moe_layer_<device>.json)"
    )
    parser.add_argument(
        "--malloc",
        default="keep",
        choices=("keep", "system"),
        help="keep: glibc keeps freed blocks, as the trainer sets it on CPU (trainer/cpu_malloc.py)",
    )
    # autocast: fp32 weights and input, bf16 compute under autocast (trainer.precision=bf16,
    # the GPU runs' setting)
    parser.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32", "autocast"))
    parser.add_argument(
        "--baseline-tree",
        default="",
        help="a checkout of the baseline (git archive <commit> | tar -x -C DIR): adds the ours*"
        " variants named in --variants again as <name>_baseline, with that tree's MoE layer",
    )
    parser.add_argument("--combine", default="auto", choices=("auto", "gather"))
    args = parser.parse_args()
    if args.malloc == "keep" and args.device == "cpu":
        keep_freed_memory()
    autocast = args.dtype == "autocast"
    if not autocast:
        args.dtype = resolve_precision(args.dtype, torch.device(args.device))
    dtype = torch.float32 if autocast else compute_dtype(args.dtype)
    ours = build_ours(args, dtype)
    variants: dict[str, Callable[[], nn.Module]] = {
        "ours": lambda: ours,
        "ours_grouped_mm": lambda: ours,
        "ours_padded_bmm": lambda: ours,
        "ours_threaded_mm": lambda: ours,
        "ours_loop": lambda: ours,
        "textbook_loop": lambda: TextbookMoE(ours),
        "transformers": lambda: build_transformers(ours, None),  # its default (eager) experts
        "transformers_grouped_mm": lambda: build_transformers(ours, "grouped_mm"),
        "dense_same_flops": lambda: DenseSameFlops(ours),
        "expert_gemms_alone": lambda: ExpertGemmsAlone(ours),
    }
    impls = {
        "ours_grouped_mm": "grouped_mm",
        "ours_padded_bmm": "padded_bmm",
        "ours_threaded_mm": "threaded_mm",
        "ours_loop": "loop",
    }
    theirs, packages = None, [sys.modules["model.moe.slots"]]
    if args.baseline_tree:
        package = baseline_package(args.baseline_tree)
        packages.append(package.slots)
        theirs = build_ours(args, dtype, package)
        theirs.load_state_dict(ours.state_dict())
        for name in [n for n in args.variants.split(",") if n.startswith("ours")]:
            variants[f"{name}_baseline"] = lambda: theirs
            impls[f"{name}_baseline"] = impls.get(name, "auto")
        args.variants += "".join(
            f",{n}_baseline" for n in args.variants.split(",") if n.startswith("ours")
        )
    if args.combine == "gather":  # CUDA's combine, in both trees
        for slots in packages:
            slots.embedding_bag_combines = lambda device_type: False
    g = torch.Generator(device=args.device).manual_seed(1)
    shape = (
        (args.tokens // 256, 256, args.d_model)
        if args.tokens % 256 == 0
        else (1, args.tokens, args.d_model)
    )
    x = torch.randn(shape, generator=g, device=args.device, dtype=dtype, requires_grad=True)
    grad = torch.randn(shape, generator=g, device=args.device, dtype=dtype)
    names = list(dict.fromkeys(args.variants.split(",")))
    if args.device != "cpu":  # the threaded per-expert GEMMs are CPU-only
        names = [name for name in names if name != "ours_threaded_mm"]
    layers = (ours,) if theirs is None else (ours, theirs)

    def prepared(name: str) -> tuple[nn.Module, Callable[[], None]]:
        """The variant's module and a call that sets its experts' impl (ours' for the others)."""
        module = variants[name]()
        layer = module if any(module is m for m in layers) else ours
        return module, lambda: setattr(layer.experts, "impl", impls.get(name, "auto"))

    built = {name: prepared(name) for name in names}
    times, outs = interleaved_times(built, x, grad, args.repeats, args.device, autocast)
    reference = outs[names[0]].float()
    dense = times.get("dense_same_flops")
    rows = []
    for name in names:
        seconds = statistics.median(times[name])
        error = None  # the ceilings compute other functions: only their time matters
        if name not in ("dense_same_flops", "expert_gemms_alone"):
            error = ((outs[name].float() - reference).norm() / reference.norm()).item()
        rows.append(
            {
                "variant": name,
                "ms": seconds * 1e3,
                "tokens_per_s": args.tokens / seconds,
                "rel_error_vs_ours": error,
                # the median over rounds of (dense step / this step): the speed relative to the
                # dense FFN, paired within each round
                "vs_dense": (
                    statistics.median(d / t for d, t in zip(dense, times[name])) if dense else None
                ),
                "all_ms": [t * 1e3 for t in times[name]],
            }
        )
        print(
            f"{name:26s} {seconds * 1e3:9.1f} ms  {args.tokens / seconds:9.0f} tokens/s  err "
            + ("-" if error is None else f"{error:.1e}"),
            flush=True,
        )
    base = next((r for r in rows if r["variant"] == "ours"), rows[0])  # else the first named
    for row in rows:
        row["ours_speedup"] = row["ms"] / base["ms"]
        # the median over rounds of (this step / ours in the same round): paired, so a drift in
        # the machine's speed between rounds cancels
        row["time_vs_ours_paired"] = statistics.median(
            t / o for t, o in zip(row["all_ms"], base["all_ms"])
        )
    print(
        f"\n{'variant':26s} {'ms':>9s} {'tokens/s':>10s} {'ours is x faster':>17s} {'vs dense':>9s}"
        f" {'time / ours, paired':>20s}"
    )
    for row in rows:
        vs_dense = "-" if row["vs_dense"] is None else f"{row['vs_dense']:.2f}"
        print(
            f"{row['variant']:26s} {row['ms']:9.1f} {row['tokens_per_s']:10.0f} "
            f"{row['ours_speedup']:17.2f} {vs_dense:>9s} {row['time_vs_ours_paired']:20.3f}"
        )
    by_name = {row["variant"]: row for row in rows}
    for row in rows:  # --baseline-tree: the change's time over its baseline's, round by round
        change = by_name.get(row["variant"].removesuffix("_baseline"))
        if row["variant"].endswith("_baseline") and change is not None:
            ratio = statistics.median(t / b for t, b in zip(change["all_ms"], row["all_ms"]))
            change["time_vs_baseline_paired"] = ratio
            print(f"{change['variant']:26s} time / its baseline's, paired: {ratio:.3f}")
    report = {
        "benchmark": "moe_layer",
        "args": vars(args),
        "dtype": args.dtype,
        "machine": machine(
            ("torch", "transformers"),
            torch_threads=torch.get_num_threads(),
            load_average=os.getloadavg(),
        ),
        "rows": rows,
    }
    suffix = {"fp32": "_fp32", "autocast": "_autocast"}.get(args.dtype, "")
    default = Path(__file__).parent / "results" / f"moe_layer_{args.device}{suffix}.json"
    out = Path(args.out or default)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
