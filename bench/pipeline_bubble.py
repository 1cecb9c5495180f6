"""Bubble fraction of every pipeline schedule (parallel.pp) on gloo CPU ranks against its
theoretical value, and the activation memory each stage keeps.

    python bench/pipeline_bubble.py                      # pp 2 (and 4 where the cores allow)
    python bench/pipeline_bubble.py --pp 2 --m 4 8 --steps 4

Each (schedule, pp, m) builds the trainer's pipeline engine (trainer.build.build_training_engine,
fp32) over pp gloo ranks of one torch thread each (one rank per core: pp values above the cores
are skipped, since ranks sharing a core would count each other's work as bubble) and takes
--warmup + --steps steps with trainer.step.train_step. The stage methods of torch's
PipelineStage (forward_one_chunk, backward_one_chunk, backward_weight_one_chunk) are wrapped here
to time each action; per rank and timed step, busy = the sum of their durations and span = the
engine's forward_backward_step (the schedule plus the loss broadcast that ends it on every rank),
bubble = 1 - busy / span. Gloo point-to-point waits, Python scheduling and the loss broadcast
count as idle.

Besides the papers' formulas (`theory`), the schedule's own action order, as each rank ran it
(the multi-stage schedules' `pipeline_order`; torch's `pipeline_order` of 1F1B is only a drawing
and does not match what it runs), is replayed without communication (`replay`): once with equal
times (F = I = W = 1, a full backward B = 2: the papers' assumption) and once with this run's
mean time of each action per stage.

Memory: torch has no CPU allocator statistics, and the process RSS high-water mark mixes weights,
gradients, optimizer state and allocator caching. Measured instead: the bytes autograd saves for
backward (saved_tensors_hooks during each stage's forward; each storage once, weights apart),
live from the forward that saves them until autograd frees them (after the full backward, or
after the weight pass of a split one); the peak over the step per stage and per rank (its stages
together). That is what the schedules differ in: how many micro-batches' activations a stage
holds at once. Writes bench/results/pipeline_bubble_cpu.json (the default run) or
pipeline_bubble_cpu_partial.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from statistics import fmean

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import save_result
from bench.ranks import run_on_ranks
from model.stages import MULTI_STAGE, SCHEDULES

MULTI = set(MULTI_STAGE)  # 2 stages per rank (parallel.pp_stages_per_rank's default)
# tiny with 8 blocks, a small vocabulary so the head adds little to the last stage (equal stages)
MODEL = {"n_layers": 8, "vocab_size": 512, "max_seq_len": 128}
SEQ, ROWS = 128, 2  # each micro-batch: 2 sequences of 128 tokens
NOTES = [
    "busy = time inside PipelineStage.forward_one_chunk / backward_one_chunk / "
    "backward_weight_one_chunk; gloo point-to-point waits, Python scheduling and the closing "
    "loss broadcast count as idle",
    "theory: the papers' formula with equal stage times (F = I = W for the zero-bubble ones); "
    "replay_equal: each rank's action order as it ran, replayed without communication at "
    "F = I = W = 1, B = 2; "
    "replay_measured: the same order at this run's mean time per (stage, action)",
    "torch's split backward on stage 0 does the whole backward in W (its I has no input "
    "gradient to compute), which replay_measured includes and the formulas do not",
    "activation bytes: tensors autograd saves for backward (each storage once, weights apart), "
    "peak of the live sum during a step; p2p buffers, gradients and optimizer state are not in it",
    "the counting hooks run inside the timed forwards (a few Python calls per saved tensor)",
    "the ranks share the machine with whatever else runs on it: see load_average_before_after",
]


# -- theory -------------------------------------------------------------------------------------
def theory(schedule: str, p: int, m: int, v: int) -> float:
    """The bubble fraction (idle share of the step) the papers give, equal stage times."""
    if schedule in ("GPipe", "1F1B"):
        # GPipe (Huang et al. 2019, arXiv:1811.06965) and 1F1B / PipeDream-Flush (Narayanan et
        # al. 2021, arXiv:2104.04473 section 2.2.1: bubble (p - 1) / m of the ideal time): p - 1
        # fill + drain slots of the step's m + p - 1
        return (p - 1) / (m + p - 1)
    if schedule in ("Interleaved1F1B", "LoopedBFS"):
        # interleaved: arXiv:2104.04473 section 2.2.2, bubble (p - 1) / (v m) of the ideal time,
        # i.e. (p - 1) / (v m + p - 1) of the step. Looped BFS (Lamy-Poirier 2023,
        # arXiv:2211.05953): all m micro-batches through a rank's first stage, then its next;
        # with m >= p the loop never waits, so the fill and the drain are p - 1 chunk slots of
        # v m per rank, the same fraction
        return (p - 1) / (v * m + p - 1)
    if schedule == "InterleavedZeroBubble":
        # ZB-H1 (Qi et al. 2023, arXiv:2401.10241 section 3.1): bubble (p - 1)(T_F + T_B - T_W)
        # against 1F1B's (p - 1)(T_F + T_B + T_W); per chunk of a v-chunk rank, with T_F = T_B
        # (input) = T_W: (p - 1) chunk times in 3 v m of work
        return (p - 1) / (3 * v * m + p - 1)
    if schedule == "ZBVZeroBubble":
        # ZB-V (arXiv:2401.10241 section 6; torch's ScheduleZBVZeroBubble docstring): zero
        # bubble only when T_F = T_B (input) = T_W
        return 0.0
    if schedule == "DualPipeV":
        # DeepSeek-V3 report (arXiv:2412.19437 table 2) and github.com/deepseek-ai/DualPipe's
        # README (DualPipeV, the V half of DualPipe on PP/2 ranks): bubble
        # (PP/2 - 1)(F&B + B - 3W) with PP = 2p stages, B a full backward; here forward and
        # backward run one after the other (F&B = F + B): with F = I = W = t that is 2 (p - 1) t
        # against 2 chunks x m x 3t of work per rank
        return (p - 1) / (3 * m + p - 1)
    raise ValueError(schedule)


def replay(order: dict[int, list[tuple[int, str, int]]], times) -> dict[int, float]:
    """Each rank's bubble when it runs its actions (stage, kind, micro-batch) in `order` as
    soon as their inputs exist, without communication; times(stage, kind) -> seconds."""
    done: dict[tuple[int, str, int], float] = {}
    clock = dict.fromkeys(order, 0.0)
    busy = dict.fromkeys(order, 0.0)
    next_ = dict.fromkeys(order, 0)
    last_stage = max(s for actions in order.values() for s, _, _ in actions)
    while any(next_[r] < len(order[r]) for r in order):
        moved = False
        for rank, actions in order.items():
            while next_[rank] < len(actions):
                stage, kind, mb = actions[next_[rank]]
                ready = _ready(done, stage, kind, mb, last_stage)
                if ready is None:
                    break
                start = max(clock[rank], ready)
                clock[rank] = done[stage, kind, mb] = start + times(stage, kind)
                busy[rank] += times(stage, kind)
                next_[rank] += 1
                moved = True
        if not moved:
            raise RuntimeError("the replayed order waits on itself")
    span = max(clock.values())
    return {rank: 1 - busy[rank] / span for rank in order}


def _ready(done: dict, stage: int, kind: str, mb: int, last: int) -> float | None:
    """When (stage, kind, mb)'s inputs exist; None while one is missing."""
    needs = []
    if kind == "F" and stage > 0:
        needs = [(stage - 1, "F", mb)]
    elif kind in ("B", "I"):
        needs = [(stage, "F", mb)]
        if stage < last:  # the gradient from the next stage: its full or input backward
            after = (stage + 1, "B", mb) if (stage + 1, "B", mb) in done else (stage + 1, "I", mb)
            needs.append(after)
    elif kind == "W":
        needs = [(stage, "I", mb)]
    if any(n not in done for n in needs):
        return None
    return max((done[n] for n in needs), default=0.0)


