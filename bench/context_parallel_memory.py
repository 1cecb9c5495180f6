"""Activation memory, bytes sent and step time per rank against the context-parallel size (model
level: parallel/context_parallel.py apply_context_parallel, as parallel.cp applies it).

    python bench/context_parallel_memory.py            # T=4096, cp = 1, 2, 4
    python bench/context_parallel_memory.py --seq-len 2048 --cp 1 2

For each preset (tiny, tiny_hybrid at d_model 128) and cp: one fp32 training forward + backward
of a (1, T) packed row on cp gloo ranks; per rank, the bytes the forward keeps for backward
(saved-tensor hooks, each storage once, weights apart) and the forward + backward seconds (the
slowest rank; the ranks share the machine's cores, so compare only within one run); the bytes a
rank sends over the cp group (each all-gather and reduce-scatter counted as it runs: (cp - 1) /
cp of the whole tensor) against the planner's comm_cp (model/planner_context.py: the gathered
keys/values and delta-rule state maps; the conv halos are not in it), and the planner's
activation figure (it assumes the Triton kernel; this CPU run takes SDPA with a mask, which
keeps more). Writes bench/results/context_parallel_memory_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import machine
from bench.ranks import run_on_ranks
from bench.sent_bytes import SentBytes

PRESETS = {
    "tiny": {"n_layers": 4},
    "tiny_hybrid": {"n_layers": 4, "gdn.head_dim": 32, "gdn.v_head_dim": 32},
}
COMMON = {"vocab_size": 512, "d_model": 128, "attention.n_heads": 4, "attention.n_kv_heads": 2}


def saved_bytes(run) -> tuple[int, object]:
    """Bytes of the distinct storages autograd saves during `run()` (parameters apart)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(seen.values()), out


def planned(preset: str, cp: int, seq_len: int) -> dict:
    from model.planner import Layout, rank_plan
    from model.presets import load_preset
    from model.transformer import build_model

    overrides = COMMON | PRESETS[preset] | {"max_seq_len": seq_len}
    model = build_model(load_preset(preset, overrides), device="meta")
    plan = rank_plan(model, Layout(cp=cp, seq_len=seq_len))
    return {"planned_activation_bytes": plan.activations, "planned_sent_bytes": plan.comm_cp}


def one_step(rank: int, world: int, preset: str, seq_len: int) -> dict:
    from model.presets import load_preset
    from model.transformer import build_model
    from parallel.context_parallel import apply_context_parallel

    overrides = COMMON | PRESETS[preset] | {"max_seq_len": seq_len}
    model = build_model(load_preset(preset, overrides), seed=0)
    if world > 1:
        apply_context_parallel(model, dist.group.WORLD)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (1, seq_len + 1), generator=generator)
    docs = (torch.arange(seq_len) * 5 // seq_len)[None]  # 5 packed documents
    sent = SentBytes(world)
    start = time.perf_counter()
    with sent.mode:
        kept, loss = saved_bytes(lambda: model(tokens[:, :-1], tokens[:, 1:], doc_ids=docs))
        loss.backward()
    seconds = time.perf_counter() - start
    stats = torch.tensor([float(kept), seconds, sent.sent])
    if world > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return {
        "activation_bytes": int(stats[0]),
        "seconds": float(stats[1]),
        "sent_bytes": int(stats[2]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--cores", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for preset in PRESETS:
        for cp in args.cp:
            result = run_on_ranks(cp, args.cores, one_step, preset, args.seq_len)
            result |= planned(preset, cp, args.seq_len)
            rows.append({"preset": preset, "cp": cp, **result})
            base = next(r for r in rows if r["preset"] == preset and r["cp"] == args.cp[0])
            ratio = result["activation_bytes"] / base["activation_bytes"]
            print(
                f"{preset:12s} cp={cp}  activations {result['activation_bytes'] / 2**20:8.1f} MiB"
                f" ({ratio:.2f} of cp={args.cp[0]}; planned {result['planned_activation_bytes'] / 2**20:.1f})"
                f"  sent {result['sent_bytes'] / 2**20:.2f} MiB (planned "
                f"{result['planned_sent_bytes'] / 2**20:.2f})  step {result['seconds']:.2f} s"
            )
    out = ROOT / "bench" / "results" / "context_parallel_memory_cpu.json"
    record = {
        "benchmark": out.name,
        "machine": machine(),
        "command": "python bench/context_parallel_memory.py " + " ".join(sys.argv[1:]),
        "seq_len": args.seq_len,
        "model": COMMON,
        "rows": rows,
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
