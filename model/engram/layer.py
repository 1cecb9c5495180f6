"""Engram conditional memory (DeepSeek, arXiv 2601.07372; `model.engram`): hashed n-gram
embedding tables read by the listed blocks, gated by the hidden state and added to the residual
stream before the block's token mixer (deepseek-ai/Engram: engram_demo_v1.py::Engram).

Shapes: B batch, T tokens, n parallel hidden states (1, or mHC's streams), C d_model, N the
largest n-gram order, O = N - 1 orders, K heads per order, Dh = engram.dim / K, E = O engram.dim.

    rows   = n-gram hashes of the (compressed) token ids          (B, T, O K)   model/engram/hashing.py
    e      = concatenated table rows                              (B, T, E)
    s_i    = <RMSNorm_i(W_K,i e + b), RMSNorm'_i(h_i)> / sqrt(C)  per stream i  (B, T, n)
    a_i    = sigmoid(sign(s_i) sqrt(max(|s_i|, 1e-6)))            (the demo's signed square root)
    v_i    = a_i (W_V e + b)                                      (B, T, n, C)  W_V shared
    out    = v + SiLU(causal depthwise conv_K(RMSNorm''_i(v_i); dilation N))
    h_i   <- h_i + out_i

The conv starts at zero (Megatron-LM's choice), so at initialization out = v. Only the current and
earlier tokens of the same document enter a hash and the conv (per-document shifts on packed rows;
generation keeps the last N - 1 ids and the conv's inputs). The tables are `EngramTable`s: the bulk
of the parameters, role `memory` (Adam at a learning-rate multiple, no weight decay, updated only on
the rows a step read: optim/row_adam.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model import roles
from model.config import ModelConfig
from model.engram.hashing import layer_multipliers, ngram_rows, shifted_tokens, table_primes
from model.init import InitStds, init_linear, trunc_normal_
from model.mixers.kv_cache import LayerState
from model.mixers.masks import AttentionContext
from model.norms import wide_dtype
from model.residual.stream import Fp32Parameters
from model.training_hooks import TrainingHook


@lru_cache(maxsize=16)
def _primes(layers: tuple[int, ...], sizes: tuple[int, ...], heads: int):
    return table_primes(list(layers), list(sizes), heads)


def layer_primes(cfg: ModelConfig, layer_id: int) -> list[list[int]]:
    """Per order, the K primes sizing block `layer_id`'s tables."""
    e = cfg.engram
    sizes = tuple(e.table_sizes) or (5 * cfg.vocab_size,) * (e.max_ngram - 1)
    return _primes(tuple(e.layers), sizes, e.heads)[layer_id]


