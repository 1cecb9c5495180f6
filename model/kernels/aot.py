"""Compile the Triton kernels (FlashAttention, the fused training ops) ahead of time for a GPU architecture, on any machine (no GPU
needed: Triton's front end, LLVM and ptxas run on the CPU). The interpreter that runs the kernel
tests on CPU executes the kernels as Python, so it never sees what only the compiler checks
(tuples of constexprs, dtype rules of tl.dot, shared memory): this does.

    python -m model.kernels.aot [--arch 90] [--workers N]
        one JSON line per kernel variant (compiled in N processes, default one per usable core);
        exit 1 if one needs more shared memory than an sm_90 block has

Run it with TRITON_INTERPRET unset (the interpreter replaces the compiled kernels).
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor

from model.kernels.flash_attention import DKV_CONFIGS, DQ_CONFIGS, FORWARD_CONFIGS

CANDIDATES = {"_fwd": FORWARD_CONFIGS, "_bwd_q": DQ_CONFIGS, "_bwd_kv": DKV_CONFIGS}
# (which autotuning candidate, (dtype, Dqk, Dv, CAUSAL, BOUNDED)), compiled for every kernel: the
# largest candidate in bf16 (dense dims 128 with documents; MLA's 192 / 128), and the smallest in
# fp32 at MLA's dims (padded to 256 / 128), the shape most likely to outgrow shared memory
ATTENTION_VARIANTS = (
    (0, ("bf16", 128, 128, True, True)),
    (0, ("bf16", 192, 128, True, False)),
    (-1, ("fp32", 192, 128, True, True)),
)
# fused kernels: (name, constexprs) in bf16 at widths of a ~1B model (C 2048, 16 heads of 128)
FUSED_KERNELS = (
    ("_rms_norm_fwd", dict(BLOCK_C=2048, HAS_RESIDUAL=True)),
    ("_rms_norm_bwd", dict(BLOCK_C=2048, HAS_DH=True)),
    ("_rope", dict(D=128, HALF_R=64, BLOCK_H=16, BLOCK_P=64, BLOCK_REST=0, INTERLEAVED=True)),
    ("_swiglu_fwd", dict(BLOCK=1024)),
    ("_swiglu_bwd", dict(BLOCK=1024)),
)
HOPPER_SHARED_BYTES = 232448  # the largest dynamic shared memory one block may use on sm_90
FP32_POINTERS = {"LSE2", "MAX", "DELTA", "RSTD", "DW", "ROT"}
INT_POINTERS = {"FK", "LR"}
FLOATS = {"sm_scale", "eps", "sign"}
INTS = {"T", "HQ", "GROUP", "N", "C", "H"}  # upper-case scalars (sizes)


def signature(fn, constants: dict, dtype: str) -> dict:
    """Triton types of fn's arguments: upper-case names are pointers (16-bit data unless listed
    as fp32 / int32) but for the INTS sizes, FLOATS are fp32 scalars, the rest int32."""

    def kind(arg: str) -> str:
        if arg in constants:
            return "constexpr"
        if arg in FLOATS:
            return "fp32"
        if not arg.isupper() or arg in INTS:
            return "i32"
        if arg in INT_POINTERS:
            return "*i32"
        return "*fp32" if arg in FP32_POINTERS else f"*{dtype}"

    return {arg: kind(arg) for arg in fn.arg_names}


def compile_kernel(fn, constants: dict, dtype: str, warps: int, stages: int, arch: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    source = triton.compiler.ASTSource(
        fn=fn, signature=signature(fn, constants, dtype), constexprs=constants
    )
    start = time.perf_counter()
    options = {"num_warps": warps, "num_stages": stages}
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    return {
        "kernel": fn.__name__,
        "constants": {k: v for k, v in constants.items() if not k.startswith("BD_")},
        "warps_stages": [warps, stages],
        "shared_bytes": compiled.metadata.shared,
        "seconds": round(time.perf_counter() - start, 2),
    }


def attention_constants(variant: tuple, block_m: int, block_n: int) -> dict:
    import triton

    dtype, d_qk, d_v, causal, bounded = variant
    return dict(
        D_QK=d_qk, D_V=d_v, BD_QK=triton.next_power_of_2(d_qk), BD_V=triton.next_power_of_2(d_v),
        BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, BOUNDED=bounded,
        PRECISION="ieee" if dtype == "fp32" else "tf32",
    )  # fmt: skip


def kernel_jobs(arch: int) -> list[tuple]:
    """(module, kernel name, constexprs, dtype, warps, stages, arch) for every kernel variant."""
    jobs = []
    for name, candidates in CANDIDATES.items():
        for which, variant in ATTENTION_VARIANTS:
            block_m, block_n, warps, stages = candidates[which]
            constants = attention_constants(variant, block_m, block_n)
            jobs.append(
                ("flash_attention_triton", name, constants, variant[0], warps, stages, arch)
            )
    for name, constants in FUSED_KERNELS:
        jobs.append(("fused_triton", name, constants, "bf16", 4, 1, arch))
    return jobs


def compile_job(job: tuple) -> dict:
    module, name, constants, dtype, warps, stages, arch = job
    fn = getattr(importlib.import_module(f"model.kernels.{module}"), name)
    return compile_kernel(fn, constants, dtype, warps, stages, arch)


def compile_all(arch: int, workers: int = 1):
    """Yields one result per kernel variant, in kernel_jobs' order; with workers > 1 the
    variants compile in that many processes (each compile is single-threaded: the fp32
    forward alone takes ~27 s on a 2-core AMD EPYC)."""
    jobs = kernel_jobs(arch)
    if workers <= 1:
        yield from map(compile_job, jobs)
        return
    context = multiprocessing.get_context("spawn")  # no state shared with the parent
    with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=context) as pool:
        # submitted slowest first (fp32 attention: the forward alone is ~40% of the work), so
        # that no core is left compiling one long variant after the others ran out of work
        order = sorted(range(len(jobs)), key=lambda i: (jobs[i][3] != "fp32", i))
        futures = {i: pool.submit(compile_job, jobs[i]) for i in order}
        for i in range(len(jobs)):
            yield futures[i].result()


def usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))  # the cores this process may run on
    return os.cpu_count() or 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)"
    )
    parser.add_argument("--workers", type=int, default=usable_cores(), help="compile processes")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter replaces the compiled kernels")
    too_large = 0
    for result in compile_all(args.arch, max(1, args.workers)):
        result["fits"] = result["shared_bytes"] <= HOPPER_SHARED_BYTES
        too_large += not result["fits"]
        print(json.dumps(result), flush=True)
    if too_large:
        raise SystemExit(
            f"{too_large} kernel variant(s) need more than {HOPPER_SHARED_BYTES} bytes of shared memory"
        )


if __name__ == "__main__":
    main()
