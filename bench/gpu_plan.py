"""The GPU session's plan: what one short GPU session measures, ordered by value, each case with
its own time cap, the results saved after every case (a case that fails, hangs or runs out of
time leaves the others'), and a second call that resumes where the first stopped.

    python bench/gpu_plan.py [--out DIR] [--budget-s 690] [--only NAME ...] [--resume [JSON]]
                             [--state PATH] [--list] [--dry-run]

Each case runs bench/gpu_check.py's checks (or the `gpu` test tier) in a process of its own,
killed with its process group at the case's cap, so one slow compile or a broken CUDA context
costs only that case. A case starts only when its expected time fits the time left. DIR
(default /tmp/gpu_out, or $OUT) receives gpu_session.json (every case's status, seconds and
numbers, the comparisons against the baselines of the same session and the issue's targets),
cases/NAME.json and logs/NAME.log. `--resume` keeps the cases of DIR/gpu_session.json that
finished and runs the rest: a session split over two device calls (each at most 10 minutes)
or rerun after a failure.

`--dry-run` runs every case's code on CPU on tiny shapes, in this process (no numbers worth
keeping): CI runs it (tests/test_bench_gpu_session.py) so that the plan cannot rot.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECK = ["bench/gpu_check.py"]


@dataclass(frozen=True)
class Case:
    """One entry of the plan: `args` for bench/gpu_check.py (or a whole command when `command`),
    `need_s` the time it is expected to take on an H100/H200 (it starts only if that much is
    left), `cap_s` the most it may take."""

    name: str
    args: tuple[str, ...]
    need_s: float
    cap_s: float
    why: str
    command: bool = False


def train(name: str, need_s: float, cap_s: float, why: str) -> Case:
    return Case(name, ("--only", "train_mfu", "--train-cases", name), need_s, cap_s, why)


GPU_TESTS = ("-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-q", "--durations=15")
GPU_TESTS += ("tests/model/test_gpu.py",)

# ordered by value: the regression guard and the targets first, what was measured before last
PLAN = (
    train("dense_1b", 35, 120, "regression guard: ~1B dense bf16, >= 50% MFU; the baseline"),
    train("moe_fine", 60, 180, "fine-grained MoE filling one GPU: >= 35% MFU on active FLOPs"),
    Case("attention", ("--only", "flash_attention"), 100, 240,
         "our FlashAttention kernel vs cuDNN / FA2 / Flex: <= 1.2x cuDNN at T 4096 D 128"),
    train("moe", 40, 120, "the 1.2B MoE of the first runs (16.4% MFU before two fixes)"),
    train("dense_1b_float8_tensorwise", 45, 150, "float8 vs bf16: >= 1.2x tokens/s, same losses"),
    train("hybrid_1b", 50, 150, "Gated DeltaNet 3:1 hybrid, torch delta rule: <= 1.15x dense"),
    train("attnres_1b", 40, 120, "Block AttnRes: <= 1.15x the dense step"),
    train("mhc_1b", 40, 120, "mHC: <= 1.3x the dense step"),
    train("engram_1b", 45, 120, "Engram in 2 of 16 blocks: <= 1.15x the dense step"),
    train("dense_1b_32k", 50, 150, "T 32k, selective activation checkpointing: >= 40% MFU"),
    train("hybrid_1b_fla", 90, 180, "the hybrid on fla-core's kernels (where its triton is trusted)"),
    Case("gpu_tests", GPU_TESTS, 150, 300, "the gpu test tier: kernels and 2026 presets on CUDA",
         command=True),
    train("moe_float8_rowwise", 45, 150, "float8 rowwise on the 1.2B MoE's experts"),
    train("dense_1b_float8_rowwise", 45, 150, "float8 rowwise vs tensorwise"),
    train("dense_1b_float8_mxfp8", 45, 150, "MXFP8 (SM100 only; skipped with the reason)"),
    train("dense_1b_muonclip_triton", 35, 120, "QK-clip's max logits from the kernel"),
    train("dense_1b_muonclip_sdpa", 35, 120, "QK-clip's max logits recomputed after SDPA"),
    Case("fused_kernels", ("--only", "fused_kernels", "fused_cross_entropy_memory"), 30, 120,
         "RMSNorm / RoPE / SwiGLU kernels, head + cross-entropy memory"),
    Case("delta_rule_fla", ("--only", "delta_rule_fla_vs_torch"), 90, 240,
         "the gated delta rule on fla vs torch, checked and timed"),
    Case("engram_offload", ("--only", "engram_offload"), 20, 90, "Engram tables in host memory"),
)  # fmt: skip
CASES = {case.name: case for case in PLAN}


def run_process(argv: list[str], log: Path, cap_s: float) -> tuple[str, int | None]:
    """Runs argv (cwd: the repository) in its own process group with output to `log`: ("ok" |
    "error" | "timed out", exit code); past cap_s the whole group (compile workers included)
    gets SIGTERM, then SIGKILL."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.Popen(
            argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=cap_s)
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=grace)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
            return "timed out", None
    return ("ok" if code == 0 else "error"), code


