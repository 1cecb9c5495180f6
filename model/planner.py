"""What one rank of a training layout holds and sends: `python -m model.inspect tp=2 dp_shard=4 ...`.

Read off a meta-device model. Which weights tensor parallelism splits comes from the modules'
own plans (`tensor_parallel_plan(tp)`, as parallel/tensor_parallel.py applies them: colwise and
rowwise children split over tp, head_shared ones whole; the embedding and an untied head split
by vocabulary rows, Engram's tables by rows (table_rows); modules without a plan replicated over
tp). Then per parameter, on a rank:

    elements = numel x tp_share / ep / shards
    tp_share = 1/tp when a plan splits it (a rowwise projection's bias stays whole), else 1
    ep, shards = ep, dp_shard / ep for routed experts (split over ep, then FSDP2-sharded over
                 the rest of dp_shard); 1, dp_shard for the rest; 1, 1 for replicated memory
                 tables (Engram's sharding=replicated: whole on every rank, tp ones too). dp_replicate copies, never divides.

Bytes per element (param_dtype fp32: FSDP2's sharded fp32 weights and gradients; bf16: bf16
weights and gradients with an fp32 master copy): weights and gradients 4 or 2, master 0 or 4;
optimizer state AdamW 8 (two fp32 moments), Muon 4 (one fp32 momentum) for the roles it
orthogonalizes (matrices, expert stacks: optim/roles.py) and AdamW's 8 for the rest. Figures are
means over the ranks: uneven shards (torch.chunk's, as FSDP2 and DTensor cut) differ by a row.

Context parallelism (cp): FSDP2 shards over dp_shard x cp, every per-token figure counts the
T / cp positions a rank computes, and model/planner_context.py adds the gathered keys and values
and the bytes sent over the cp ranks (comm_cp). `largest_seq_len` finds the longest sequence
whose rank total fits a memory budget.

Activations: model/planner_activations.py (sequence parallelism divides what the stream between
the sublayers keeps, and the checkpointed block inputs, by tp). Transient: FSDP2's gathered
weights (the root, kept gathered, and two blocks: the one running and the one prefetched) in the
compute dtype, and one chunk of the loss's fp32 logits and their gradient (chunk x V / tp x
(4 + width)).

Communication: bytes each rank sends per micro-batch step (ring collectives: an all-gather or
reduce-scatter over P ranks sends (P - 1) / P of the whole, an all-reduce twice that):
- FSDP2 over dp_shard: each unit (a block, the routed experts of a block under ep over dp_shard
  / ep ranks, the root) all-gathered in the compute dtype in forward, again in backward when
  reshard_after_forward (never the root's), gradients reduce-scattered in fp32;
- HSDP: the sharded fp32 gradients all-reduced over dp_replicate;
- TP (DTensor's styles, one collective per planned projection: q, k, v unfused): forward
  all-reduces each rowwise output (B T x out), backward each colwise input's gradient
  (B T x in), MLA's rope key's (copy_to_heads: B T x Dr), the gradients of weights kept whole
  but used by heads (head_shared, head_rows, colwise_replicated); Engram's lookups (B T x O K
  Dh fp32: its tables split by rows, table_rows) and the vocab-parallel embedding's output in
  forward; the vocab-parallel loss's all-gather of 3 fp32 statistics per
  token and all-reduce of grad_h (B T x C fp32);
- sequence parallelism (parallel/sequence_parallel.py): per whole-sequence sublayer
  (Block.whole_sequence_sublayers) an all-gather of its input in forward and of its output's
  gradient in backward (B T x C; Engram's the stream's n C), a reduce-scatter of its output
  (B T x C) in place of its row-wise projections' all-reduces when it has any, the stream's final gather in
  forward and first cut's in backward, and once a step the all-reduce of the split region's
  weight gradients (norms, residual connections, the stream's own: their FSDP2 shards);
- full activation checkpointing: the recompute repeats each block's forward collectives (TP,
  sequence parallelism's gathers, EP's all-to-alls) up to the block's last saved tensor: torch's
  checkpoint stops early, so a pre-norm or AttnRes block's closing FFN all-reduce, whose output
  is only added, is not repeated;
- MoE under tp (parallel/routed_work.py; the stack's layers under sequence parallelism are
  split by it instead): the output's all-reduce (B T x C; with shared experts in place of
  theirs), its input's gradient's (B T x C) and once a step the router's and routed experts'
  gradients (their shards); a pre-norm or AttnRes block's recompute stops before the output's;
- EP: each MoE layer's all-to-all of the k routed copies of each token (C wide), there and back,
  forward and backward: 4 k B T C x (ep - 1) / ep (6 with full checkpointing), of 1 / tp of
  the tokens under tensor parallelism (each tp rank routes its own positions' tokens; all of
  them with a capacity factor).

Pipeline parallelism (pp > 1; parallel/pipeline.py): the stack split as the trainer splits it
(model/stages.py `pipeline_layouts`: FLOP-balanced, or `pp_layers`), each pipeline rank's stages
(`stage_rank`) pruned from a copy of the meta model (`keep_stages`) and planned as above: its
weights, gradients and optimizer state, FSDP2 over its data and context ranks. Its figures are
per step of m micro-batches (pp_microbatches; 0 = one per stage, the trainer's default):
- the engine keeps FSDP2's gathered weights for the whole step (reshard_after_forward=false):
  one all-gather, one reduce-scatter, and every gathered unit of the rank's stages in
  `transient`;
- activations: each stage keeps what one micro-batch keeps (its blocks; the first stage the
  token ids, the last the final norm and the loss's; a stage before the last also the output it
  sent, kept by the schedule for its backward) for each micro-batch in flight, as many as the
  schedule holds (model/planner_activations.py `in_flight`: GPipe all m, 1F1B min(m, pp - r) on
  pipeline rank r, the multi-stage schedules from their action lists); full checkpointing keeps
  the block inputs per micro-batch and one block's recompute;
- tp, ep and cp traffic per micro-batch, m times; comm_pp: for each stage, the boundary tensors
  (the residual stream's `boundary_shapes`, compute dtype, T / cp positions) of its output in
  forward and of its input's gradient in backward, m times each, unless the next (previous)
  stage runs on the same rank; with a shared embedding (tied head, MTP) on two ranks, the
  all-reduce of its fp32 gradient shard between them (a ring of 2: its size); a V schedule's
  rank holding both ends keeps a copy of the embedding for the last stage instead (weights and
  gradients, no optimizer state).
`rank_plan` reports the heaviest pipeline rank (`pp_rank`), `pipeline_rank_plans` every one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from torch import nn

from model.config import ConfigError, ModelConfig
from model.planner_activations import (
    block_saved,
    loss_fixed_elements,
    outside_blocks,
)
from model.planner_context import context_activations, context_comm
from model.registry import RESIDUALS
from model.roles import EXPERT_STACK, MATRIX, MEMORY, param_roles, role_owners
from model.stages import (
    stages_per_rank,
)
from model.transformer import Transformer

WIDTH = {"fp32": 4, "bf16": 2}
MUON_ROLES = {MATRIX, EXPERT_STACK}  # optim/roles.py: the roles with muon=True
# the styles that split weights (parallel/tensor_parallel_styles.py STYLES): the rest keep them whole
SPLIT_STYLES = {"colwise", "rowwise", "table_rows"}


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1
    param_dtype: str = "fp32"
    optimizer: str = "adamw"  # adamw | muon (muonclip keeps Muon's state)
    micro_batch_size: int = 1
    seq_len: int = 2048
    activation_checkpoint: str = "none"  # none | full: which activations the total counts
    reshard_after_forward: bool = True
    sequence_parallel: bool = False  # tp > 1: the stream between sublayers split over tp
    cp: int = 1  # context-parallel ranks: each computes T / cp positions of every sequence
    pp: int = 1  # pipeline ranks (outermost): each runs its stages of the stack
    pp_schedule: str = "1F1B"  # one of model/stages.py SCHEDULES (case-insensitive)
    pp_microbatches: int = 0  # micro-batches per step; 0 = one per stage (the trainer's default)
    pp_stages_per_rank: int = 0  # 0 = the schedule's: 1 for GPipe/1F1B, 2 for the others
    pp_layers: tuple[int, ...] = ()  # blocks per stage, in order; () = FLOP-balanced

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def micro_batches(self) -> int:
        """Micro-batches of a pipeline step (1 without a pipeline)."""
        if self.pp == 1:
            return 1
        return self.pp_microbatches or self.stages

    @property
    def stages(self) -> int:
        """Pipeline stages: pp x stages per rank."""
        return self.pp * stages_per_rank(self.pp_schedule, self.pp_stages_per_rank)

    @property
    def local_tokens(self) -> int:
        """The positions of a micro-batch a rank computes (all of them without cp)."""
        return self.micro_batch_size * self.seq_len // self.cp


def check_layout(layout: Layout, cfg: ModelConfig) -> None:
    """One ConfigError line per rule (the trainer's: parallel/mesh.py, expert_parallel.py)."""
    for key in ("dp_replicate", "dp_shard", "tp", "ep", "cp", "pp", "micro_batch_size", "seq_len"):
        if getattr(layout, key) < 1:
            raise ConfigError(f"{key}={getattr(layout, key)} must be >= 1")
    for key in ("pp_microbatches", "pp_stages_per_rank"):
        if getattr(layout, key) < 0:
            raise ConfigError(f"{key}={getattr(layout, key)} must be >= 0 (0 = automatic)")
    if layout.seq_len % (2 * layout.cp):
        raise ConfigError(
            f"cp={layout.cp} splits seq_len={layout.seq_len} into 2 x cp chunks: make seq_len a "
            f"multiple of {2 * layout.cp}"
        )
    if layout.dp_shard % layout.ep:
        raise ConfigError(
            f"ep={layout.ep} must divide dp_shard={layout.dp_shard}: expert-parallel ranks are "
            "taken from the sharded data-parallel ones"
        )
    experts = cfg.moe.n_routed_experts if cfg.moe.enabled else 0
    if layout.ep > 1 and not experts:
        raise ConfigError(f"ep={layout.ep} needs a model with routed experts; set ep=1")
    if layout.ep > 1 and experts % layout.ep:
        raise ConfigError(f"ep={layout.ep} must divide the model's {experts} routed experts")
    if layout.sequence_parallel and layout.tp == 1:
        raise ConfigError(
            "sequence_parallel=true splits the residual stream over the tensor-parallel ranks: "
            "set tp > 1 or sequence_parallel=false"
        )
    if layout.optimizer not in ("adamw", "muon", "muonclip"):
        raise ConfigError(f"optimizer={layout.optimizer!r}; choose adamw or muon")
    if layout.activation_checkpoint not in ("none", "full"):
        raise ConfigError(
            f"activation_checkpoint={layout.activation_checkpoint!r}; choose none or full"
        )
    if layout.pp > 1:
        from model.planner_pipeline import check_pipeline  # (it imports this module)

        check_pipeline(layout, cfg)


@dataclass(frozen=True)
class RankPlan:
    """Bytes on (memory) and sent by (communication) one rank."""

    weights: float
    grads: float
    master: float
    optimizer: float
    activations: float  # saved for backward, no checkpointing
    activations_checkpointed: float  # full checkpointing: block inputs + outside + recompute
    recompute: float  # one block's recompute during backward (inside the figure above)
    transient: float  # gathered FSDP2 units + one loss chunk's logits
    comm_all_gather: float
    comm_reduce_scatter: float
    comm_hsdp_all_reduce: float
    comm_tp: float
    comm_ep: float
    comm_cp: float  # keys/values and delta-rule states over the context-parallel ranks
    ac: str
    comm_pp: float = 0.0  # stage boundaries and the shared embedding's gradient (pp > 1)
    pp_rank: int = 0  # the pipeline rank planned

    @property
    def state(self) -> float:
        return self.weights + self.grads + self.master + self.optimizer

    @property
    def total(self) -> float:
        act = self.activations_checkpointed if self.ac == "full" else self.activations
        return self.state + act + self.transient

    @property
    def comm(self) -> float:
        return (
            self.comm_all_gather
            + self.comm_reduce_scatter
            + self.comm_hsdp_all_reduce
            + self.comm_tp
            + self.comm_ep
            + self.comm_cp
            + self.comm_pp
        )

    def as_dict(self) -> dict[str, float]:
        fields = {k: v for k, v in asdict(self).items() if k not in ("ac", "pp_rank")}
        fields |= {"state": self.state, "total": self.total, "comm": self.comm}
        return {f"rank_{k}": v for k, v in fields.items()}


def tensor_parallel_shares(model: Transformer, tp: int) -> tuple[dict[str, float], list]:
    """(parameter name -> fraction a tp rank holds, [(style, target, planned module)] of every
    plan entry), as apply_tensor_parallel splits them; a plan that cannot split raises
    ConfigError. A plan entry names a child module or a parameter, and a style or (style,
    *arguments); only colwise and rowwise split weights, every other style keeps them whole."""
    shares: dict[str, float] = {}
    entries: list[tuple[str, nn.Module | nn.Parameter, nn.Module]] = []
    if tp == 1:
        return shares, entries
    planned: list[str] = []
    for name, module in model.named_modules():
        plan_of = getattr(module, "tensor_parallel_plan", None)
        if plan_of is None or any(name.startswith(f"{p}.") for p in planned):
            continue
        own = dict(module.named_parameters())
        for target, entry in plan_of(tp).items():
            style = entry if isinstance(entry, str) else entry[0]
            if target in own:
                entries.append((style, own[target], module))
                params = {target: own[target]}
            else:
                child = module.get_submodule(target)
                entries.append((style, child, module))
                params = {f"{target}.{n}": p for n, p in child.named_parameters()}
            for local in params:
                split = style in SPLIT_STYLES and not (
                    style == "rowwise" and local.endswith("bias")
                )
                shares[f"{name}.{local}".lstrip(".")] = 1 / tp if split else 1.0
        planned.append(name)
    shares["embed.weight"] = 1 / tp  # the vocabulary rows
    if model.head is not None:
        shares["head.weight"] = 1 / tp
    return shares, entries


def _units(model: Transformer, experts_apart: bool) -> list[tuple[str, list[nn.Parameter]]]:
    """FSDP2's units (parallel/fsdp.py), innermost first: routed experts under ep, memory
    tables, blocks, MTP modules, then the root with the rest."""
    taken: set[int] = set()
    units = []
    parts: list[tuple[str, nn.Module]] = []
    if experts_apart:
        parts += [("experts", m) for m in role_owners(model, EXPERT_STACK)]
    parts += [("table", m) for m in role_owners(model, MEMORY)]
    parts += [("block", b) for b in model.blocks()]
    parts += [("block", m) for m in (model.mtp.layers if model.mtp is not None else [])]
    parts.append(("root", model))
    for kind, module in parts:
        params = [p for p in module.parameters() if id(p) not in taken]
        taken.update(id(p) for p in params)
        units.append((kind, params))
    return units


def rank_plan(model: Transformer, layout: Layout) -> RankPlan:
    """The per-rank plan of `model` (meta-device) under `layout` (checked here too); with
    pp > 1 the heaviest pipeline rank's (by total; the first of equals)."""
    check_layout(layout, model.cfg)
    if layout.pp > 1:
        from model.planner_pipeline import pipeline_rank_plans  # (it imports this module)

        return max(pipeline_rank_plans(model, layout), key=lambda plan: plan.total)
    return _rank_plan(model, layout)


def _ends(model: Transformer) -> tuple[bool, bool]:
    """(holds the first stage, holds the last) of a model pruned to pipeline stages; a whole
    model holds both."""
    stages = model.pipeline_stages or ()
    if not stages:
        return True, True
    return any(s.first for s in stages), any(s.last for s in stages)


def _rank_plan(model: Transformer, layout: Layout) -> RankPlan:
    """One rank's plan of `model` (whole, or pruned to a pipeline rank's stages) per step of
    one micro-batch."""
    # FSDP2 shards over the data and context ranks together (dp_shard x cp)
    tp, ep, S, R = layout.tp, layout.ep, layout.dp_shard * layout.cp, layout.dp_replicate
    width = WIDTH[layout.param_dtype]
    shares, children = tensor_parallel_shares(model, tp)
    roles = param_roles(model)
    replicated_tables = {
        id(p)
        for t in role_owners(model, MEMORY)
        if t.sharding == "replicated"
        for p in t.parameters()
    }
    names = {id(p): n for n, p in model.named_parameters()}
    elements = optimizer = 0.0
    gather = scatter = hsdp = 0.0
    root = 0.0
    gathered = []  # each block's (and routed experts') gathered bytes
    for kind, params in _units(model, experts_apart=ep > 1):
        unit = 0.0  # this unit's elements on a tp rank before FSDP2 shards them
        for p in params:
            name = names[id(p)]
            expert = roles[name] == EXPERT_STACK
            per_tp = p.numel() * shares.get(name, 1.0) / (ep if expert else 1)
            shards = 1 if id(p) in replicated_tables else (S // ep if expert else S)
            local = per_tp / shards  # elements = numel x tp_share / ep / shards
            elements += local
            muon = layout.optimizer != "adamw" and roles[name] in MUON_ROLES
            optimizer += local * (4 if muon else 8)  # Muon: 1 fp32 momentum; AdamW: 2 moments
            if shards > 1:
                unit += per_tp
                hsdp += 2 * (R - 1) / R * local * 4  # all-reduce of the fp32 sharded gradient
            elif R > 1:
                hsdp += 2 * (R - 1) / R * per_tp * 4
        shards = S // ep if kind == "experts" else S
        if shards > 1:
            # all-gather in the compute dtype (tables: fp32, forward only); gradients fp32
            gathers = 1 if kind in ("root", "table") or not layout.reshard_after_forward else 2
            gather += gathers * (shards - 1) / shards * unit * (4 if kind == "table" else width)
            scatter += (shards - 1) / shards * unit * 4
            if kind == "root":
                root = unit * width
            elif kind in ("block", "experts"):
                gathered.append(unit * width)
    # the one running and the one prefetched; without resharding, all stay gathered
    if layout.reshard_after_forward:
        blocks_gathered = 2 * max(gathered, default=0.0)
    else:
        blocks_gathered = sum(gathered)
    master = elements * 4 if width < 4 else 0.0
    activations = _activations(model, layout, children)
    tokens = layout.local_tokens
    chunk = min(model.cfg.loss_chunk_tokens or tokens, tokens)
    logits = chunk * model.cfg.vocab_size / tp * (4 + width) if _ends(model)[1] else 0.0
    return RankPlan(
        weights=elements * width,
        grads=elements * width,
        master=master,
        optimizer=optimizer,
        activations=activations[0],
        activations_checkpointed=activations[1],
        recompute=activations[2],
        transient=root + blocks_gathered + logits,
        comm_all_gather=gather,
        comm_reduce_scatter=scatter,
        comm_hsdp_all_reduce=hsdp,
        comm_tp=_tp_comm(model, layout, children),
        comm_ep=_ep_comm(model, layout),
        comm_cp=context_comm(model, layout, _head_shares(children, tp)),
        ac=layout.activation_checkpoint,
    )


def _head_shares(children: list, tp: int) -> dict[int, float]:
    """The fraction of its heads or hidden units a rank holds, by id of each module a tp plan
    splits."""
    return {id(parent): 1 / tp for _, _, parent in children}


def _activations(model: Transformer, layout: Layout, children: list) -> tuple[float, ...]:
    """(no checkpointing, full checkpointing, one block's recompute) bytes on a rank."""
    width = WIDTH[layout.param_dtype]
    tokens = layout.local_tokens
    shares = _head_shares(children, layout.tp)
    stream = 1 / layout.tp if layout.sequence_parallel else 1.0  # the positions a rank keeps
    routed = 1 / layout.tp if model.cfg.moe.capacity_factor == 0 else 1.0  # MoE: its positions'
    # (the delta rule's chunks pad each of a cp rank's two segments of T / 2 cp positions)
    length = layout.seq_len // (2 * layout.cp) if layout.cp > 1 else layout.seq_len
    main = [block_saved(b, shares, length, stream, routed) for b in model.layers.values()]
    mtp = [block_saved(b, shares, length, routed=routed) for b in model.blocks()[len(main) :]]
    blocks = [
        saved.bytes(width) * tokens + context_activations(b, shares.get(id(b.attn), 1.0), layout)
        for saved, b in zip(main + mtp, model.blocks(), strict=True)
    ]
    first, last = _ends(model)
    outside = 8.0 * tokens if first else 0.0  # the token ids the embedding keeps
    if last:  # (the ids among them)
        outside = outside_blocks(model).bytes(width) * tokens
        outside += loss_fixed_elements(model, layout.tp) * width
    streams = RESIDUALS.get(model.cfg.residual).parallel_streams(model.cfg) or 1
    inputs = (len(main) * stream + len(mtp)) * streams * model.cfg.d_model * width * tokens
    recompute = max(blocks)
    return sum(blocks) + outside, inputs + outside + recompute, recompute


def _ring_all_reduce(nbytes: float, ranks: int) -> float:
    return 2 * (ranks - 1) / ranks * nbytes


# the streams whose connection adds the FFN's output without keeping it (model/residual/): a
# checkpointed block's recompute stops before that output's all-reduce (mHC's post map and a
# post-norm keep it, so theirs is repeated)
ADDS_OUTPUT = {"pre", "attnres"}


def _tp_comm(model: Transformer, layout: Layout, children: list) -> float:
    """Bytes a rank sends over tp per step (module docstring): all-reduces and all-gathers."""
    tp = layout.tp
    if tp == 1:
        return 0.0
    width = WIDTH[layout.param_dtype]
    tokens = layout.local_tokens
    C = model.cfg.d_model
    forward = backward = 0.0  # bytes all-reduced in the blocks
    for style, target, parent in children:
        linear = isinstance(target, nn.Linear)
        if style in ("colwise", "colwise_replicated") and linear:  # its input's gradient
            backward += tokens * target.in_features * width
        elif style == "rowwise" and linear:  # its output
            forward += tokens * target.out_features * width
        elif style == "copy_to_heads":  # MLA's rope key (B, T, Dr), shared by the heads
            backward += tokens * parent.rope_dim * width
        elif style == "table_rows":  # the lookups' sum (B, T, O K, Dh), from fp32 tables
            forward += tokens * len(target.sizes) * target.head_dim * 4
        if style in ("head_shared", "head_rows", "colwise_replicated"):  # weights' gradients
            params = [target] if isinstance(target, nn.Parameter) else target.parameters()
            backward += sum(p.numel() for p in params) * width
    first, last = _ends(model)
    losses = 1 + (len(model.mtp.layers) if model.mtp is not None else 0) if last else 0
    outside = tokens * C * width if first else 0.0  # the embedding's output
    outside += losses * tokens * C * 4  # the loss's grad_h, fp32
    stats = losses * (tp - 1) * tokens * 3 * 4  # the loss's all-gather
    sharing = _sharing_moe(model, layout)  # MoE layers summing their output (routed_work)
    forward += sum(tokens * C * width for m in sharing if m.shared is None)  # (else: its AR)
    backward += len(sharing) * tokens * C * width  # each input's gradient
    # a gate on partial shared-expert outputs sums its gradient (N fp32; model/moe/layer.py)
    gated = [m for m in _partial_shared_experts(model, layout) if m.shared_gate is not None]
    backward += len(gated) * tokens * 4
    gathered = recomputed = scattered = 0.0  # sequence parallelism: bytes of whole tensors
    ends_scattered: set[int] = set()
    if layout.sequence_parallel:
        gathered, recomputed = _sequence_parallel_gathers(model, tokens * width)
        summed, ends_scattered = _reduce_scattered(model, children)
        forward -= summed * tokens * width  # summed by the sublayers' reduce-scatters instead
        scattered = len(ends_scattered) * tokens * C * width
    if layout.activation_checkpoint == "full":  # the blocks' forward collectives again
        forward, scattered = 2 * forward, 2 * scattered
        if model.cfg.residual in ADDS_OUTPUT:
            planned = {id(parent) for _, _, parent in children}
            for block in model.blocks():  # a closing collective after all the FFN keeps
                if id(block.ffn) in ends_scattered:
                    scattered -= tokens * C * width
                elif any(block.ffn is m for m in sharing):
                    forward -= tokens * C * width
                else:
                    forward -= _closing_all_reduce(block.ffn, planned) * tokens * width
        gathered += recomputed
    sent = _ring_all_reduce(forward + backward + outside, tp) + stats
    sent += (tp - 1) / tp * (gathered + scattered)
    partial = sum(_position_local_elements(m) for m in sharing)  # once a step, their shards
    if layout.sequence_parallel:  # the split region's gradients
        partial += _split_region_elements(model)
    if partial:
        sent += _ring_all_reduce(partial / (layout.dp_shard * layout.cp) * width, tp)
    return sent


def _sharing_moe(model: Transformer, layout: Layout) -> list[nn.Module]:
    """The MoE layers whose tp ranks route their own positions on the whole sequence and sum
    the output (parallel/routed_work.py): all but those sequence parallelism splits (the
    stack's) and those that drop over capacity."""
    if layout.tp == 1 or model.cfg.moe.capacity_factor > 0:
        return []
    main = len(model.layers) if layout.sequence_parallel else 0
    return [b.ffn for b in model.blocks()[main:] if hasattr(b.ffn, "local_positions")]


def _partial_shared_experts(model: Transformer, layout: Layout) -> list[nn.Module]:
    """The MoE layers whose shared experts leave their output partial over tp: those sharing
    their routed work and, under sequence parallelism, the stack's (reduce-scattered)."""
    layers = _sharing_moe(model, layout)
    if layout.tp > 1 and layout.sequence_parallel:
        layers += [b.ffn for b in model.layers.values() if hasattr(b.ffn, "local_positions")]
    return [m for m in layers if m.shared is not None]


def _position_local_elements(moe: nn.Module) -> int:
    return sum(moe.get_parameter(n).numel() for n in moe.position_local_parameters())


def _closing_all_reduce(ffn: nn.Module, planned: set[int]) -> int:
    """Elements per token of the all-reduce that ends an FFN sublayer after its last saved
    tensor (its row-wise down projection's output, or an MoE's ungated shared expert's); 0 when
    something after it keeps a tensor (a shared expert's gate, the balance losses an MoE
    computes last) or the FFN has none (an MoE without shared experts ends with the all-to-all
    back, whose output the weighted sum keeps)."""
    if hasattr(ffn, "experts"):
        moe = ffn.cfg
        losses = moe.aux_loss_coef or moe.seq_aux_loss_coef or moe.z_loss_coef
        if ffn.shared is None or ffn.shared_gate is not None or losses:
            return 0
        ffn = ffn.shared
    return ffn.down_proj.out_features if id(ffn) in planned else 0


def _reduce_scattered(model: Transformer, children: list) -> tuple[int, set[int]]:
    """Under sequence parallelism: (elements per token of the row-wise projections' outputs that
    the sublayers' closing reduce-scatters sum instead of an all-reduce each, the ids of the
    sublayers that end in one: those holding row-wise projections)."""
    rowwise = {
        id(target): target.out_features
        for style, target, _ in children
        if style == "rowwise" and isinstance(target, nn.Linear)
    }
    summed, ends_scattered = 0, set()
    for block in model.layers.values():  # (MTP's blocks run whole: all-reduces)
        for sublayer in (getattr(block, n) for n in block.whole_sequence_sublayers()):
            inside = [rowwise[id(m)] for m in sublayer.modules() if id(m) in rowwise]
            if inside:
                summed += sum(inside)
                ends_scattered.add(id(sublayer))
    return summed, ends_scattered


def _sequence_parallel_gathers(model: Transformer, token_bytes: float) -> tuple[float, float]:
    """(bytes of the whole tensors sequence parallelism all-gathers in a step, the part a full
    checkpointing recompute gathers again): each whole-sequence sublayer's input in forward and
    its output's gradient in backward (C wide, Engram's the stream state's n C), the stream's
    final gather in forward and its first cut's gradient in backward."""
    C = model.cfg.d_model
    streams = RESIDUALS.get(model.cfg.residual).parallel_streams(model.cfg) or 1
    inputs = 0.0  # per token
    for block in model.layers.values():
        for name in block.whole_sequence_sublayers():
            inputs += streams * C if name == "engram" else C  # Engram reads the stream state
    return (2 * inputs + 2 * C) * token_bytes, inputs * token_bytes


def _split_region_elements(model: Transformer) -> int:
    """Elements of the weights sequence parallelism applies to the rank's positions only (as
    parallel/sequence_parallel.py lists them): the stream's own and, in each block, every child
    but its whole-sequence sublayers (norms, residual connections), and the weights a MoE layer
    uses on the kept positions only (router, routed experts: `position_local_parameters`)."""
    params = list(model.stream.parameters())
    for block in model.layers.values():
        whole = block.whole_sequence_sublayers()
        params += [p for n, m in block.named_children() if n not in whole for p in m.parameters()]
        for sublayer in (getattr(block, n) for n in whole):
            if hasattr(sublayer, "local_positions"):
                params += [sublayer.get_parameter(n) for n in sublayer.position_local_parameters()]
    return sum(p.numel() for p in params)


def _ep_comm(model: Transformer, layout: Layout) -> float:
    ep = layout.ep
    if ep == 1:
        return 0.0
    tokens = layout.local_tokens
    layers = [b.ffn for b in model.blocks() if hasattr(b.ffn, "experts")]
    # there and back, in forward and backward (and a full checkpointing recompute's forward)
    passes = 6 if layout.activation_checkpoint == "full" else 4
    # each tp rank routes its own positions' tokens (parallel/routed_work.py), without drops
    routed = 1 / layout.tp if model.cfg.moe.capacity_factor == 0 else 1.0
    copies = sum(passes * m.top_k * tokens * routed for m in layers)
    return copies * model.cfg.d_model * WIDTH[layout.param_dtype] * (ep - 1) / ep


def largest_seq_len(model: Transformer, layout: Layout, budget: float, limit: int = 1 << 24) -> int:
    """The longest seq_len (a multiple of 2 cp, and of cp x tp under sequence parallelism) whose
    rank total under `layout` fits `budget` bytes, up to `limit`; 0 when none does. The total
    grows with the length, so a doubling then a bisection over multiples finds it."""
    step = 2 * layout.cp * (layout.tp if layout.sequence_parallel else 1)

    def fits(multiple: int) -> bool:
        plan = rank_plan(model, replace(layout, seq_len=multiple * step))
        return plan.total <= budget

    if not fits(1):
        return 0
    low, high = 1, 2
    while high * step <= limit and fits(high):
        low, high = high, 2 * high
    high = min(high, limit // step + 1)
    while high - low > 1:  # fits(low), not fits(high) (or past the limit)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low * step
