"""Compile the FlashAttention kernels ahead of time for a GPU architecture, on any machine (no GPU
needed: Triton's front end, LLVM and ptxas run on the CPU). The interpreter that runs the kernel
tests on CPU executes the kernels as Python, so it never sees what only the compiler checks
(tuples of constexprs, dtype rules of tl.dot, shared memory): this does.

    python -m model.kernels.aot [--arch 90]     prints one JSON line per kernel variant

Run it with TRITON_INTERPRET unset (the interpreter replaces the compiled kernels).
"""

from __future__ import annotations

import argparse
import json
import os
import time

# (kernel, BLOCK_M, BLOCK_N, num_warps, num_stages): one autotuning candidate per kernel
KERNELS = (("_fwd", 128, 64, 8, 3), ("_bwd_q", 64, 32, 4, 2), ("_bwd_kv", 32, 64, 4, 2))
# (dtype, Dqk, Dv, CAUSAL, BOUNDED): dense bf16 with documents, MLA's dims, fp32
VARIANTS = (("bf16", 128, 128, True, True), ("bf16", 192, 128, True, False))
HOPPER_SHARED_BYTES = 232448  # the largest dynamic shared memory one block may use on sm_90


def compile_kernel(
    name: str, block_m: int, block_n: int, warps: int, stages: int, variant: tuple, arch: int
) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    from model.kernels import flash_attention_triton as fa

    dtype, d_qk, d_v, causal, bounded = variant
    fn = getattr(fa, name)
    pointers = {n: f"*{dtype}" for n in ("Q", "K", "V", "OUT", "DO", "DQ", "DK", "DV")}
    pointers |= {n: "*fp32" for n in ("LSE2", "MAX", "DELTA")} | {"FK": "*i32", "LR": "*i32"}
    constants = dict(
        D_QK=d_qk, D_V=d_v, BD_QK=triton.next_power_of_2(d_qk), BD_V=triton.next_power_of_2(d_v),
        BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, BOUNDED=bounded,
        PRECISION="ieee" if dtype == "fp32" else "tf32",
    )  # fmt: skip
    signature = {
        arg: "constexpr"
        if arg in constants
        else pointers.get(arg, "fp32" if arg == "sm_scale" else "i32")
        for arg in fn.arg_names
    }
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constants)
    start = time.perf_counter()
    compiled = triton.compile(
        source,
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": warps, "num_stages": stages},
    )
    return {
        "kernel": name,
        "variant": list(variant),
        "blocks": [block_m, block_n, warps, stages],
        "shared_bytes": compiled.metadata.shared,
        "seconds": round(time.perf_counter() - start, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)"
    )
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter replaces the compiled kernels")
    for kernel in KERNELS:
        for variant in VARIANTS:
            print(json.dumps(compile_kernel(*kernel, variant, args.arch)), flush=True)


if __name__ == "__main__":
    main()