def run_case(case: Case, out: Path, cap_s: float, dry_run: bool) -> dict:
    """One case's entry in the session: status, seconds, and its numbers."""
    start = time.monotonic()
    part = out / "cases" / f"{case.name}.json"
    log = out / "logs" / f"{case.name}.log"
    if case.command:
        argv = [sys.executable, *case.args]
        if dry_run:  # CPU: the tier's tests are collected (they skip without CUDA)
            argv += ["--collect-only"]
        status, code = run_process(argv, log, cap_s)
        entry = {"status": status, "exit_code": code}
    elif dry_run:  # in this process: the checks' code paths, without a CUDA machine
        entry = in_process(case, part)
    else:
        argv = [sys.executable, *CHECK, "--strict", "--out", str(part), *case.args]
        argv += ["--budget-s", str(max(cap_s - 15, 10))]  # its optional parts stop in time
        status, code = run_process(argv, log, cap_s)
        entry = {"status": status, "exit_code": code}
        if part.exists():  # written after every check: a killed case keeps what it finished
            entry["result"] = json.loads(part.read_text())["checks"]
    entry["seconds"] = round(time.monotonic() - start, 1)
    if log.exists():
        entry["log_tail"] = log.read_text(errors="replace")[-1500:]
    return entry


def in_process(case: Case, part: Path) -> dict:
    from bench import gpu_check

    try:
        code = gpu_check.main([*case.args, "--dry-run", "--strict", "--out", str(part)])
    except Exception as error:  # recorded: the other cases still run
        return {"status": "error", "error": f"{type(error).__name__}: {error}"[:2000]}
    checks = json.loads(part.read_text())["checks"]
    return {"status": "ok" if code == 0 else "error", "exit_code": code, "result": checks}


def run_plan(
    names: list[str], out: Path, budget_s: float, dry_run: bool, resume: Path | None = None,
    state: Path | None = None,
) -> dict:  # fmt: skip
    """Runs the cases `names` in order within budget_s, saving DIR/gpu_session.json (and a copy
    at `state`) after each; `resume`: an earlier session's JSON whose finished cases are kept."""
    paths = [out / "gpu_session.json", *([state] if state else [])]
    session = json.loads(resume.read_text()) if resume and resume.exists() else {}
    cases = session.get("cases", {})
    session.update(header(names, budget_s, dry_run))
    deadline = time.monotonic() + budget_s
    for name in names:
        case = CASES[name]
        if cases.get(name, {}).get("status") == "ok":
            print(f"{name}: done in an earlier call, kept", flush=True)
            continue
        left = deadline - time.monotonic()
        if left < case.need_s and not dry_run:
            cases[name] = {
                "status": "not run",
                "reason": f"{left:.0f} s left, needs ~{case.need_s} s",
            }
            print(f"{name}: not run ({cases[name]['reason']})", flush=True)
            continue
        print(f"{name}: {case.why} (cap {min(case.cap_s, left):.0f} s)", flush=True)
        cases[name] = run_case(case, out, min(case.cap_s, left), dry_run)
        print(f"{name}: {cases[name]['status']} in {cases[name]['seconds']} s", flush=True)
        save(session, cases, paths)
    save(session, cases, paths)
    return session


