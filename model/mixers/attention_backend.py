"""Which kernel computes softmax attention (`model.attention.backend`), one function per backend
in the registry ATTENTION_BACKENDS, shared by the gqa and mla mixers:

  sdpa    torch's scaled_dot_product_attention (cuDNN / FlashAttention-2 / memory-efficient /
          math); documents and sliding windows through a dense (B, 1, T, S) mask; QK-clip's max
          logits recomputed in fp32 chunks (model/mixers/qk_logits.py).
  flex    FlexAttention (compiled on CUDA) with a block-sparse mask for documents and sliding
          windows; on CUDA QK-clip's max logits come from its aux output. No backward on CPU
          (torch's rule): there it serves no-grad forwards only.
  triton  our FlashAttention-2 kernel (model/kernels/flash_attention.py): documents and windows
          as per-row key bounds, GQA without repeated keys, MLA's 192/128 head dims, and the max
          logits as a by-product of the forward. On CPU it runs only under Triton's interpreter.
  matmul  plain matmul - softmax - matmul (transformers' "eager" attention): the (B, H, T, S)
          logits in the compute dtype, softmax in fp32, SDPA's mask form (every query must see
          a key, as the model's masks guarantee: a row with none would be NaN, where SDPA gives
          0); QK-clip's max logits recomputed in fp32 as for sdpa. On a CPU in bf16 it beats
          SDPA's flash kernel up to S = 256 keys (bench/attention_kernels.py), and costs
          O(T S) memory per head.
  auto    triton on CUDA (sm_80 or newer) while QK-clip records max logits, when triton is
          installed and the kernel fits the layer (no ALiBi, head dims <= 256); on a CPU, matmul
          for bf16 layers of at most MATMUL_MAX_KEYS keys; sdpa otherwise: the fastest measured
          where no max logit is needed.

Decoding and prefill after cached tokens (start > 0) always use sdpa: the kernels train.

Shapes: q (B, H, T, Dqk), k (B, K, S, Dqk), v (B, K, S, Dv), H = G K; the output (B, H, T, Dv).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from model.config import KernelsConfig
from model.errors import ConfigError
from model.mixers.masks import AttentionContext
from model.mixers.qk_logits import allowed_keys, max_logits_per_head
from model.mixers.rope import rope_applier
from model.registry import Registry

# name -> fn(q, k, v, ctx, scale, want_max) -> (out, (H,) max logits or None)
Attend = Callable[
    [Tensor, Tensor, Tensor, AttentionContext, float, bool], tuple[Tensor, Tensor | None]
]
ATTENTION_BACKENDS: Registry = Registry("attention backend")
# auto on a CPU: bf16 layers with at most this many keys take `matmul` (measured crossover with
# SDPA's flash kernel, head dim 64: bench/attention_kernels.py)
MATMUL_MAX_KEYS = 256
MASK_FORM_BACKENDS = ("sdpa", "matmul")  # the backends that read AttentionContext.mask


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _bf16_tensor_cores(index: int) -> bool:
    """The kernel's 16-bit tl.dot needs sm_80 or newer."""
    return torch.cuda.get_device_capability(index) >= (8, 0)


def kernel_fits(alibi: bool, head_dims: tuple[int, int]) -> bool:
    """Whether the Triton kernel can compute a layer: no ALiBi bias, head dims it takes."""
    from model.kernels.flash_attention import MAX_HEAD_DIM

    return not alibi and max(head_dims) <= MAX_HEAD_DIM


def resolve_backend(
    requested: str, device: torch.device, start: int, recording: bool, fits: bool = True
) -> str:
    """The backend a layer asking for `requested` uses for a forward on `device` after `start`
    cached tokens; `recording`: QK-clip wants this layer's max logits; `fits`: the Triton
    kernel can compute this layer (`kernel_fits`)."""
    if start > 0:
        return "sdpa"
    if requested != "auto":
        return requested
    if device.type != "cuda" or not (recording and fits and triton_installed()):
        return "sdpa"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return "triton" if _bf16_tensor_cores(index) else "sdpa"