# -- recording (this benchmark's ranks only) ----------------------------------------------------
class Recorder:
    """(stage, kind, micro-batch, start, end) of every stage action; live saved bytes."""

    def __init__(self) -> None:
        self.actions: list[tuple[int, str, int, float, float]] = []
        self.live: dict[int, int] = defaultdict(int)
        self.peak: dict[int, int] = defaultdict(int)
        self.live_rank = self.peak_rank = 0
        self.storages: dict[int, list[int]] = {}  # data_ptr -> [references, bytes]

    def reset(self) -> None:
        self.actions.clear()
        self.peak = defaultdict(int, self.live)
        self.peak_rank = self.live_rank

    def pack(self, stage: int):
        def pack(t: torch.Tensor):
            base = t._base if t._base is not None else t
            if isinstance(base, torch.nn.Parameter):
                return t
            return _Saved(self, stage, t)

        return pack

    def add(self, stage: int, key: int, nbytes: int, sign: int) -> None:
        entry = self.storages.setdefault(key, [0, nbytes])
        entry[0] += sign
        if (sign > 0 and entry[0] == 1) or (sign < 0 and entry[0] == 0):
            self.live[stage] += sign * entry[1]
            self.live_rank += sign * entry[1]
            self.peak[stage] = max(self.peak[stage], self.live[stage])
            self.peak_rank = max(self.peak_rank, self.live_rank)
        if entry[0] == 0:
            del self.storages[key]