def header(names: list[str], budget_s: float, dry_run: bool) -> dict:
    import torch

    from bench.machine import machine

    extra = {}
    if torch.cuda.is_available():
        extra = {"gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda}
        extra["driver"] = nvidia_driver()
    return {
        "benchmark": "gpu_session",
        "plan": names,
        "budget_s": budget_s,
        "dry_run": dry_run,
        "machine": machine(("torch", "triton", "fla-core", "torchao", "liger-kernel"), **extra),
    }


def nvidia_driver() -> str:
    """The NVIDIA driver's version (nvidia-smi), or why it is unknown."""
    query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    try:
        return subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unknown ({type(error).__name__})"


def train_results(cases: dict) -> dict:
    """Every train_mfu sub-case's numbers, from whichever case ran it."""
    found: dict = {}
    for entry in cases.values():
        found.update(entry.get("result", {}).get("train_mfu", {}))
    found.pop("comparisons", None)
    found.pop("seconds", None)
    return found


def targets(cases: dict) -> dict:
    """The issue's targets against this session's numbers: value, bound and whether met, or
    None where the case did not produce the number."""
    from bench.gpu_check import train_comparisons

    train = train_results(cases)
    comparisons = train_comparisons(train).get("comparisons", {})

    def bound(value: float | None, limit: float, at_least: bool) -> dict:
        met = None if value is None else (value >= limit if at_least else value <= limit)
        return {"value": value, "bound": (">= " if at_least else "<= ") + str(limit), "met": met}

    attention = cases.get("attention", {}).get("result", {}).get("flash_attention", {})
    main_shape = attention.get("timing", {}).get("dense_t4096_d128", {})
    ratio = main_shape.get("triton_max_logits_over_best_sdpa", {}).get("forward_backward")
    out = {
        "dense_1b_mfu": bound(train.get("dense_1b", {}).get("mfu"), 0.5, True),
        "moe_fine_mfu_active": bound(train.get("moe_fine", {}).get("mfu"), 0.35, True),
        "attention_t4096_vs_cudnn": bound(ratio, 1.2, False),
        "dense_1b_32k_mfu": bound(train.get("dense_1b_32k", {}).get("mfu"), 0.4, True),
        "dense_1b_float8_speedup": bound(
            comparisons.get("dense_1b_float8_tensorwise", {}).get("speedup_vs_bf16"), 1.2, True
        ),
    }
    for name, limit in (("hybrid_1b", 1.15), ("attnres_1b", 1.15), ("mhc_1b", 1.3)):
        out[f"{name}_step_vs_dense"] = bound(
            comparisons.get(name, {}).get("step_time_vs_dense_1b"), limit, False
        )
    out["engram_1b_step_vs_dense"] = bound(
        comparisons.get("engram_1b", {}).get("step_time_vs_dense_1b"), 1.15, False
    )
    out["comparisons"] = comparisons
    return out


def save(session: dict, cases: dict, paths: list[Path]) -> None:
    """The session with its cases and targets, written whole (rename) to each path."""
    session["cases"] = cases
    session["targets"] = targets(cases)
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(session, indent=2) + "\n")
        tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu_out")))
    parser.add_argument("--budget-s", type=float, default=690.0, help="this call's time budget")
    parser.add_argument("--only", nargs="+", choices=list(CASES), default=None)
    parser.add_argument(
        "--resume",
        nargs="?",
        const="",
        default=None,
        metavar="JSON",
        help="keep the finished cases of an earlier call (default: --state, else DIR's)",
    )
    parser.add_argument(
        "--state", type=Path, default=None, help="also save the session here (kept between calls)"
    )
    parser.add_argument("--list", action="store_true", help="print the plan and exit")
    parser.add_argument("--dry-run", action="store_true", help="every case on CPU, tiny shapes")
    args = parser.parse_args(argv)
    if args.list:
        total = 0.0
        for case in PLAN:
            total += case.need_s
            print(f"{case.name:27s} ~{case.need_s:3.0f} s, cap {case.cap_s:3.0f} s, by "
                  f"{total / 60:4.1f} min  {case.why}")  # fmt: skip
        return 0
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    names = args.only or [case.name for case in PLAN]
    resume = None
    if args.resume is not None:
        candidates = (
            [Path(args.resume)] if args.resume else [args.state, args.out / "gpu_session.json"]
        )
        resume = next((p for p in candidates if p and p.exists()), None)
        print(f"resuming from {resume}" if resume else "--resume: no earlier session found")
    session = run_plan(names, args.out, args.budget_s, args.dry_run, resume, args.state)
    statuses = {name: session["cases"][name]["status"] for name in names}
    print(json.dumps({"statuses": statuses, "targets": session["targets"]}, indent=1)[:6000])
    print(f"wrote {args.out / 'gpu_session.json'}")
    return 0 if all(s in ("ok", "not run") for s in statuses.values()) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