def context_parallel_kernel(requested: str, device: torch.device, fits: bool = True) -> bool:
    """Whether a layer split over context-parallel ranks attends through the Triton kernel
    (chunk by chunk, no mask) rather than SDPA with a (T / cp, T) mask: asked for, or `auto`
    wherever the kernel runs (a CUDA GPU with bf16 tensor cores, triton installed; as `auto`
    picks it for QK-clip): with long contexts the mask is what grows fastest."""
    if requested != "auto":
        return requested == "triton"
    return resolve_backend("auto", device, 0, True, fits) == "triton"


def check_backend(backend: str, *, alibi: bool, head_dims: tuple[int, int]) -> None:
    """Config-time rules of a backend choice (ConfigError naming the keys)."""
    if backend in ("flex", "triton") and alibi:
        raise ConfigError(
            f"model.attention.backend={backend} does not add ALiBi's bias; use "
            "model.attention.backend=sdpa (or auto) with model.position=alibi"
        )
    from model.kernels.flash_attention import MAX_HEAD_DIM

    if backend == "triton" and max(head_dims) > MAX_HEAD_DIM:
        raise ConfigError(
            f"model.attention.backend=triton takes head dims up to {MAX_HEAD_DIM}; this layer has "
            f"query-key / value head dims {head_dims[0]} / {head_dims[1]}"
        )


def check_training_device(backend: str, kernels: KernelsConfig, device_type: str) -> None:
    """Start-up rules of the kernel choices on the training device (ConfigError naming the key):
    Triton kernels need CUDA (or Triton's interpreter, for tests); FlexAttention has no backward
    on CPU. Otherwise the first forward would fail deep inside the model."""
    if device_type == "cuda":
        return
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if backend == "flex":
        raise ConfigError(
            f"model.attention.backend=flex trains on CUDA only (FlexAttention has no backward on "
            f"{device_type}); use model.attention.backend=auto or sdpa here"
        )
    if backend == "triton" and not interpreted:
        raise ConfigError(
            f"model.attention.backend=triton runs on CUDA, not {device_type} (Triton's "
            "interpreter, TRITON_INTERPRET=1, runs it for tests); use model.attention.backend="
            "auto or sdpa here"
        )
    for key in ("rms_norm", "rope", "swiglu"):
        if getattr(kernels, key) == "triton" and not interpreted:
            raise ConfigError(
                f"model.kernels.{key}=triton runs on CUDA, not {device_type} (Triton's "
                f"interpreter, TRITON_INTERPRET=1, runs it for tests); use model.kernels.{key}="
                "torch here"
            )


class KernelChoice:
    """Mixin of the softmax-attention mixers: `backend` (the config's request), the protocol
    method the model asks before a forward (model/mixers/mixer.py: TokenMixer.attention_backend), and
    the choice of RoPE kernel."""

    backend: str = "auto"
    record_max_logits: bool = False
    rope_pairing: str | None = None  # None: no rotary embedding
    kernel_fits: bool = True  # the Triton kernel can compute this layer (set by `build`)

    def use_kernels(self, kernels: KernelsConfig) -> None:
        """The fused RoPE kernel where `model.kernels.rope` asks for it."""
        if self.rope_pairing is not None:
            self.apply_rope = rope_applier(self.rope_pairing, kernels.rope)

    def attention_backend(self, device: torch.device, start: int) -> str | None:
        return resolve_backend(
            self.backend, device, start, self.record_max_logits, self.kernel_fits
        )

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, scale: float
    ) -> Tensor:
        """Attention through the resolved backend; a training forward under QK-clip folds the
        heads' max logits into `self.max_logits`."""
        want_max = self.record_max_logits and torch.is_grad_enabled()
        if ctx.context_parallel is not None:  # the keys of every context-parallel rank
            kernel = context_parallel_kernel(self.backend, q.device, self.kernel_fits)
            out, new_max = ctx.context_parallel.attention(
                q, k, v, self.window, scale, want_max, kernel
            )
        else:
            backend = self.attention_backend(q.device, ctx.start)
            if backend == "sdpa" and self.backend == "auto" and prefers_matmul(q, k, ctx.start):
                backend = "matmul"  # same mask form: the context was built for either
            out, new_max = ATTENTION_BACKENDS.get(backend)(q, k, v, ctx, scale, want_max)
        if new_max is not None:
            self.fold_max_logits(new_max)  # (QKClipHooks: this rank's heads under tp)
        return out


