"""Routed experts as stacked weights, each projection computed for all experts at once.

Shapes: M token slots sorted by expert, C d_model, F expert hidden, E experts (local ones under
expert parallelism: the weights are then DTensors sharded on dim 0 and `_local` takes this rank's
experts).

    w_gate, w_up (E, C, F);  w_down (E, F, C)
    y[rows of e] = (act(x W_gate[e]) * (x W_up[e])) W_down[e]

Four ways to compute the same thing (`impl`; "auto" chooses):
  grouped_mm  `torch._grouped_mm`, all experts in one call, where the device and dtype support it
              (probed once per device type and dtype) and rows are 16-byte aligned (C and F
              multiples of 16 / element size). The GPU path: no host sync. Where the weights
              are cast (autocast over fp32 weights), the gate and up projections run as one GEMM
              of width 2F (`_grouped_glu`).
  padded_bmm  each expert's rows padded with zeros to the largest count, then `torch.bmm` over
              (E, max count, C). On CPU, oneDNN's batched GEMM runs several times faster than
              per-group GEMMs in bf16 (bench/moe_layer.py), so "auto" takes it there while the
              padding adds at most PAD_LIMIT x the real rows. In eager fp32 the grouped GEMM is
              faster (its eager kernel runs fp32 on CPU, its meta kernel does not).
  threaded_mm the per-expert GEMMs spread over the intra-op threads, one thread each
              (cpu_grouped.py), with SiLU / GELU the whole GLU per group (cpu_glu.py): "auto"
              in eager fp32 on CPU when the groups are small and many (`small_groups`), where
              torch's grouped GEMM splits each small GEMM over all threads. Not under
              torch.compile.
  loop        a Python loop of per-expert matmuls: the fallback.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

from model import roles
from model.init import InitStds, trunc_normal_
from model.moe.cpu_glu import FUSED_ACTIVATIONS, threaded_glu_experts
from model.moe.cpu_grouped import threaded_grouped_mm

IMPLS = ("auto", "grouped_mm", "padded_bmm", "threaded_mm", "loop")
PAD_LIMIT = 2.0  # padded_bmm when E x max count <= PAD_LIMIT x M (CPU only)
# threaded_mm (eager fp32 on CPU) below this many rows per expert on average: with the fused GLU
# (SiLU, GELU), and with the unfused threaded GEMMs; and with at least this many groups a thread
SMALL_GROUP_FUSED, SMALL_GROUP_UNFUSED, GROUPS_PER_THREAD = 1024, 256, 8


def _local(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor (the local experts); a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def _dense_grad(grad: Tensor) -> Tensor:
    """The grouped GEMM's backward rejects expanded gradients (e.g. from `.sum()`, strides
    [0, 0]), even empty ones (which count as contiguous): give it a dense one."""
    if grad.numel() == 0:
        return torch.zeros_like(grad, memory_format=torch.contiguous_format)
    return grad.contiguous()


@torch._dynamo.assume_constant_result  # a host-side fact: compiled blocks take it as a constant
def grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs forward and backward here, including an empty group, and
    traces under torch.compile (its meta kernel takes only bf16, where CPU's eager kernel also
    runs fp32: compiling an fp32 grouped GEMM raised), so eager and compiled pick alike."""
    return _grouped_mm_probe(device_type, dtype) and _grouped_mm_meta_probe(dtype)


# The probes run eagerly even when called from a compiled block's resumed frame (after a graph
# break dynamo compiles each frame it enters: it traced the meta probe's failing fp32 call with
# fake tensors and raised instead of returning False).
@functools.cache
@torch.compiler.disable
def _grouped_mm_meta_probe(dtype: torch.dtype) -> bool:
    try:
        with _disable_current_modes():
            x = torch.empty(8, 16, device="meta", dtype=dtype)
            w = torch.empty(3, 16, 16, device="meta", dtype=dtype)
            offs = torch.empty(3, device="meta", dtype=torch.int32)
            return torch._grouped_mm(x, w, offs=offs).shape == (8, 16)
    except (RuntimeError, NotImplementedError, TypeError):
        return False


