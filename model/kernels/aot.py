"""Compile the Triton kernels (FlashAttention, the fused training ops) ahead of time for a GPU
architecture, on any machine (no GPU needed: Triton's front end, LLVM and ptxas run on the
CPU). The interpreter that runs the kernel tests on CPU executes the kernels as Python, so it
never sees what only the compiler checks (tuples of constexprs, dtype rules of tl.dot, shared
memory, registers): this does.

    python -m model.kernels.aot [--arch 90] [--workers N] [--candidates all] [--registers]
        one JSON line per kernel variant (compiled in N processes, default one per usable core);
        exit 1 if one needs more shared memory than an sm_90 block has, or more than the
        estimate the attention autotuner prunes its candidates with. The attention kernels are
        compiled with the alignment a GPU launch specializes on (16-byte pointers and strides:
        the loads vectorize and pipeline, as on the GPU); per head-dim class, the largest
        fitting autotuning candidate of each kernel (--candidates all: every fitting one);
        --registers adds each variant's registers and spill bytes (a second ptxas run)

Run it with TRITON_INTERPRET unset (the interpreter replaces the compiled kernels).
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import os
import re
import subprocess
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

from model.kernels.flash_attention import (
    CONFIGS,
    DELTA_BLOCK,
    SHARED_BYTES_SM90,
    dtype_class,
    shared_bytes_estimate,
)

# the attention kernels' head-dim classes, (dtype, Dqk, Dv, CAUSAL, BOUNDED, EVEN): dense dims 128
# with documents and lengths a multiple of the blocks (the unmasked fast path), MLA's 192 / 128
# (padded to 256 / 128, masked), and fp32 at MLA's dims (the most shared memory per element).
# For each, every kernel is compiled with the candidate of largest estimated shared memory that
# the autotuner's pruning keeps on sm_90 (`largest_candidate`), dK/dV also with atomic dQ
ATTENTION_VARIANTS = (
    ("bf16", 128, 128, True, True, True),
    ("bf16", 192, 128, True, False, False),
    ("fp32", 192, 128, True, True, False),
)
ATTENTION_KERNELS = ("_fwd", "_bwd_kv", "_bwd_kv_atomic", "_bwd_q")
# fused kernels: (name, constexprs) in bf16 at widths of a ~1B model (C 2048, 16 heads of 128)
FUSED_KERNELS = (
    ("_rms_norm_fwd", dict(BLOCK_C=2048, HAS_RESIDUAL=True)),
    ("_rms_norm_bwd", dict(BLOCK_C=2048, HAS_DH=True)),
    ("_rope", dict(D=128, HALF_R=64, BLOCK_H=16, BLOCK_P=64, BLOCK_REST=0, INTERLEAVED=True)),
    ("_swiglu_fwd", dict(BLOCK=1024)),
    ("_swiglu_bwd", dict(BLOCK=1024)),
)
HOPPER_SHARED_BYTES = SHARED_BYTES_SM90
FP32_POINTERS = {"LSE2", "MAX", "DELTA", "DQ_ACC", "RSTD", "DW", "ROT"}
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


def aligned(fn, sig: dict) -> dict:
    """The compiler attributes a GPU launch gives the attention kernels in training: pointers
    and strides (and T, n_keys) divisible by 16, as for 16-byte aligned tensors whose rows hold
    multiples of 16 elements; the loads then vectorize and pipeline as they will on the GPU."""
    names = [a for a in fn.arg_names if sig[a] != "constexpr"]
    divisible = {"T", "n_keys"}
    return {
        (fn.arg_names.index(a),): [["tt.divisibility", 16]]
        for a in names
        if sig[a].startswith("*") or a in divisible or (a.startswith("s") and a != "sm_scale")
    }


def compile_kernel(
    fn,
    constants: dict,
    dtype: str,
    warps: int,
    stages: int,
    arch: int,
    align: bool = False,
    registers: bool = False,
) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    sig = signature(fn, constants, dtype)
    attrs = aligned(fn, sig) if align else None
    source = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constants, attrs=attrs)
    start = time.perf_counter()
    options = {"num_warps": warps, "num_stages": stages}
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    result = {
        "kernel": fn.__name__,
        "constants": {k: v for k, v in constants.items() if not k.startswith("BD_")},
        "warps_stages": [warps, stages],
        "shared_bytes": compiled.metadata.shared,
        "seconds": round(time.perf_counter() - start, 2),
    }
    return result | (register_use(compiled.asm["ptx"], arch) if registers else {})


def register_use(ptx: str, arch: int) -> dict:
    """{"registers", "spill_bytes"} a thread of the kernel uses, from ptxas -v (a second ptxas
    run on the PTX: spills to local memory are what most often slow a kernel that fits)."""
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        ptxas = get_ptxas(arch).path
    except TypeError:  # triton before 3.5 takes no architecture
        ptxas = get_ptxas().path
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.ptx")
        with open(path, "w") as file:
            file.write(ptx)
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        command = [ptxas, "-v", f"--gpu-name={gpu}", path, "-o", path + ".cubin"]
        log = subprocess.run(command, capture_output=True, text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    return {
        "registers": int(registers.group(1)) if registers else None,
        "spill_bytes": int(spills.group(1)) if spills else None,
    }


def attention_constants(variant: tuple, block_m: int, block_n: int) -> dict:
    import triton

    dtype, d_qk, d_v, causal, bounded, even = variant
    return dict(
        D_QK=d_qk, D_V=d_v, BD_QK=triton.next_power_of_2(d_qk), BD_V=triton.next_power_of_2(d_v),
        BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, BOUNDED=bounded,
        PRECISION="ieee" if dtype == "fp32" else "tf32", EVEN_M=even, EVEN_N=even,
    )  # fmt: skip


def estimate(name: str, variant: tuple, candidate: tuple) -> int:
    """shared_bytes_estimate of kernel `name` with candidate (BM, BN, warps, stages)."""
    import triton

    dtype, d_qk, d_v = variant[:3]
    block_m, block_n, _, stages = candidate
    bd_qk, bd_v = triton.next_power_of_2(d_qk), triton.next_power_of_2(d_v)
    itemsize = 4 if dtype == "fp32" else 2
    return shared_bytes_estimate(name, block_m, block_n, stages, bd_qk, bd_v, itemsize)


def fitting_candidates(name: str, variant: tuple) -> list[tuple]:
    """The candidates (BM, BN, warps, stages) of kernel `name` for the variant's dtype that the
    autotuner's pruning keeps on sm_90 (estimate within its shared memory; long sequences),
    largest estimate first; the smallest one when none fits."""
    candidates = CONFIGS[name][dtype_class(4 if variant[0] == "fp32" else 2)]
    ranked = sorted(candidates, key=lambda c: -estimate(name, variant, c))
    fitting = [c for c in ranked if estimate(name, variant, c) <= HOPPER_SHARED_BYTES]
    return fitting or ranked[-1:]


def kernel_jobs(arch: int, every: bool = False, registers: bool = False) -> list[tuple]:
    """(module, kernel, constexprs, dtype, warps, stages, arch, estimate or None, registers) for
    every kernel variant: per attention head-dim class and kernel, the fitting candidate with
    the largest estimate (every fitting candidate with `every`)."""
    jobs = []
    for variant in ATTENTION_VARIANTS:
        for name in ATTENTION_KERNELS:
            fitting = fitting_candidates(name, variant)
            for candidate in fitting if every else fitting[:1]:
                block_m, block_n, warps, stages = candidate
                constants = attention_constants(variant, block_m, block_n)
                if name.startswith("_bwd_kv"):
                    constants["ATOMIC_DQ"] = name == "_bwd_kv_atomic"
                bound = estimate(name, variant, candidate)
                job = ("flash_attention_triton", name.removesuffix("_atomic"), constants)
                jobs.append((*job, variant[0], warps, stages, arch, bound, registers))
    delta = attention_constants(ATTENTION_VARIANTS[0], DELTA_BLOCK[0], 0)
    delta = {k: delta[k] for k in ("D_V", "BD_V", "BLOCK_M", "EVEN_M")}
    jobs.append(
        (
            "flash_attention_triton",
            "_bwd_delta",
            delta,
            "bf16",
            DELTA_BLOCK[1],
            1,
            arch,
            None,
            registers,
        )
    )
    for name, constants in FUSED_KERNELS:
        jobs.append(("fused_triton", name, constants, "bf16", 4, 1, arch, None, registers))
    return jobs


def compile_job(job: tuple) -> dict:
    module, name, constants, dtype, warps, stages, arch, bound, registers = job
    fn = getattr(importlib.import_module(f"model.kernels.{module}"), name)
    align = module == "flash_attention_triton"
    result = compile_kernel(fn, constants, dtype, warps, stages, arch, align, registers)
    if bound is not None:
        result["estimate"] = bound
    return result


def compile_all(arch: int, workers: int = 1, every: bool = False, registers: bool = False):
    """Yields one result per kernel variant, in kernel_jobs' order; with workers > 1 the
    variants compile in that many processes (each compile is single-threaded)."""
    jobs = kernel_jobs(arch, every, registers)
    if workers <= 1:
        yield from map(compile_job, jobs)
        return
    context = multiprocessing.get_context("spawn")  # no state shared with the parent
    with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=context) as pool:
        # submitted slowest first (fp32 attention: its IEEE dots unroll into long FMA chains;
        # then the backward), so that no core is left compiling one long variant after the
        # others ran out of work
        order = sorted(
            range(len(jobs)), key=lambda i: (jobs[i][3] != "fp32", jobs[i][7] is None, i)
        )
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
    parser.add_argument(
        "--candidates",
        choices=("largest", "all"),
        default="largest",
        help="attention autotuning candidates compiled per head-dim class",
    )
    parser.add_argument(
        "--registers", action="store_true", help="also report registers and spills (ptxas -v)"
    )
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter replaces the compiled kernels")
    too_large = low = 0
    every = args.candidates == "all"
    for result in compile_all(args.arch, max(1, args.workers), every, args.registers):
        result["fits"] = result["shared_bytes"] <= HOPPER_SHARED_BYTES
        too_large += not result["fits"]
        low += result["shared_bytes"] > result.get("estimate", result["shared_bytes"])
        print(json.dumps(result), flush=True)
    if too_large:
        raise SystemExit(
            f"{too_large} kernel variant(s) need more than {HOPPER_SHARED_BYTES} bytes of shared memory"
        )
    if low:
        raise SystemExit(
            f"{low} kernel variant(s) need more shared memory than shared_bytes_estimate "
            "(model/kernels/flash_attention.py), which the autotuner's pruning trusts"
        )


if __name__ == "__main__":
    main()