class EngramTable(Fp32Parameters):
    """One layer's tables as one (rows, Dh) weight, head j's table at rows offset_j.. (the demo's
    MultiHeadEmbedding). Kept in fp32 when the model is cast (`keep_fp32`), like a master weight,
    and its gradients are sparse (only the rows read) unless `sparse_grad` is turned off (FSDP2
    reduces dense gradients: parallel/fsdp.py). With `offload` the weight stays in host memory
    whatever device the model moves to, and the rows a step reads are copied to the device (their
    ids come to the host first: one synchronization per Engram layer and step)."""

    def __init__(
        self,
        primes: list[list[int]],
        head_dim: int,
        sparse_grad: bool,
        offload: bool,
        sharding: str = "rows",
    ):
        super().__init__()
        self.sharding = sharding  # over data-parallel ranks: rows | replicated (parallel/fsdp.py)
        self.prime_table = primes  # (O, K) as lists
        self.head_dim, self.sparse_grad, self.offload = head_dim, sparse_grad, offload
        self.weight = nn.Parameter(torch.empty(sum(self.sizes), head_dim))
        # derived from the config: rebuilt by init_weights (after to_empty), never saved
        self.register_buffer("primes", self._primes_tensor(), persistent=False)
        self.register_buffer("offsets", self._offsets_tensor(), persistent=False)

    @property
    def sizes(self) -> list[int]:
        """Each head's table size, order-major (order 2's heads first), as the rows lie."""
        return [p for order in self.prime_table for p in order]

    def _primes_tensor(self) -> Tensor:
        return torch.tensor(self.prime_table, dtype=torch.long)

    def _offsets_tensor(self) -> Tensor:
        offsets = [0]
        for size in self.sizes[:-1]:
            offsets.append(offsets[-1] + size)
        return torch.tensor(offsets, dtype=torch.long)

    def param_roles(self) -> dict[str, str]:
        return {"weight": roles.MEMORY}

    def inactive_params_per_token(self) -> int:
        """A token reads one row per head."""
        return self.weight.numel() - len(self.sizes) * self.head_dim

    @torch.compiler.disable  # a lookup (with sparse gradients): nothing for the compiler to fuse
    def forward(self, rows: Tensor) -> Tensor:
        """rows (B, T, O K), each head's row in its own table -> (B, T, O K, Dh) (not a view:
        FSDP2 hooks a unit's output)."""
        index = rows + self.offsets
        device = rows.device
        if self.offload:
            index = index.to(self.weight.device)
        sparse = self.sparse_grad and self.weight.requires_grad and torch.is_grad_enabled()
        out = self.lookup(index, sparse)
        if out.device != device:  # offloaded: the rows read, through pinned memory (the caching
            # host allocator reuses the page-locked block once the copy is done)
            if device.type == "cuda":
                out = out.pin_memory()
            out = out.to(device, non_blocking=True)
        return out

    def lookup(self, index: Tensor, sparse: bool) -> Tensor:
        """index (B, T, O K) rows of the whole weight -> (B, T, O K, Dh). Tensor parallelism
        swaps it for a lookup on the rows each rank holds (parallel/tensor_parallel_styles.py
        TableRows)."""
        return F.embedding(index, self.weight, sparse=sparse)

    def init_weights(self, std: float) -> None:
        trunc_normal_(self.weight, std)
        self.primes.copy_(self._primes_tensor())
        self.offsets.copy_(self._offsets_tensor())

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        """The weight keeps fp32 (Fp32Parameters) and, offloaded, host memory: then only the
        buffers follow `fn` and the weight takes the dtype `fn` gives, on the host."""
        if not self.offload:
            return super()._apply(fn, recurse)
        params = dict(self._parameters)
        self._parameters.clear()
        try:
            super()._apply(fn, recurse)
        finally:
            self._parameters.update(params)
        for name, p in params.items():
            if p is None:
                continue
            probe = fn(torch.empty(0, dtype=p.dtype, device=p.device))
            dtype = torch.float32 if p.dtype == torch.float32 else probe.dtype
            device = torch.device("cpu") if self.offload else probe.device
            if p.device.type == "meta" and device.type != "meta":
                data = torch.empty(p.shape, dtype=dtype, device=device)
            elif p.device == device and p.dtype == dtype:
                continue
            else:
                data = p.data.to(device=device, dtype=dtype)
            if torch._has_compatible_shallow_copy_type(p.data, data):
                p.data = data
            else:  # meta -> a real device: a new parameter, as nn.Module._apply makes
                self._parameters[name] = nn.Parameter(data, requires_grad=p.requires_grad)
        return self


class TokenCompression(nn.Module):
    """The model's token id -> canonical id map (V,) that Engram layers hash (the identity until
    `Transformer.set_token_compression`) and the id standing for positions before a document's
    start (`pad`, 0-d: one past the canonical ids, or a token's with engram.pad_id >= 0);
    buffers, so checkpoints carry them."""

    def __init__(self, vocab_size: int, pad_id: int) -> None:
        super().__init__()
        self.pad_id = pad_id
        self.register_buffer("canonical", torch.arange(vocab_size))
        self.register_buffer("pad", torch.tensor(vocab_size if pad_id < 0 else pad_id))

    def set(self, canonical: Tensor) -> int:
        """Install a map; returns how many ids the hashes see (canonical ids + a reserved pad)."""
        self.canonical.copy_(canonical)
        count = int(canonical.max()) + 1
        self.pad.fill_(count if self.pad_id < 0 else int(canonical[self.pad_id]))
        return count + (self.pad_id < 0)

    def reset(self) -> None:
        self.set(torch.arange(self.canonical.shape[0]))


class CompressTokens(TrainingHook):
    """Engram's tokenizer compression as a training hook (model.training_hooks): at the start it
    installs the canonical-id map (V,) from the data's tokenizer on every module that holds the
    model's weights (`Transformer.set_token_compression`); nothing per step."""

    def __init__(self, canonical: Tensor) -> None:
        self.canonical = canonical

    def start(self, modules: Sequence[nn.Module]) -> None:
        for module in modules:
            module.set_token_compression(self.canonical)