class _Saved:
    """A saved tensor that counts its storage as live until autograd drops it."""

    def __init__(self, recorder: Recorder, stage: int, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        # detached: holding t itself (a saved output holds its grad_fn, which holds this)
        # would make a cycle the autograd graph never frees after a split backward
        self.recorder, self.stage, self.tensor = recorder, stage, t.detach()
        self.key = storage.data_ptr()
        recorder.add(stage, self.key, storage.nbytes(), +1)

    def __del__(self) -> None:
        self.recorder.add(self.stage, self.key, 0, -1)


def _unpack(saved):
    return saved.tensor if isinstance(saved, _Saved) else saved


RECORDER = Recorder()


def _timed(method, kind_of):
    def wrapper(self, *args, **kwargs):
        kind = kind_of(kwargs)
        mb = args[0] if args else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id"))
        start = time.perf_counter()
        if kind == "F":
            with torch.autograd.graph.saved_tensors_hooks(RECORDER.pack(self.stage_index), _unpack):
                out = method(self, *args, **kwargs)
        else:
            out = method(self, *args, **kwargs)
        RECORDER.actions.append((self.stage_index, kind, mb, start, time.perf_counter()))
        return out

    return wrapper


def patch_stages() -> None:
    PipelineStage.forward_one_chunk = _timed(PipelineStage.forward_one_chunk, lambda kw: "F")
    PipelineStage.backward_one_chunk = _timed(
        PipelineStage.backward_one_chunk, lambda kw: "B" if kw.get("full_backward", True) else "I"
    )
    PipelineStage.backward_weight_one_chunk = _timed(
        PipelineStage.backward_weight_one_chunk, lambda kw: "W"
    )


# -- one configuration on every rank ------------------------------------------------------------
def build(schedule: str, p: int, m: int):
    """The trainer's pipeline engine for this rank (fp32, eager, equal stages)."""
    from model.presets import load_preset
    from optim.config import OptimConfig
    from parallel.config import ParallelConfig
    from parallel.mesh import ParallelDims
    from trainer.build import build_training_engine
    from trainer.config import TrainerConfig

    v = 2 if schedule in MULTI else 1
    layers = [MODEL["n_layers"] // (p * v)] * (p * v)  # equal stages
    pcfg = ParallelConfig(pp=p, pp_schedule=schedule, pp_microbatches=m, pp_layers=layers)
    tcfg = TrainerConfig(
        precision="fp32", batch_size=m * ROWS, micro_batch_size=ROWS, compile=False
    )  # eager: the stage actions as the tests run them
    dims = ParallelDims.resolve(pcfg, p)
    cfg = load_preset("tiny", MODEL)
    return build_training_engine(cfg, tcfg, pcfg, OptimConfig(), dims, torch.device("cpu"), 0)


def measure(rank: int, world: int, schedule: str, m: int, steps: int, warmup: int) -> dict:
    """Every rank's bubble, mean action times, activation peaks and action order."""
    from data.loader import Batch
    from trainer.hooks import start_hooks
    from trainer.step import LossTracker, StepSettings, train_step

    engine = build(schedule, world, m)
    RECORDER.__init__()  # (this configuration's stages only)
    spans: list[tuple[float, float]] = []
    engine.forward_backward_step = _spanned(engine.forward_backward_step, spans)
    hooks, tracker = start_hooks(engine, 0.0, None), LossTracker(0.0)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MODEL["vocab_size"], (m * ROWS, SEQ + 1), generator=generator)
    batch = Batch(tokens[:, :-1], tokens[:, 1:], torch.zeros_like(tokens[:, 1:]))
    steps_seen = []
    for step in range(warmup + steps):
        dist.barrier()  # (every rank enters the step together: the fill is the schedule's)
        RECORDER.reset()
        spans.clear()
        train_step(engine, batch, StepSettings(micro_batches=m, grad_clip=1.0), tracker, hooks)
        if step >= warmup:
            steps_seen.append((spans[0], list(RECORDER.actions), dict(RECORDER.peak)))
            steps_seen[-1][2]["rank"] = RECORDER.peak_rank
    every: list = [None] * world
    dist.all_gather_object(every, _rank_summary(steps_seen))
    return {"ranks": every}


def _spanned(method, spans: list):
    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = method(*args, **kwargs)
        spans.append((start, time.perf_counter()))
        return out

    return timed


def _rank_summary(steps_seen: list) -> dict:
    """This rank's mean bubble and action times over the timed steps, its activation peaks,
    and the last step's action order."""
    bubbles, durations, peaks = [], defaultdict(list), defaultdict(int)
    for (start, end), actions, step_peaks in steps_seen:
        for stage, kind, _, a, b in actions:
            durations[stage, kind].append(b - a)
        bubbles.append(1 - sum(b - a for *_, a, b in actions) / (end - start))
        for key, peak in step_peaks.items():
            peaks[key] = max(peaks[key], peak)
    return {
        "bubble": fmean(bubbles),
        "durations": {key: fmean(d) for key, d in durations.items()},
        "peak_rank": peaks.pop("rank"),
        "peak_stage": dict(peaks),
        "order": [(stage, kind, mb) for stage, kind, mb, _, _ in steps_seen[-1][1]],
    }


def bench_ranks(rank: int, world: int, configs: list, steps: int, warmup: int) -> list:
    torch.set_num_threads(1)
    patch_stages()
    return [measure(rank, world, schedule, m, steps, warmup) for schedule, m in configs]


# -- main ---------------------------------------------------------------------------------------
def summarize(schedule: str, p: int, m: int, result: dict) -> dict:
    v = 2 if schedule in MULTI else 1
    ranks = result["ranks"]
    order = {rank: r.pop("order") for rank, r in enumerate(ranks)}
    times = {k: t for r in ranks for k, t in r["durations"].items()}
    equal = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}
    bubbles = [r["bubble"] for r in ranks]
    replay_equal = replay(order, lambda s, k: equal[k])
    replay_measured = replay(order, lambda s, k: times[s, k])
    return {
        "schedule": schedule,
        "pp": p,
        "microbatches": m,
        "stages_per_rank": v,
        "bubble_mean": fmean(bubbles),
        "bubble_max": max(bubbles),
        "bubble_per_rank": bubbles,
        "theory": theory(schedule, p, m, v),
        "replay_equal_mean": fmean(replay_equal.values()),
        "replay_measured_mean": fmean(replay_measured.values()),
        "action_seconds": {f"{s}{k}": t for (s, k), t in sorted(times.items())},
        "activation_bytes_per_stage": {
            s: b for r in ranks for s, b in sorted(r["peak_stage"].items())
        },
        "activation_bytes_per_rank": [r["peak_rank"] for r in ranks],
    }


