"""fla-core's Triton kernels for the gated delta rule (`model.gdn.kernel` / `model.kda.kernel`):
the same (o, final state) as model/mixers/delta_rule.py, in our layout, on CUDA when fla-core is installed
(`pip install lmforge[fla]`).

Our layout (model/mixers/delta_rule.py): q, k (B, H, T, Dk) L2-normalized, q already x Dk^-1/2, repeated
to the H value heads; v (B, H, T, Dv); log-decay g (B, H, T) per head (Gated DeltaNet) or
(B, H, T, Dk) per key channel (KDA); beta (B, H, T); state (B, H, Dk, Dv). fla's: [B, T, H, K],
g [B, T, HV] or [B, T, HV, K] in natural-log space, beta [B, T, HV], state [N, HV, K, V] (K-first,
`state_v_first=False`), `scale=None` meaning K^-1/2 (so we pass 1.0), varlen as B = 1 with
`cu_seqlens` [N + 1] (N sequences, one state each).

Ops (fla-core 0.4 - 0.6, every argument passed by name): per-head g ->
`fla.ops.gated_delta_rule.chunk_gated_delta_rule` (training, prefill) /
`fused_recurrent_gated_delta_rule` (one decoded token, no autograd); per-channel g ->
`fla.ops.kda.chunk_kda` / `fused_recurrent_kda`.

Packed documents: fla restarts the state only at `cu_seqlens` boundaries, so the batch is
flattened into one row cut at every row start and every document start; a row's initial state
goes to its first segment (unless a document starts at its first token), its final state is
its last segment's. Finding the cuts reads the document starts on the host (one device sync).

Nothing here imports fla or triton at module load: CPU installs never see them.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import warnings
from pathlib import Path

import torch
from packaging.version import InvalidVersion, Version
from torch import Tensor

from model.errors import ConfigError

KERNEL_KEYS = "model.gdn.kernel=fla (or model.kda.kernel=fla)"
FLA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what "auto" hands to the kernels
MAX_HEAD_DIM = 256  # fla's chunk kernels assert K <= 256 (fla/ops/common/chunk_delta_h.py)


@functools.cache
def fla_available() -> bool:
    """fla-core and triton are installed (found, not imported)."""
    try:
        return all(importlib.util.find_spec(name) is not None for name in ("fla", "triton"))
    except (ImportError, ValueError):  # a broken install, or a module without a spec
        return False


def use_fla(kernel: str, x: Tensor) -> bool:
    """Whether a delta-rule layer with `kernel` ("auto" | "torch" | "fla") runs fla's kernels on
    `x` (its q): "torch" never; "auto" on CUDA when fla-core is installed (and the dtype and head
    dim are ones the kernels take) and, when training, fla's backward is right on this device;
    "fla" always, raising when it cannot."""
    if kernel == "torch":
        return False
    if kernel == "auto":
        fits = (
            x.is_cuda and x.dtype in FLA_DTYPES and x.shape[-1] <= MAX_HEAD_DIM and fla_available()
        )
        if fits and torch.is_grad_enabled() and training_blocker(x.device.index):
            _warn_torch_fallback(x.device.index)
            return False
        return fits
    if kernel == "fla":
        if not fla_available():
            raise ConfigError(
                f"{KERNEL_KEYS} needs fla-core (and triton): pip install lmforge[fla], "
                "or set the kernel to auto or torch"
            )
        if not x.is_cuda:
            raise ConfigError(
                f"{KERNEL_KEYS} runs fla-core's Triton kernels on CUDA only, but this layer runs "
                f"on {x.device.type}; set the kernel to auto or torch"
            )
        blocker = torch.is_grad_enabled() and training_blocker(x.device.index)
        if blocker:
            raise ConfigError(
                f"{KERNEL_KEYS}: {blocker}; install triton >= 3.7.1 or tilelang (with nvcc), or "
                "set the kernel to auto or torch"
            )
        return True
    raise ConfigError(f"delta-rule kernel={kernel!r}; choose one of: auto, torch, fla")


def hopper_triton_bug(
    capability: tuple[int, int], triton: str, nvidia: bool, tilelang: bool
) -> bool:
    """fla's gated backward (chunk_bwd_dqkwg) is wrong under Triton >= 3.4.0 and < 3.7.1 on Hopper
    (fla-core issue #640; fla-core 0.6 raises there unless its tilelang kernel serves it). Seen on
    an H200 with torch 2.11 + triton 3.6 + fla-core 0.6.0. Versions compare as fla compares them
    (packaging: 3.7.1rc1 < 3.7.1); an unreadable version counts as affected."""
    if not nvidia or capability[0] != 9 or tilelang:
        return False
    try:
        return Version("3.4.0") <= Version(triton) < Version("3.7.1")
    except InvalidVersion:
        return True


def _tilelang_usable() -> bool:
    """fla-core 0.6's rule (fla/backends.py TileLangBackend): tilelang importable, not disabled by
    FLA_TILELANG=0, and an nvcc found (CUDA_HOME / CUDA_PATH, PATH, /usr/local/cuda)."""
    if importlib.util.find_spec("tilelang") is None or os.environ.get("FLA_TILELANG") == "0":
        return False
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    found = any(home and (Path(home) / "bin" / "nvcc").exists() for home in homes)
    return found or shutil.which("nvcc") is not None


@torch._dynamo.assume_constant_result  # host-side facts: compiled blocks take them as constants
def training_blocker(device_index: int | None) -> str:
    """Why fla's kernels cannot train on this CUDA device ("" when they can); cached."""
    if device_index is None:
        device_index = torch.cuda.current_device()
    return _training_blocker(device_index)


@functools.cache
def _training_blocker(device_index: int) -> str:
    import triton

    capability = torch.cuda.get_device_capability(device_index)
    nvidia = torch.version.hip is None
    if hopper_triton_bug(capability, triton.__version__, nvidia, _tilelang_usable()):
        return (
            f"fla-core's gated backward is wrong with triton {triton.__version__} on Hopper "
            "(fla #640)"
        )
    return ""


@torch._dynamo.assume_constant_result  # the warning at trace time, not a graph break
def _warn_torch_fallback(device_index: int | None) -> bool:
    """Says once per device why the layers train with the torch form (True: a constant for dynamo)."""
    if device_index not in _WARNED:
        _WARNED.add(device_index)
        warnings.warn(
            f"{training_blocker(device_index)}: the delta-rule layers train with the torch form",
            stacklevel=3,
        )
    return True


_WARNED: set[int | None] = set()


def _op(per_channel: bool, recurrent: bool):
    """The fla function for a per-head or per-channel decay, chunked or token by token."""
    if per_channel:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda

        return fused_recurrent_kda if recurrent else chunk_kda
    from fla.ops.gated_delta_rule import (
        chunk_gated_delta_rule,
        fused_recurrent_gated_delta_rule,
    )

    return fused_recurrent_gated_delta_rule if recurrent else chunk_gated_delta_rule


def _needs_grad(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _segments(doc_starts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The flattened batch's segments: (cu_seqlens [N + 1] int64, each row's first segment (B,),
    each row's last segment (B,)). A segment begins at every row start and document start."""
    B, T = doc_starts.shape
    starts = doc_starts.clone()
    starts[:, 0] = True
    flat = starts.reshape(-1)
    bounds = flat.nonzero().squeeze(1)  # (N,) int64: the host learns N here
    cu_seqlens = torch.cat([bounds, bounds.new_tensor([B * T])])
    first = flat.long().cumsum(0)[::T] - 1  # the segment a row's first token belongs to
    last = torch.cat([first[1:] - 1, first.new_tensor([bounds.numel() - 1])])
    return cu_seqlens, first, last


def fla_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial: Tensor | None = None,
    doc_starts: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """`chunk_gated_delta_rule(q, k, v, g, beta, initial, doc_starts)` (model/mixers/delta_rule.py) on
    fla's kernels: (o (B, H, T, Dv), final state (B, H, Dk, Dv)). The fused recurrent op serves
    T == 1 when no gradient is needed (it has no backward); everything else uses the chunk op."""
    B, _, T, _ = q.shape
    per_channel = g.dim() == 4
    op = _op(per_channel, recurrent=T == 1 and not _needs_grad(q, k, v, g, beta, initial))
    q, k, v, g, beta = (x.transpose(1, 2).contiguous() for x in (q, k, v, g, beta))
    common = dict(scale=1.0, output_final_state=True, use_qk_l2norm_in_kernel=False)
    if doc_starts is None:  # one sequence per row: the batch as it is
        o, final = op(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial, **common)
        return o.transpose(1, 2), final

    cu_seqlens, first, last = _segments(doc_starts)
    seg_initial = None
    if initial is not None:  # a row's state enters its first segment, unless a document starts
        carried = initial * (~doc_starts[:, 0]).to(initial.dtype)[:, None, None, None]
        seg_initial = initial.new_zeros(cu_seqlens.numel() - 1, *initial.shape[1:])
        seg_initial = seg_initial.index_copy(0, first, carried)
    q, k, v, g, beta = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
    o, final = op(
        q=q, k=k, v=v, g=g, beta=beta, initial_state=seg_initial, cu_seqlens=cu_seqlens, **common
    )
    return o.reshape(B, T, *o.shape[2:]).transpose(1, 2), final[last]