class StreamNorm(nn.Module):
    """One RMSNorm per parallel hidden state: x (..., n, C) with weight (n, C), fp32 inside."""

    def __init__(self, streams: int, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(streams, dim))

    def param_roles(self) -> dict[str, str]:
        return {"weight": roles.GAIN}

    def forward(self, x: Tensor) -> Tensor:
        wide = wide_dtype(x.dtype)
        y = F.rms_norm(x.to(wide), (x.shape[-1],), eps=self.eps)
        return (y * self.weight.to(wide)).to(x.dtype)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


class EngramState(LayerState):
    """Generation state of one Engram layer: the last N - 1 compressed token ids (B, N - 1) and
    the conv's last (K - 1) N inputs (B, (K - 1) N, n C)."""

    fixed_size = True

    def __init__(self, tokens: Tensor, conv: Tensor) -> None:
        super().__init__()
        self.register_buffer("tokens", tokens, persistent=False)
        self.register_buffer("conv", conv, persistent=False)


class WithMemory(LayerState):
    """A block's generation state when it has an Engram layer: its mixer's and the memory's."""

    def __init__(self, mixer: LayerState, memory: EngramState) -> None:
        super().__init__()
        self.mixer, self.memory = mixer, memory


def dilated_causal_conv(
    u: Tensor, weight: Tensor, dilation: int, positions: Tensor, past: Tensor | None
) -> tuple[Tensor, Tensor]:
    """y_t = sum_j w[:, K-1-j] u_{t - j dilation}, taps before the token's document left out.
    u (B, T, D); weight (D, K) (nn.Conv1d's (D, 1, K) squeezed: w[:, K-1] meets u_t); positions
    (B, T); past (B, (K-1) dilation, D) or None. Returns y and the last (K-1) dilation inputs."""
    B, T, D = u.shape
    K = weight.shape[-1]
    span = (K - 1) * dilation
    if past is None:
        past = u.new_zeros(B, span, D)
    extended = torch.cat([past.to(u.dtype), u], dim=1)  # (B, span + T, D)
    y = u * weight[:, K - 1]
    for j in range(1, K):
        tap = extended[:, span - j * dilation : span - j * dilation + T]
        valid = (positions >= j * dilation)[..., None]
        y = y + torch.where(valid, tap, torch.zeros_like(tap)) * weight[:, K - 1 - j]
    return y, extended[:, T:]