def print_row(row: dict) -> None:
    mib = [b / 2**20 for _, b in sorted(row["activation_bytes_per_stage"].items())]
    print(
        f"{row['schedule']:<22} {row['pp']:>2} {row['microbatches']:>3} {row['stages_per_rank']:>3}"
        f" {row['bubble_mean']:>8.3f} {row['bubble_max']:>6.3f} {row['theory']:>7.3f}"
        f" {row['replay_equal_mean']:>7.3f} {row['replay_measured_mean']:>7.3f}   "
        + " ".join(f"{x:.1f}" for x in mib)
    )


def parse(argv: list[str]) -> tuple[argparse.Namespace, bool]:
    """The options, and whether they are the defaults (the run whose JSON is the result)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--m", type=int, nargs="+", default=[4, 8], help="micro-batches")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    parser.add_argument("--steps", type=int, default=6, help="timed steps (their mean counts)")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    return args, vars(args) == vars(parser.parse_args([]))


def main(argv: list[str]) -> int:
    args, default = parse(argv)
    cores = len(os.sched_getaffinity(0))
    run, skipped = [p for p in args.pp if p <= cores], [p for p in args.pp if p > cores]
    notes = [*NOTES] + [f"pp {skipped} skipped: {cores} cores, one rank per core"] * bool(skipped)
    load_before = os.getloadavg()
    print(f"{cores} cores, {len(run)} pp size(s) run, ranks of 1 torch thread; load {load_before}")
    print(f"tiny {MODEL}, fp32, seq {SEQ}, {ROWS} sequences per micro-batch, equal stages")
    print(f"{args.warmup} warm-up + {args.steps} timed steps per row; bubble = mean over ranks")
    print(
        f"{'schedule':<22} {'p':>2} {'m':>3} {'v':>3} {'bubble':>8} {'max':>6} {'theory':>7}"
        f" {'r_equal':>7} {'r_meas':>7}   saved activations MiB per stage (peak)"
    )
    rows = []
    for p in run:
        configs = [(s, m) for s in args.schedules for m in args.m]
        results = run_on_ranks(p, p, bench_ranks, configs, args.steps, args.warmup)
        for (schedule, m), result in zip(configs, results):
            rows.append(summarize(schedule, p, m, result))
            print_row(rows[-1])
    for note in notes:
        print(f"note: {note}")
    config = {"preset": "tiny", "overrides": MODEL, "precision": "fp32", "seq_len": SEQ}
    config |= {"sequences_per_microbatch": ROWS, "pp_layers": "n_layers / stages, each"}
    config |= {"threads_per_rank": 1, "warmup_steps": args.warmup, "timed_steps": args.steps}
    body = {
        "command": " ".join(["python bench/pipeline_bubble.py", *argv]),
        "config": config | {"pp_run": run, "pp_skipped": skipped},
        "load_average_before_after": [load_before, os.getloadavg()],
        "notes": notes,
        "rows": rows,
    }
    save_result("pipeline_bubble_cpu.json" if default else "pipeline_bubble_cpu_partial.json", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