@ATTENTION_BACKENDS.register("sdpa")
def sdpa(
    q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, scale: float, want_max: bool
) -> tuple[Tensor, Tensor | None]:
    new_max = None
    if want_max:
        new_max = max_logits_per_head(q, k, scale, ctx.mask, ctx.is_causal, ctx.start)
    mask = ctx.mask
    grouped = k.shape[1] != q.shape[1]
    if mask is not None and grouped:
        # SDPA's GQA support covers only the flash/math kernels, and flash takes no mask: with a
        # mask, give the memory-efficient kernel per-head k/v rather than fall back to math.
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        grouped = False
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)  # ALiBi bias in the compute dtype
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=ctx.is_causal, scale=scale, enable_gqa=grouped
    )
    return out, new_max


def prefers_matmul(q: Tensor, k: Tensor, start: int) -> bool:
    """auto's choice of the plain matmul kernel over SDPA for a training or prefill forward of
    this shape (see MATMUL_MAX_KEYS)."""
    cpu_bf16 = q.device.type == "cpu" and q.dtype == torch.bfloat16
    return cpu_bf16 and start == 0 and k.shape[2] <= MATMUL_MAX_KEYS


class BiasedScores(torch.autograd.Function):
    """bias + scale q k^T for q (N, M, D), k (N, S, D): one baddbmm, as autograd would run it,
    with the keys' gradient computed as dlogits^T q, (N, S, D) in k's own layout, where
    baddbmm's backward gives (q^T dlogits)^T, D-major. RoPE's backward (compiled) reads the keys'
    gradient next: from the D-major one Inductor wrote an element-by-element loop (profiled in
    the compiled default CPU step: 5.0 ms for the keys' RoPE backward, 0.9 ms now; the step 0.6%
    faster, two engines taking turns in one process). The same products and sums: the bf16
    loss curves of bench/loss_curves.py are bitwise unchanged on the README's CPU (the test
    allows one bf16 rounding, for other BLAS)."""

    @staticmethod
    def forward(ctx, bias: Tensor, q: Tensor, k: Tensor, scale: float) -> Tensor:
        assert not ctx.needs_input_grad[0], "the mask's bias takes no gradient"
        ctx.save_for_backward(q, k)
        ctx.scale = scale
        return torch.baddbmm(bias, q, k.mT, alpha=scale)

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k = ctx.saved_tensors
        # q, k as the GEMM ran (autocast may have run it in bf16 on fp32 inputs: autograd casts
        # the returned gradients back to the inputs' dtypes)
        q, k = q.to(grad.dtype), k.to(grad.dtype)
        dq = grad.bmm(k) * ctx.scale if ctx.needs_input_grad[1] else None
        dk = grad.mT.bmm(q) * ctx.scale if ctx.needs_input_grad[2] else None
        return None, dq, dk, None