class Engram(nn.Module):
    """One block's memory (see the module docstring); `streams` = n."""

    def __init__(self, cfg: ModelConfig, layer_id: int, streams: int) -> None:
        super().__init__()
        e = cfg.engram
        C, E = cfg.d_model, (e.max_ngram - 1) * e.dim
        self.layer_id, self.streams, self.width = layer_id, streams, C
        self.max_ngram, self.seed = e.max_ngram, e.seed
        self.hashed_ids = cfg.vocab_size + (e.pad_id < 0)  # with the identity map
        self.table = EngramTable(
            layer_primes(cfg, layer_id), e.dim // e.heads, e.sparse_grad, e.offload, e.sharding
        )
        self.keys = nn.Linear(E, streams * C, bias=e.bias)  # stream i's W_K: rows i C .. (i+1) C
        self.value = nn.Linear(E, C, bias=e.bias)
        self.key_norm = StreamNorm(streams, C, cfg.norm_eps)
        self.query_norm = StreamNorm(streams, C, cfg.norm_eps)
        self.conv_norm = StreamNorm(streams, C, cfg.norm_eps)
        self.conv = nn.Conv1d(streams * C, streams * C, e.kernel, groups=streams * C, bias=False)
        # the hash multipliers: part of the state (a checkpoint keeps its addressing)
        self.register_buffer("multipliers", torch.zeros(e.max_ngram, dtype=torch.long))

    def tensor_parallel_plan(self, tp: int) -> dict[str, str]:
        """The tables' rows split over the tp ranks (each reads the rows it holds; an all-reduce
        sums the lookups, as the vocabulary-parallel embedding) unless they are replicated
        (model.engram.sharding=replicated: whole on every rank, sparse gradients). The gates,
        projections, norms and conv stay whole: E x (n + 1) C weights, small beside the tables."""
        return {} if self.table.sharding == "replicated" else {"table": "table_rows"}

    def set_vocabulary(self, vocab: int) -> None:
        """The multipliers for V' = `vocab` ids the hashes see (they bound the products)."""
        values = layer_multipliers(self.seed, self.layer_id, self.max_ngram, vocab)
        self.multipliers.copy_(torch.tensor(values, dtype=torch.long))

    def forward(self, state: Tensor, ctx: AttentionContext, cache: EngramState | None) -> Tensor:
        """state (B, T, C) (one stream) or (B, T, n, C) -> the same, with the memory added."""
        h = state.unsqueeze(2) if self.streams == 1 and state.dim() == 3 else state
        rows = self.rows(ctx, cache)
        e = self.table(rows).flatten(-2).to(self.value.weight.dtype)  # (B, T, E) fp32; bf16 under
        # bf16 weights
        key = self.keys(e).unflatten(-1, (self.streams, self.width))  # (B, T, n, C)
        score = (self.key_norm(key).float() * self.query_norm(h).float()).sum(-1)
        score = score / math.sqrt(self.width)
        gate = torch.sigmoid(score.sign() * score.abs().clamp_min(1e-6).sqrt())  # (B, T, n)
        value = gate.to(h.dtype)[..., None] * self.value(e).to(h.dtype)[:, :, None, :]
        past = cache.conv if cache is not None else None
        weight, u = self.conv.weight[:, 0].to(h.dtype), self.conv_norm(value).flatten(2)
        if ctx.context_parallel is not None:  # each chunk continuing the one before it

            def conv(chunk: Tensor, before: Tensor, where: Tensor | None) -> Tensor:
                return dilated_causal_conv(chunk, weight, self.max_ngram, where, before)[0]

            span = (weight.shape[1] - 1) * self.max_ngram
            mixed = ctx.context_parallel.convolve(conv, u, span, ctx.positions)
        else:
            mixed, last = dilated_causal_conv(u, weight, self.max_ngram, ctx.positions, past)
            if cache is not None:
                cache.conv.copy_(last)
        out = value + F.silu(mixed).unflatten(-1, (self.streams, self.width))
        return (h + out).reshape(state.shape)

    def rows(self, ctx: AttentionContext, cache: EngramState | None) -> Tensor:
        """(B, T, O K) rows of this layer's heads; continues and updates `cache`'s ids."""
        split = ctx.context_parallel
        if split is not None:  # hashed over the whole row, then this rank's positions
            whole = shifted_tokens(
                split.memory_tokens, split.positions, None, self.max_ngram, ctx.memory_pad
            )
            shifted = [ids[:, split.kept] for ids in whole]
            return ngram_rows(shifted, self.multipliers, self.table.primes)
        if ctx.memory_tokens is None or ctx.memory_pad is None:
            raise ValueError("an Engram layer needs the token ids in the layer context")
        history = cache.tokens if cache is not None else None
        shifted = shifted_tokens(
            ctx.memory_tokens, ctx.positions, history, self.max_ngram, ctx.memory_pad
        )
        if cache is not None:
            recent = torch.cat([cache.tokens, ctx.memory_tokens], dim=1)
            cache.tokens.copy_(recent[:, -(self.max_ngram - 1) :])
        return ngram_rows(shifted, self.multipliers, self.table.primes)

    def init_weights(self, stds: InitStds, table_std: float) -> None:
        self.table.init_weights(table_std)
        init_linear(self.keys, stds.inner)
        init_linear(self.value, stds.out)  # it writes into the residual stream
        for norm in (self.key_norm, self.query_norm, self.conv_norm):
            norm.init_weights()
        nn.init.zeros_(self.conv.weight)  # out = v at the start (Megatron-LM)
        self.set_vocabulary(self.hashed_ids)

    def new_state(self, batch: int, dtype: torch.dtype, device: torch.device) -> EngramState:
        span = (self.conv.weight.shape[-1] - 1) * self.max_ngram
        tokens = torch.zeros(batch, self.max_ngram - 1, dtype=torch.long, device=device)
        conv = torch.zeros(batch, span, self.streams * self.width, dtype=dtype, device=device)
        return EngramState(tokens, conv)

    def describe(self) -> str:
        heads = len(self.table.sizes)
        return f"{heads} heads x {self.table.head_dim} over n-grams 2..{self.max_ngram}"
