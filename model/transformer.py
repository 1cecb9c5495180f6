"""The decoder-only language model.

Shapes: B batch, T tokens, C d_model, V vocab. tokens (B, T) -> logits (B, T, V), or the mean loss.

Build large models on the meta device and materialize them after parallelization:
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cuda"); model.init_weights()
`build_model(cfg, device)` does exactly that. Built on a real device, the constructor initializes
the weights itself. Blocks live in a ModuleDict keyed "0".."L-1", so parameter names
(`layers.3.attn.q_proj.weight`) stay the same under any parallelism.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model import roles
from model.block import Block
from model.config import ConfigError, ModelConfig
from model.engram.layer import Engram, TokenCompression
from model.init import trunc_normal_
from model.kernels.flash_attention import key_bounds
from model.loss import chunked_cross_entropy, split_targets, target_log_probs
from model.mixers.attention_backend import MASK_FORM_BACKENDS, flex_block_mask
from model.mixers.kv_cache import Cache
from model.mixers.masks import AttentionContext, build_mask, document_starts, positions_in_documents
from model.mixers.positions import build_positions
from model.moe import moe_balance_hook
from model.mtp.heads import MTPHook, MultiTokenPrediction
from model.norms import build_norm
from model.registry import RESIDUALS
from model.residual.stream import State, StreamStatistics
from model.stages import StageLayout
from model.training_hooks import TrainingHook


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ConfigError(
                f"model.vocab_size={cfg.vocab_size}: set it, or let the trainer take it from the tokenizer"
            )
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = build_positions(cfg)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        stream = RESIDUALS.get(cfg.residual)
        self.norm = (
            build_norm(cfg.norm, cfg.d_model, cfg.norm_eps) if stream.final_norm else nn.Identity()
        )
        self.head = (
            None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        )
        self.stream = stream(cfg)  # expands the embedding into the carried state, collapses it
        # the fused head + cross-entropy; parallel.activation.compile_model swaps in a compiled one
        self.loss_fn = chunked_cross_entropy
        # the head's other uses (parallel/tensor_parallel.py swaps vocab-parallel ones in)
        self.log_probs_fn = target_log_probs
        self.logits_fn = F.linear
        # the RoPE widths the layers rotate (layers of different kinds may differ)
        self.rotary_dims = sorted({b.attn.rotary_dim for b in self.layers.values()} - {0})
        # token id -> canonical id the Engram layers hash (the identity until set)
        self.memory_ids = (
            TokenCompression(cfg.vocab_size, cfg.engram.pad_id) if cfg.engram.enabled else None
        )
        # multi-token prediction modules (training objective, speculative drafts)
        self.mtp = MultiTokenPrediction(cfg) if cfg.mtp.depth else None
        # pipeline parallelism (model/stages.py): the stages this module holds, and the one
        # `stage_forward` runs (None: the whole model)
        self.pipeline_stages: tuple[StageLayout, ...] | None = None
        self.stage: StageLayout | None = None
        # set by context parallelism (parallel/context_parallel.py): `kept(T, device)` the
        # positions of a training forward this rank computes (None: all), `for_forward(kept,
        # doc_ids)` what its attention layers read (AttentionContext.context_parallel)
        self.context_split: object | None = None
        for module in self.modules():  # model.kernels: each op's module picks its kernel
            if hasattr(module, "use_kernels"):
                module.use_kernels(cfg.kernels)
        if self.embed.weight.device.type != "meta":
            self.init_weights()

    def param_roles(self) -> dict[str, str]:
        """The untied output head is a linear layer but is updated like the embedding table."""
        return {"head.weight": roles.EMBEDDING}

    @property
    def head_weight(self) -> Tensor:
        """(V, C): the output projection (the embedding matrix when tied)."""
        return self.embed.weight if self.head is None else self.head.weight

    def init_plan(self) -> list[tuple[str, Callable[[nn.Module], None]]]:
        """(submodule name, its initializer) for each part that is initialized on its own: the
        embedding, positions, every block, the final norm and the head. Seeded per part, the
        result does not depend on how the model is sharded (see `init_weights`)."""
        std, cfg = self.cfg.init.std, self.cfg
        plan: list[tuple[str, Callable[[nn.Module], None]]] = [
            ("embed", lambda m: trunc_normal_(m.weight, std)),
            ("pos", lambda m: m.init_weights(std)),
        ]
        plan += [(f"layers.{name}", lambda m: m.init_weights(cfg)) for name in self.layers]
        if not isinstance(self.norm, nn.Identity):
            plan.append(("norm", lambda m: m.init_weights()))
        if self.head is not None:
            plan.append(("head", lambda m: trunc_normal_(m.weight, std)))
        if any(True for _ in self.stream.parameters()):  # last: the other parts keep their seeds
            plan.append(("stream", lambda m: m.init_weights()))
        if self.memory_ids is not None:  # no random draws (the blocks set identity multipliers)
            plan.append(("memory_ids", lambda m: m.reset()))
        if self.mtp is not None:  # last: without it every other part has the same weights
            plan.append(("mtp", lambda m: m.init_weights(cfg)))
        return plan

    def training_hooks(self) -> list[TrainingHook]:
        """The hooks of this model's own features (model.training_hooks), in the order their
        objective terms add up: the residual stream's statistics, MoE balancing, MTP."""
        hooks = [StreamStatistics(self), moe_balance_hook(self)]
        hooks.append(MTPHook(self) if self.mtp is not None else None)
        return [hook for hook in hooks if hook is not None]

    def blocks(self) -> list[nn.Module]:
        """Every transformer block: the stack's, then the MTP modules' (what activation
        checkpointing, compile and FSDP2 treat one by one)."""
        extra = [m.block for m in self.mtp.layers] if self.mtp is not None else []
        return [*self.layers.values(), *extra]

    @torch.no_grad()
    def set_token_compression(self, canonical: Tensor | None) -> None:
        """The Engram layers' tokenizer compression: `canonical` (V,) maps each token id to its
        canonical id (data/token_compression.py); None is the identity. Sets the pad id and the
        hash multipliers for the ids the hashes see; saved with the model's state (buffers)."""
        if self.memory_ids is None:
            return
        if canonical is None:
            canonical = torch.arange(self.cfg.vocab_size)
        if canonical.shape != (self.cfg.vocab_size,):
            raise ValueError(
                f"the token compression maps {tuple(canonical.shape)} ids; the model has "
                f"model.vocab_size={self.cfg.vocab_size}"
            )
        vocab = self.memory_ids.set(canonical)
        for module in self.modules():
            if isinstance(module, Engram):
                module.set_vocabulary(vocab)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """(Re)initialize every parameter and buffer in place (after `to_empty` from meta).

        With `seed`, part i of `init_plan` draws from its own stream seeded with (seed, i), and
        the global RNG is left as it was: the same weights whatever the parallel layout (FSDP
        initializes full copies of one part at a time and keeps its shard). Without, the parts
        draw one after another from the global RNG.
        """
        for index, (name, init) in enumerate(self.init_plan()):
            with seeded(self.embed.weight.device, part_seed(seed, index)):
                init(self.get_submodule(name))

    def forward(
        self,
        tokens: Tensor,
        targets: Tensor | None = None,
        *,
        doc_ids: Tensor | None = None,
        cache: Cache | None = None,
        per_token: bool = False,
    ) -> Tensor:
        """Logits (B, T, V) when `targets` is None, else the mean cross-entropy over non-ignored targets.

        doc_ids (B, T): document id of each token in packed sequences; attention stays inside a
        document and positions restart at each document's first token.
        cache: a `Cache` from `new_cache`; the tokens continue the sequence it holds.
        per_token: with targets, each target's log-probability (B, T) fp32 instead of the mean
        loss (0 where ignored; no gradients): scoring continuations without (B, T, V) logits.
        """
        # context parallelism: the positions this rank computes, in forwards with targets
        # (training and validation losses); see `_split_loss`
        split = self.context_split is not None and targets is not None and not per_token
        kept = None
        if split and cache is None:
            kept = self.context_split.kept(tokens.shape[1], tokens.device)
        state, ctx = self._trunk(tokens, doc_ids, cache, kept)
        return self._head(self.stream.collapse(state), tokens, targets, ctx, kept, per_token)

    def _head(
        self,
        trunk: Tensor,
        tokens: Tensor,
        targets: Tensor | None,
        ctx: AttentionContext,
        kept: Tensor | None,
        per_token: bool = False,
    ) -> Tensor:
        """The final norm and the head on the collapsed trunk (B, T, C): logits, per-token
        log-probabilities or the loss (see `forward`)."""
        h = self.norm(trunk)
        if targets is None:
            return self.logits_fn(h, self.head_weight)
        if per_token:
            return self.log_probs_fn(h, self.head_weight, targets, self.cfg.loss_chunk_tokens)
        if kept is not None:  # this rank's weighted mean (the cp ranks' average to the whole's)
            local, weight = split_targets(targets, kept, self.context_split.cp)
            loss = weight * self.loss_fn(h, self.head_weight, local, self.cfg.loss_chunk_tokens)
        else:
            loss = self.loss_fn(h, self.head_weight, targets, self.cfg.loss_chunk_tokens)
        if self.mtp is not None and torch.is_grad_enabled():  # training forwards only
            self.mtp.pending = self.mtp.objective(self, trunk, tokens, targets, ctx)
        split = self.context_split is not None
        return self._split_loss(loss, split, kept is not None)

    def stage_forward(
        self,
        *received: Tensor,
        ids: Tensor,
        targets: Tensor | None = None,
        doc_ids: Tensor | None = None,
        per_token: bool = False,
    ) -> Tensor | tuple[Tensor, ...]:
        """The forward of pipeline stage `self.stage` (model/stages.py) on one micro-batch: the
        first stage embeds `ids` (B, T) (what it receives is `ids` again), a later one continues
        the residual stream's state from the tensors the stage before it sent (`received`). A
        stage before the last returns the state as tensors; the last returns what `forward`
        does with `targets` (the loss, or each target's log-probability with `per_token`), or
        the logits without."""
        stage = self.stage
        split = self.context_split is not None and targets is not None and not per_token
        kept = self.context_split.kept(ids.shape[1], ids.device) if split else None
        state, ctx = self._trunk(ids, doc_ids, None, kept, None if stage.first else received)
        if not stage.last:
            return self.stream.to_tensors(state)
        return self._head(self.stream.collapse(state), ids, targets, ctx, kept, per_token)

    def _split_loss(self, loss: Tensor, split: bool, was_split: bool) -> Tensor:
        """Under context parallelism a training forward returns this rank's weighted mean: the
        mean over the cp ranks is one process's loss, as over data-parallel ranks (a length
        that does not split runs whole on every rank: each returns the whole mean); a split
        forward without gradients returns the whole mean on every rank (validation)."""
        if split and was_split and not torch.is_grad_enabled():
            return self.context_split.total(loss)
        return loss

    def pop_mtp_objective(self) -> Tensor | None:
        """The last training forward's weighted MTP losses (to add to the loss before backward),
        and forget them; None without MTP (or with lambda = 0)."""
        if self.mtp is None:
            return None
        objective, self.mtp.pending = self.mtp.pending, None
        return objective

    def last_logits(self, tokens: Tensor, *, cache: Cache | None = None) -> Tensor:
        """(B, V) logits of the last position only: what sampling needs, without (B, T, V)."""
        h = self.hidden_states(tokens, cache=cache)[:, -1]
        return self.logits_fn(h, self.head_weight)

    def hidden_states(
        self, tokens: Tensor, *, doc_ids: Tensor | None = None, cache: Cache | None = None
    ) -> Tensor:
        """Final-norm hidden states (B, T, C)."""
        return self.norm(self.stream.collapse(self._trunk(tokens, doc_ids, cache)[0]))

    def _trunk(
        self,
        tokens: Tensor,
        doc_ids: Tensor | None,
        cache: Cache | None,
        kept: Tensor | None = None,
        received: tuple[Tensor, ...] | None = None,
    ) -> tuple[State, AttentionContext]:
        """The residual stream's state after the last block (`stream.collapse` makes it
        (B, T, C)) and the context the layers shared; with `kept` (T_local,) (context
        parallelism) only those positions of the sequence. `received`: a pipeline stage's
        input state as tensors (model/stages.py), in place of the embedding."""
        B, T = tokens.shape
        start = 0
        if cache is not None:
            cache.check_room(T)
            start = cache.length
        self._check_length(start + T)
        if doc_ids is not None:
            positions = positions_in_documents(doc_ids)
        else:
            positions = torch.arange(start, start + T, device=tokens.device).expand(B, T)
        whole_tokens, whole_positions = tokens, positions
        if kept is not None:
            tokens, positions = tokens[:, kept], positions[:, kept]
        if received is None:
            h = self.embed(tokens)
            additive = self.pos.additive(positions)
            if additive is not None:
                h = h + additive.to(h.dtype)
            state, dtype = self.stream.expand(h), h.dtype
        else:
            state, dtype = self.stream.from_tensors(received), received[0].dtype
        if kept is not None:
            ctx = self._split_context(whole_tokens, whole_positions, doc_ids, kept)
        else:
            ctx = self._context(tokens, positions, start, doc_ids, dtype)
        caches = cache.layers if cache is not None else [None] * len(self.layers)
        for block, layer_cache in zip(self.layers.values(), caches):
            state = block(state, ctx, layer_cache)
        if cache is not None:
            cache.length += T
        return state, ctx

    def _context(
        self,
        tokens: Tensor,
        positions: Tensor,
        start: int,
        doc_ids: Tensor | None,
        dtype: torch.dtype,
    ) -> AttentionContext:
        B, T = tokens.shape
        device = positions.device
        backends = self.attention_backends(device, start)
        doc_starts = document_starts(doc_ids) if doc_ids is not None else None
        window = self.cfg.attention.sliding_window
        mask, is_causal = None, start == 0
        if backends & set(MASK_FORM_BACKENDS):
            mask, is_causal = build_mask(
                T,
                start,
                window=window,
                doc_ids=doc_ids,
                alibi_slopes=self.pos.alibi_slopes(device),
                device=device,
                dtype=dtype,
            )
        first_key = key_bounds(doc_starts, window, T, device) if "triton" in backends else None
        block_mask = None
        if "flex" in backends:
            block_mask = flex_block_mask(doc_starts, window, B, T, device)
        rope = {}
        for dim in self.rotary_dims:
            rotations = self.pos.rotary(positions, start + T, dim)
            if rotations is not None:
                rope[dim] = rotations
        return AttentionContext(
            positions=positions,
            rope=rope,
            mask=mask,
            is_causal=is_causal,
            start=start,
            tokens=tokens,
            doc_starts=doc_starts,
            first_key=first_key,
            block_mask=block_mask,
            **self._memory_ids(tokens),
        )

    def _split_context(
        self, tokens: Tensor, positions: Tensor, doc_ids: Tensor | None, kept: Tensor
    ) -> AttentionContext:
        """The context of this rank's positions `kept` (T_local,) of a sequence split over
        context-parallel ranks, from the whole row's tokens, positions and doc_ids (B, T)."""
        doc_starts = document_starts(doc_ids)[:, kept] if doc_ids is not None else None
        rope = {}
        for dim in self.rotary_dims:
            rotations = self.pos.rotary(positions[:, kept], tokens.shape[1], dim)
            if rotations is not None:
                rope[dim] = rotations
        memory = self._memory_ids(tokens)  # whole rows: Engram hashes the ids before each one
        whole = memory.get("memory_tokens")
        return AttentionContext(
            positions=positions[:, kept],
            rope=rope,
            mask=None,
            is_causal=False,
            start=0,
            tokens=tokens[:, kept],
            doc_starts=doc_starts,
            context_parallel=self.context_split.for_forward(kept, doc_ids, positions, whole),
            memory_pad=memory.get("memory_pad"),
        )

    def attention_backends(self, device: torch.device, start: int) -> set[str]:
        """The attention backends this forward's layers use (each prepares its own mask form)."""
        kinds = {block.attn.attention_backend(device, start) for block in self.blocks()}
        return kinds - {None}

    def _memory_ids(self, tokens: Tensor) -> dict[str, Tensor]:
        """The compressed ids and pad id the Engram layers hash (none without them)."""
        if self.memory_ids is None:
            return {}
        return {
            "memory_tokens": self.memory_ids.canonical[tokens],
            "memory_pad": self.memory_ids.pad,
        }

    def _check_length(self, length: int) -> None:
        if self.cfg.position == "learned" and length > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence of {length} tokens exceeds model.max_seq_len={self.cfg.max_seq_len}, "
                "the size of the learned position table"
            )

    def new_cache(self, batch: int, capacity: int, dtype: torch.dtype | None = None) -> Cache:
        """Empty generation state (each layer's own kind: KV cache, latent cache, ...) for
        `batch` sequences of up to `capacity` tokens."""
        weight = self.embed.weight if self.embed is not None else next(self.parameters())
        dtype, device = dtype or weight.dtype, weight.device  # (a later pipeline stage: its own)
        layers = [block.new_state(batch, capacity, dtype, device) for block in self.layers.values()]
        return Cache(layers, capacity)


def part_seed(seed: int | None, index: int) -> int | None:
    """The seed of init part `index` (None: no seeding, draw from the global RNG)."""
    return None if seed is None else seed * 1_000_003 + index


@contextmanager
def seeded(device: torch.device, seed: int | None) -> Iterator[None]:
    """Draw from a stream seeded with `seed` on `device`, restoring the global RNG after."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def build_model(
    cfg: ModelConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    seed: int | None = None,
) -> Transformer:
    """Build on the meta device, allocate on `device`, initialize (per-part seeded from `seed`
    when given, see `Transformer.init_weights`). With device='meta', no memory is used."""
    with torch.device("meta"):
        model = Transformer(cfg)
    if torch.device(device).type == "meta":
        return model
    model.to_empty(device=device)
    model.init_weights(seed)
    return model.to(dtype) if dtype is not None else model