@ATTENTION_BACKENDS.register("matmul")
def matmul_attention(
    q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, scale: float, want_max: bool
) -> tuple[Tensor, Tensor | None]:
    B, H, T, _ = q.shape
    K, S = k.shape[1], k.shape[2]
    # query heads of one kv head stacked along the rows: no repeated keys or values (GQA)
    grouped = q.reshape(B, K, (H // K) * T, q.shape[-1])
    bias = _shared_bias(ctx, H // K, T, S, q)
    # a shared mask: one GEMM, bias + scale q.k (scale 2^-n: bitwise the path below on CPU)
    if bias is not None:
        flat_q, flat_k = grouped.reshape(B * K, -1, q.shape[-1]), k.reshape(B * K, S, k.shape[-1])
        logits = BiasedScores.apply(bias, flat_q, flat_k, scale).view(B, H, T, S)
    else:
        logits = (grouped @ k.mT).view(B, H, T, S) * scale  # compute dtype, like SDPA's inputs
        if ctx.mask is not None and ctx.mask.dtype != torch.bool:
            logits = logits + ctx.mask.to(logits.dtype)  # ALiBi: a bias, -inf where not allowed
        else:
            keys = torch.arange(S, device=q.device)
            allowed = allowed_keys(ctx.mask, ctx.is_causal, ctx.start, 0, T, keys, B, H)
            if allowed is not None:
                logits = logits.masked_fill(~allowed, float("-inf"))
    new_max = None  # the fp32 q.k scale, without ALiBi's bias, as every backend records it
    if want_max:
        new_max = max_logits_per_head(q, k, scale, ctx.mask, ctx.is_causal, ctx.start)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(v.dtype)
    out = probs.view(B, K, (H // K) * T, S) @ v  # (B, K, G T, Dv)
    return out.view(B, H, T, v.shape[-1]), new_max


def _shared_bias(ctx: AttentionContext, groups: int, T: int, S: int, q: Tensor) -> Tensor | None:
    """(G T, S) additive mask (0 allowed, -inf not) in q's dtype when every batch row and head
    shares one bool or causal mask (the rows of a query group repeat it G times); None for
    per-row masks (documents), ALiBi's float bias, or no mask."""
    mask = ctx.mask
    if mask is None and not ctx.is_causal:
        return None
    if mask is not None and (mask.dtype != torch.bool or mask.shape[:2] != (1, 1)):
        return None
    keys = torch.arange(S, device=q.device)
    allowed = allowed_keys(mask, ctx.is_causal, ctx.start, 0, T, keys, 1, 1)[0, 0]  # (T, S)
    bias = torch.zeros((T, S), dtype=q.dtype, device=q.device)
    return bias.masked_fill_(~allowed, float("-inf")).repeat(groups, 1)


@ATTENTION_BACKENDS.register("triton")
def triton_flash(
    q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, scale: float, want_max: bool
) -> tuple[Tensor, Tensor | None]:
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "model.attention.backend=triton runs on CUDA (on CPU only under Triton's interpreter, "
            "TRITON_INTERPRET=1, for tests); use model.attention.backend=auto or sdpa here"
        )
    from model.kernels.flash_attention import flash_attention

    result = flash_attention(
        q, k, v, causal=True, softmax_scale=scale, first_key=ctx.first_key,
        return_max_logits=want_max,
    )  # fmt: skip
    return result if want_max else (result, None)


@functools.cache
def _compiled_flex() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@ATTENTION_BACKENDS.register("flex")
def flex(
    q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, scale: float, want_max: bool
) -> tuple[Tensor, Tensor | None]:
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    cuda = q.device.type == "cuda"
    if not cuda and torch.is_grad_enabled() and q.requires_grad:
        raise RuntimeError(
            "model.attention.backend=flex: FlexAttention has no backward on CPU; train with "
            "model.attention.backend=sdpa (or auto) here"
        )
    attend = _compiled_flex() if cuda else flex_attention  # CPU: no-grad forwards only
    kwargs = dict(block_mask=ctx.block_mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    if want_max and cuda:
        out, aux = attend(q, k, v, **kwargs, return_aux=AuxRequest(max_scores=True))
        return out, aux.max_scores.amax(dim=(0, 2))  # (B, H, T) -> (H,)
    return attend(q, k, v, **kwargs), None  # CPU: no-grad forwards, nothing to clip


def flex_block_mask(doc_starts: Tensor | None, window: int, B: int, T: int, device: torch.device):
    """FlexAttention's BlockMask for causal attention inside documents (doc_starts (B, T) bool,
    True where a document begins) and a sliding window of `window` tokens (0: none)."""
    from torch.nn.attention.flex_attention import create_block_mask

    docs = doc_starts.cumsum(dim=1) if doc_starts is not None else None  # (B, T) doc numbers

    def visible(b, h, q_idx, kv_idx):
        ok = q_idx >= kv_idx
        if window:
            ok = ok & (q_idx - kv_idx < window)
        if docs is not None:
            ok = ok & (docs[b, q_idx] == docs[b, kv_idx])
        return ok

    return create_block_mask(visible, B if docs is not None else None, None, T, T, device=device)