@functools.cache
@torch.compiler.disable
def _grouped_mm_probe(device_type: str, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        with (  # the probe needs autograd: not inference mode (its False would be cached);
            # outside any dispatch mode (selective checkpointing's counts the ops it caches)
            _disable_current_modes(),
            torch.inference_mode(False),
            torch.enable_grad(),
            torch.autocast(device_type, enabled=False),
            torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
        ):
            x = torch.ones(8, 16, device=device_type, dtype=dtype, requires_grad=True)
            w = torch.ones(3, 16, 16, device=device_type, dtype=dtype, requires_grad=True)
            offs = torch.tensor([3, 3, 8], device=device_type, dtype=torch.int32)
            y = torch._grouped_mm(x, w, offs=offs)
            gx, gw = torch.autograd.grad(y, (x, w), torch.ones_like(y))
        return bool(y[0, 0].item() == 16 and gw[1].abs().sum().item() == 0 and gx.shape == x.shape)
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _aligned(*tensors: Tensor) -> bool:
    """Whether the grouped GEMM takes these: contiguous, rows and start 16-byte aligned. Inside a
    compiled block the start is not checked (dynamo cannot trace data_ptr(), and raising there
    sent the whole MoE block back to eager): Inductor's buffers start 64-byte aligned."""
    if not all(t.is_contiguous() and t.shape[-1] * t.element_size() % 16 == 0 for t in tensors):
        return False
    return torch.compiler.is_compiling() or all(t.data_ptr() % 16 == 0 for t in tensors)


def grouped_mm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """x (M, K) sorted by group, w (G, K, N), offsets (G,) int32 cumulative counts -> (M, N)."""
    y = torch._grouped_mm(x, w, offs=offsets)
    # a gradient hook, not an identity Function: the output is no view. Not under compile:
    # torch 2.11's dynamo traced the hook with dynamic M into a graph that Inductor rejects
    # ("Argument 's77' ... used before it has been defined"; seen on an H200, bench/gpu_check.py).
    # Compiled, the GEMM gets dense gradients from the experts' own consumers (activation,
    # product, down projection, combine) and from AOTAutograd's contiguous tangents; an op that
    # expands its gradient (.sum()) applied to this output inside the same graph would not do.
    if y.requires_grad and not torch.compiler.is_compiling():
        y.register_hook(_dense_grad)
    return y


def padded_rows(counts: Tensor, n_rows: int, capacity: int) -> Tensor:
    """(M,) the row of each sorted row in the zero-padded (E x capacity) layout."""
    E = counts.numel()
    starts = counts.cumsum(0) - counts
    expert = torch.repeat_interleave(
        torch.arange(E, device=counts.device), counts, output_size=n_rows
    )
    return expert * capacity + torch.arange(n_rows, device=counts.device) - starts[expert]


def looped_mm(x: Tensor, w: Tensor, counts: list[int]) -> Tensor:
    """The same as grouped_mm with a Python loop (unbind: one gradient stack, not E full-size adds)."""
    chunks = torch.split(x, counts)
    return torch.cat([chunk @ w_e for chunk, w_e in zip(chunks, w.unbind(0))])


def small_groups(n_rows: int, n_groups: int, fused: bool) -> bool:
    """Whether CPU's per-group GEMMs are small and many enough to run whole, one group per
    thread at a time (threaded_mm). Measured on a 2-core CPU in fp32, the layer's step with each
    impl forced, paired round by round (4096 tokens top-8 unless said, F 256, bench/moe_layer.py):
    the fused GLU took 0.82x the grouped GEMM's time at E=256 (128 rows per expert, C 512), 0.93x
    at E=64 (512 rows, C 256), 1.04x at E=16 (2048 rows) and 1.31x at E=8 top-2 (1024 rows, 4
    groups a thread); the unfused threaded GEMMs 0.88x at E=256 and 1.05x at E=64 (C 512).
    Large groups split over the threads well, and few groups balance badly between them."""
    threads = torch.get_num_threads()
    limit = SMALL_GROUP_FUSED if fused else SMALL_GROUP_UNFUSED
    if _get_current_dispatch_mode_stack():  # selective checkpointing's mode: the ranges would
        return False  # run serially on this thread (a mode sees only its own thread's ops)
    return threads > 1 and n_groups >= GROUPS_PER_THREAD * threads and n_rows < limit * n_groups


@dataclass(frozen=True)
class ScaledGroupedMM:
    """A low-precision grouped GEMM installed on the experts by trainer.precision=float8
    (parallel/float8.py: torchao's fp8 rowwise or MXFP8 ones): fn(x (M, K) grouped by expert,
    w (G, K, N) column-major per group, ends (G,) int32 cumulative row counts) -> (M, N) bf16,
    each group's rows a multiple of `alignment` (the quantization block)."""

    fn: Callable[[Tensor, Tensor, Tensor], Tensor]
    alignment: int
    name: str


def aligned_rows(counts: Tensor, n_rows: int, alignment: int) -> tuple[Tensor, Tensor]:
    """Each expert's rows padded to a multiple of `alignment`, in a static layout of at least
    n_rows + E x (alignment - 1) rows (no host sync): ((M,) the row of each sorted row in it,
    (E,) int32 end of each padded group)."""
    padded = (counts + alignment - 1) // alignment * alignment
    E = counts.numel()
    expert = torch.repeat_interleave(
        torch.arange(E, device=counts.device), counts, output_size=n_rows
    )
    offset = (padded.cumsum(0) - padded) - (counts.cumsum(0) - counts)  # (E,) shift per expert
    rows = torch.arange(n_rows, device=counts.device) + offset[expert]
    return rows, padded.cumsum(0).to(torch.int32)


def column_major(w: Tensor, dtype: torch.dtype) -> Tensor:
    """(G, K, N) in `dtype` with each group's matrix stored column-major (strides (K N, 1, K)):
    the right operand layout of the scaled grouped GEMMs, cast and laid out in one copy."""
    G, K, N = w.shape
    return torch.empty(G, N, K, dtype=dtype, device=w.device).copy_(w.mT).mT


class GroupedExperts(nn.Module):
    def __init__(
        self, n_experts: int, d_model: int, hidden: int, activation: Callable[[Tensor], Tensor]
    ) -> None:
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        self.w_up = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        self.w_down = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.activation = activation
        self.impl = "auto"  # one of IMPLS (tests and benchmarks force one)
        self.scaled_mm: ScaledGroupedMM | None = None  # trainer.precision=float8's grouped GEMM

    def param_roles(self) -> dict[str, str]:
        return dict.fromkeys(("w_gate", "w_up", "w_down"), roles.EXPERT_STACK)

    def compute_dtype(self, x: Tensor) -> torch.dtype:
        """The autocast dtype when autocast is on (grouped GEMMs are not autocast ops), else x's."""
        device = x.device.type
        return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype

    def _weights(self, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """(w_gate, w_up, w_down) of the local experts in `dtype`."""
        return tuple(_local(w).to(dtype) for w in (self.w_gate, self.w_up, self.w_down))

    def forward(self, x: Tensor, counts: Tensor | None) -> Tensor:
        """x (M, C) grouped by expert in ascending order, counts (E_local,) int64 -> (M, C),
        computed in `compute_dtype(x)`. counts None: x is already the padded (E_local,
        capacity, C) block in the compute dtype (`padded_forward`). Callers go through here,
        not the methods, so that engines hooking module calls (DeepSpeed ZeRO-3 gathers each
        module's weights around its forward) see the experts used."""
        if counts is None:
            return self.padded_forward(x)
        n_local = _local(self.w_gate).shape[0]
        if len(counts) != n_local:
            raise ValueError(f"{len(counts)} expert counts for {n_local} local experts")
        x = x.to(self.compute_dtype(x)).contiguous()
        if self.scaled_mm is not None:
            return self._scaled_forward(x, counts)
        w_gate, w_up, w_down = self._weights(x.dtype)
        impl = self.choose(x.device.type, x.dtype, x.shape[0], counts)
        if impl == "grouped_mm" and not _aligned(x, w_gate, w_down):
            impl = "loop"
        if impl == "padded_bmm":
            return self._padded_bmm(x, counts)
        if impl == "threaded_mm" and self.activation in FUSED_ACTIVATIONS:
            return threaded_glu_experts(x, (w_gate, w_up, w_down), counts.tolist(), self.activation)
        if impl == "grouped_mm" and _local(self.w_gate).dtype != x.dtype:  # weights cast above
            return self._grouped_glu(x, (w_gate, w_up, w_down), counts)
        if impl == "grouped_mm":
            mm = functools.partial(grouped_mm, offsets=counts.cumsum(0).to(torch.int32))
        elif impl == "threaded_mm":
            mm = functools.partial(threaded_grouped_mm, counts=counts.tolist())
        else:
            mm = functools.partial(looped_mm, counts=counts.tolist())
        h = self.activation(mm(x, w_gate)) * mm(x, w_up)  # (M, F)
        return mm(h, w_down)

    def _grouped_glu(self, x: Tensor, weights: tuple[Tensor, ...], counts: Tensor) -> Tensor:
        """x (M, C) -> (M, C) through grouped GEMMs, the gate and up projections as one of width
        2F on [W_gate | W_up] (E, C, 2F): x is read once, and backward takes dx in one GEMM over
        2F (fp32 accumulation) instead of two over F, each rounded to x's dtype, and their sum;
        x^T dh likewise. Forward values equal the two GEMMs' (each output is the same dot
        product); dx's sum runs in another order. Only for weights cast to x's dtype (autocast
        over fp32 weights, the GPU runs): compiled, Inductor writes both casts into the one
        buffer (no copy of its own), and backward keeps it as it kept the two casts (eager: one
        more copy of the cast weights). Weights already in x's dtype take three GEMMs: there
        the concatenation would be a copy of the weights, kept for backward."""
        w_gate, w_up, w_down = weights
        F = w_gate.shape[-1]
        offsets = counts.cumsum(0).to(torch.int32)  # (E,) end row of each expert's group
        gate_up = grouped_mm(x, torch.cat([w_gate, w_up], dim=-1), offsets)  # (M, 2F)
        gate, up = gate_up.split(F, dim=-1)  # backward: one cat of the two (M, F) gradients
        return grouped_mm(self.activation(gate) * up, w_down, offsets)

    def _scaled_forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """The three projections through `scaled_mm` (bf16 out): x (M, C) -> (M, C), each
        expert's rows zero-padded to the alignment and gathered back after."""
        scaled = self.scaled_mm
        M, C = x.shape
        rows, ends = aligned_rows(counts, M, scaled.alignment)
        a = scaled.alignment  # every group padded to a multiple; the whole too (MXFP8's wgrad
        capacity = -(-(M + counts.numel() * (a - 1)) // a) * a  # quantizes along the rows)
        padded = x.new_zeros(capacity, C).index_copy(0, rows, x)
        w_gate, w_up, w_down = (
            column_major(_local(w), x.dtype) for w in (self.w_gate, self.w_up, self.w_down)
        )
        h = self.activation(scaled.fn(padded, w_gate, ends)) * scaled.fn(padded, w_up, ends)
        return scaled.fn(h, w_down, ends).index_select(0, rows)

    def padded_forward(self, padded: Tensor) -> Tensor:
        """padded (E_local, capacity, C) in the compute dtype, each expert's rows first and any
        rows after them ignored -> (E_local, capacity, C), one batched GEMM per projection."""
        w_gate, w_up, w_down = self._weights(padded.dtype)
        h = self.activation(torch.bmm(padded, w_gate)) * torch.bmm(padded, w_up)  # (E, cap, F)
        return torch.bmm(h, w_down)

    def _padded_bmm(self, x: Tensor, counts: Tensor) -> Tensor:
        E, (M, C) = counts.numel(), x.shape
        capacity = int(counts.max()) if M else 0
        rows = padded_rows(counts, M, capacity)  # (M,)
        padded = x.new_zeros(E * capacity, C).index_copy_(0, rows, x).view(E, capacity, C)
        return self.padded_forward(padded).view(E * capacity, C).index_select(0, rows)

    def choose(self, device_type: str, dtype: torch.dtype, n_rows: int, counts: Tensor) -> str:
        """The impl for `n_rows` rows of `dtype` (the compute dtype) with these per-expert counts
        ("grouped_mm" also needs 16-byte aligned rows, which `forward` checks, else it loops);
        "scaled" when a float8 grouped GEMM is installed (`scaled_mm`)."""
        if self.scaled_mm is not None:
            return "scaled"
        if self.impl not in IMPLS:
            raise ValueError(
                f"GroupedExperts.impl={self.impl!r}; choose one of: {', '.join(IMPLS)}"
            )
        if self.impl != "auto":
            return self.impl
        if device_type == "cpu" and self._cpu_fp32_eager(dtype):
            fused = self.activation in FUSED_ACTIVATIONS
            small = small_groups(n_rows, counts.numel(), fused)
            return "threaded_mm" if small else "grouped_mm"
        if device_type == "cpu" and counts.numel() * int(counts.max()) <= PAD_LIMIT * n_rows:
            return "padded_bmm"
        return "grouped_mm" if grouped_mm_supported(device_type, dtype) else "loop"

    def _cpu_fp32_eager(self, dtype: torch.dtype) -> bool:
        """Eager fp32 on CPU with 16-byte rows: there per-group GEMMs (grouped or threaded) beat
        the padded batch (they run at about the batched rate and the padding's copies cost;
        grouped 0.89x against padded 0.84x a dense FFN at E=64, 0.72x against 0.61x at E=256,
        bench/moe_layer.py --dtype fp32 on an AVX2 CPU). Not under torch.compile: CPU's meta
        kernel takes only bf16. In bf16 oneDNN's batched GEMM is the faster one."""
        if dtype != torch.float32 or torch.compiler.is_compiling():
            return False
        C, F = _local(self.w_gate).shape[1:]
        return C % 4 == 0 and F % 4 == 0 and _grouped_mm_probe("cpu", dtype)

    def init_weights(self, stds: InitStds) -> None:
        trunc_normal_(self.w_gate, stds.value)
        trunc_normal_(self.w_up, stds.value)
        trunc_normal_(self.w_down, stds.out)
