"""What each rank runs in the distributed tests (also callable in one process, as the reference).

A small dense or MoE model trained for a few steps on a fixed random global batch; each rank
takes its data-parallel slice, exactly as the trainer's loader does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from data.loader import Batch
from model.config import ModelConfig
from model.presets import load_preset
from optim import distributed_muon
from optim.config import OptimConfig
from parallel.config import Float8Config, ParallelConfig
from parallel.engine import TrainingEngine
from parallel.mesh import ParallelDims
from trainer.build import build_training_engine
from trainer.checkpoint.load import load_checkpoint
from trainer.checkpoint.save import Checkpointer
from trainer.config import TrainerConfig
from trainer.hooks import start_hooks
from trainer.step import LossTracker, StepSettings, train_step

SEQ = 16
GLOBAL_BATCH = 8
DENSE = {"d_model": 64, "n_layers": 2, "attention.n_heads": 4, "attention.n_kv_heads": 2}
SMALL = DENSE | {"vocab_size": 128, "max_seq_len": 64, "loss_chunk_tokens": 64}


def small_model(preset: str = "tiny", **overrides: Any) -> ModelConfig:
    return load_preset(preset, SMALL | overrides)


def world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def global_batches(steps: int, vocab: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (GLOBAL_BATCH, SEQ + 1), generator=gen) for _ in range(steps)]


def local_batch(tokens: torch.Tensor, tp: int = 1, pp: int = 1) -> Batch:
    """This rank's rows of a global batch: its data-parallel share (the `tp` consecutive ranks
    of a tensor-parallel group take the same rows, as do the `pp` pipeline ranks)."""
    rank, size = world()
    rank, size = (rank % (size // pp)) // tp, size // pp // tp
    local = tokens.shape[0] // size
    part = tokens[rank * local : (rank + 1) * local]
    return Batch(part[:, :-1].contiguous(), part[:, 1:].contiguous(), torch.zeros_like(part[:, 1:]))


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer as a whole tensor (gathered from shards)."""
    out = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
    return out


def train(
    rank: int,
    model_cfg: ModelConfig,
    layout: dict[str, Any],
    steps: int,
    micro_batches: int = 1,
    precision: str = "fp32",
    grad_clip: float = 1.0,
    resume_from: str = "",
    save_to: str = "",
    optimizer_name: str = "adamw",
    qk_clip_tau: float = 0.0,
    compile: bool = False,
    float8: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train `steps` steps; returns losses, grad norms, the initial and final full weights.

    resume_from: a checkpoint directory (trainer.checkpoint layout) to load first; training then
    continues on the global batches after its step. save_to: checkpoint root to save into at the
    end."""
    optim_cfg = OptimConfig(name=optimizer_name, lr=3e-3, warmup_steps=0, schedule="constant")
    pp = layout.get("pp", 1)
    engine = engine_for(model_cfg, layout, precision, optim_cfg, compile, micro_batches, float8)
    model = engine.model
    initial = full_state(model)
    distributed_muon.work.clear()
    hooks = start_hooks(engine, qk_clip_tau, None)  # MoE balancing, QK-clip, ...
    stats = []
    tracker = LossTracker(0.0)
    first = 0
    loaded = None
    if resume_from:
        first = load_checkpoint(Path(resume_from), engine, rank)["step"]
        loaded = full_state(model)
    losses, norms = [], []
    settings = StepSettings(micro_batches=micro_batches, grad_clip=grad_clip)
    for tokens in global_batches(first + steps, model_cfg.vocab_size)[first:]:
        batch = local_batch(tokens, engine.ranks_per_forward * layout.get("cp", 1), pp)
        result = train_step(engine, batch, settings, tracker, hooks)
        stats.append(result.metrics)
        losses.append(result.loss)
        norms.append(result.grad_norm)
    if save_to:
        Checkpointer(Path(save_to), rank, keep=1).save(
            first + steps, engine, {"step": first + steps}
        )
    placements = {
        name: str(p.placements) if isinstance(p, DTensor) else "local"
        for name, p in model.named_parameters()
    }
    return {
        "losses": losses,
        "stats": stats,
        "norms": norms,
        "initial": initial,
        "loaded": loaded,  # the weights as resumed (None without resume_from)
        "final": full_state(model),
        "placements": placements,
        "modules": {name: type(module).__name__ for name, module in model.named_modules()},
        "weight_types": {  # the local tensors' classes (torchao's float8 all-gather wrapper)
            name: type(p.to_local() if isinstance(p, DTensor) else p.data).__name__
            for name, p in model.named_parameters()
        },
        "float8_scaled": sum(  # float8 weights whose scale was precomputed for the all-gather
            getattr(p._local_tensor if isinstance(p, DTensor) else p, "_precomputed_scale", None)
            is not None
            for p in model.parameters()
        ),
        "newton_schulz": dict(distributed_muon.work),
        "local": {
            name: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()
        },
    }


def engine_for(
    model_cfg: ModelConfig,
    layout: dict[str, Any],
    precision: str = "fp32",
    optim_cfg: OptimConfig | None = None,
    compile: bool = False,
    micro_batches: int = 1,
    float8: dict[str, Any] | None = None,
) -> TrainingEngine:
    """The trainer's engine for this layout on this rank's CPU (seed 0); `micro_batches`: the
    step's (a pipeline's schedule is built for them); `float8`: trainer.float8 settings (with
    precision "float8"; filter "all" unless given: the small models' GEMMs are below torchao's
    size thresholds)."""
    _, size = world()
    pcfg = ParallelConfig(**layout)
    dims = ParallelDims.resolve(pcfg, size)
    micro = GLOBAL_BATCH // dims.dp_ranks // micro_batches if micro_batches > 1 else 0
    tcfg = TrainerConfig(
        precision=precision,
        batch_size=GLOBAL_BATCH,
        compile=compile,
        micro_batch_size=micro,
        float8=Float8Config(**({"filter": "all"} | (float8 or {}))),
    )
    optim_cfg = optim_cfg or OptimConfig()
    return build_training_engine(model_cfg, tcfg, pcfg, optim_cfg, dims, torch.device("cpu"), 0)


def gradients(rank: int, model_cfg: ModelConfig, layout: dict[str, Any]) -> dict[str, Any]:
    """One forward + backward of the first global batch (fp32): the loss (mean over ranks), the
    routed-token counts summed over ranks, and every parameter's full gradient."""
    from model.moe import expert_load, pop_aux_loss

    _, size = world()
    model = engine_for(model_cfg, layout).model
    together = layout.get("cp", 1) * layout.get("tp", 1)  # ranks reading the same rows
    batch = local_batch(global_batches(1, model_cfg.vocab_size)[0], together)
    loss = model(batch.inputs, batch.targets)
    aux = pop_aux_loss(model)
    (loss + aux if aux is not None else loss).backward()
    load = expert_load(model)
    mean_loss = loss.detach().clone()
    if size > 1:
        dist.all_reduce(mean_loss)
        dist.all_reduce(load)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = (g.full_tensor() if isinstance(g, DTensor) else g).clone()
    return {"loss": float(mean_loss) / size, "load": load, "grads": grads}


def dispatch_matches_local(rank: int, counts_by_rank: list[list[int]]) -> dict[str, Any]:
    """The all-to-all dispatch over 2 ranks vs all experts local, on hand-made uneven counts
    (some experts get no rows): outputs and input gradients must agree."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from model.moe import GroupedExperts
    from parallel.expert_parallel import AllToAllDispatch

    torch.manual_seed(0)
    experts = GroupedExperts(len(counts_by_rank[0]), 8, 4, F.silu)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.5)
    reference = {name: w.detach().clone() for name, w in experts.named_parameters()}
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    sharded = GroupedExperts(len(counts_by_rank[0]), 8, 4, F.silu)
    sharded.load_state_dict(reference)
    from parallel.expert_parallel import shard_experts

    shard_experts(sharded, mesh)
    counts = torch.tensor(counts_by_rank[rank])
    x = torch.randn(int(counts.sum()), 8, generator=torch.Generator().manual_seed(rank))
    x_ep = x.clone().requires_grad_()
    y_ep = AllToAllDispatch(mesh.get_group())(x_ep, counts, sharded)
    x_ref = x.clone().requires_grad_()
    y_ref = experts(x_ref, counts)
    (y_ep.square().sum()).backward()
    (y_ref.square().sum()).backward()
    return {"y": (y_ep.detach(), y_ref.detach()), "dx": (x_ep.grad, x_ref.grad)}


def sharded_newton_schulz(
    rank: int, shapes: list[tuple[int, ...]], batch_elements: int | None = None
) -> dict[str, Any]:
    """orthogonalize_all on sharded matrices equals each whole matrix orthogonalized alone,
    bitwise, through the owner path for FSDP, HSDP, fused blocks and experts split inside each
    expert, with same-shaped matrices batched (at most `batch_elements` per batch, if given);
    returns the comparisons and how many matrices this rank orthogonalized."""
    from functools import partial

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from optim import distributed_muon, newton_schulz
    from optim.matrix_blocks import MatrixBlocks, orthogonalize_blocks
    from optim.newton_schulz import WholeMatrix, coefficient_schedule, orthogonalize

    _, size = world()
    if batch_elements is not None:
        newton_schulz.BATCH_ELEMENTS = batch_elements  # this rank's process only
    coefficients = coefficient_schedule("quintic", 5)
    plain = WholeMatrix(tuple(coefficients))  # batched with the same shape
    alone = partial(orthogonalize, coefficients=coefficients)  # the reference: one at a time
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(*shape, generator=gen) for shape in shapes]
    stacks = [t for t in full if t.ndim == 3]
    flat = init_device_mesh("cpu", (size,))
    cases = [(t, flat, [Shard(0)], plain) for t in full]  # FSDP; stacks split along E
    cases += [(t, flat, [Shard(1)], plain) for t in stacks]  # stacks split inside experts
    blocks = MatrixBlocks(dim=0, heads=4, parts=(3, 5), per_head=False)  # (32, 24): 2 matrices
    fused = partial(
        orthogonalize_blocks, coefficients=coefficients, blocks=blocks, scaling="spectral"
    )
    cases.append((torch.randn(32, 24, generator=gen), flat, [Shard(0)], fused))
    cases += [(t, flat, [Replicate()], plain) for t in full if t.ndim == 2]  # replicas only
    if size == 4:
        mesh2d = init_device_mesh("cpu", (2, 2))
        cases += [(t, mesh2d, [Replicate(), Shard(0)], plain) for t in full if t.ndim == 2]  # HSDP
        cases += [(t, mesh2d, [Shard(0), Shard(1)], plain) for t in stacks]  # EP x FSDP inside
        cases += [(t, mesh2d, [Replicate(), Shard(1)], plain) for t in stacks]  # HSDP experts
    sharded = [distribute_tensor(t, mesh, p, src_data_rank=None) for t, mesh, p, _ in cases]
    distributed_muon.work.clear()
    results = distributed_muon.orthogonalize_all(sharded, [ns for *_, ns in cases])
    equal = [
        torch.equal(r.full_tensor().float(), (alone if ns is plain else ns)(t).float())
        for r, (t, _, _, ns) in zip(results, cases)
    ]
    return {"equal": equal, "work": dict(distributed_muon.work)}


def _engine_from(model_cfg: ModelConfig, layout: dict[str, Any], parts) -> TrainingEngine:
    """The fp32 engine in `layout` on this group's ranks, started from `parts()`."""
    pcfg = ParallelConfig(**layout)
    dims = ParallelDims.resolve(pcfg, world()[1])
    tcfg = TrainerConfig(precision="fp32", batch_size=GLOBAL_BATCH, compile="false")
    cpu = torch.device("cpu")
    return build_training_engine(model_cfg, tcfg, pcfg, OptimConfig(), dims, cpu, 0, parts)


def started_from_weights(rank: int, model_cfg: ModelConfig, layout: dict[str, Any]) -> dict:
    """The engine built with initial weights (init_from): another seed's whole model, given
    one tensor per part, which each rank must cut into its own shards (FSDP, expert
    parallelism)."""
    from model.transformer import build_model

    weights = build_model(model_cfg, device="cpu", seed=7).state_dict()
    parts = lambda: ({name: tensor} for name, tensor in weights.items())  # noqa: E731
    return full_state(_engine_from(model_cfg, layout, parts).model)


def started_from_expert_stacks(rank: int, model_cfg: ModelConfig, layout: dict[str, Any]) -> dict:
    """The engine built from weights whose expert stacks are `ExpertStack`s (as a streamed HF
    import gives them) in which the experts of the other expert-parallel ranks cannot be read;
    returns this rank's loaded weights, whole."""
    from model.hf.expert_stack import ExpertStack
    from model.transformer import build_model
    from tests.model.hf_helpers import Unreadable

    weights = build_model(model_cfg, device="cpu", seed=7).state_dict()
    E, ep = model_cfg.moe.n_routed_experts, layout["ep"]
    own = range(rank % ep * E // ep, (rank % ep + 1) * E // ep)  # consecutive ranks share tokens

    def stack(name: str, tensor: torch.Tensor):
        if ".experts.w_" not in name:
            return tensor
        matrices = [tensor[j].T.contiguous() for j in range(E)]  # as checkpoints store them
        return ExpertStack([m if j in own else Unreadable(m) for j, m in enumerate(matrices)])

    parts = lambda: [{name: stack(name, t) for name, t in weights.items()}]  # noqa: E731
    return full_state(_engine_from(model_cfg, layout, parts).model)


class CountedReads:
    """A whole tensor read on demand (parallel.init.Sliceable) that counts the elements read."""

    def __init__(self, tensor: torch.Tensor, reads: dict[str, int], name: str) -> None:
        self.tensor, self.reads, self.name, self.shape = tensor, reads, name, tensor.shape

    def detach(self) -> CountedReads:
        return self

    def __getitem__(self, index: tuple) -> torch.Tensor:
        piece = self.tensor[index]
        self.reads[self.name] = self.reads.get(self.name, 0) + piece.numel()
        return piece


def started_from_counted_reads(
    rank: int, model_cfg: ModelConfig, layout: dict[str, Any]
) -> tuple[dict, dict[str, int], dict[str, int]]:
    """The engine started from another seed's whole weights read on demand: the loaded weights
    (whole), the elements this rank read of each tensor and the elements it holds of each."""
    from model.transformer import build_model

    weights = build_model(model_cfg, device="cpu", seed=7).state_dict()
    reads: dict[str, int] = {}
    parts = lambda: [{n: CountedReads(t, reads, n) for n, t in weights.items()}]  # noqa: E731
    model = _engine_from(model_cfg, layout, parts).model
    held = {
        name: (p.to_local() if isinstance(p, DTensor) else p).numel()
        for name, p in model.named_parameters()
    }
    return full_state(model), reads, held


def scored_log_probs(
    rank: int, model_cfg: ModelConfig, layout: dict[str, Any], precision: str = "fp32"
) -> torch.Tensor:
    """engine.evaluation_log_probs of this rank's slice of a fixed batch (some targets ignored,
    as a scored context is), from the seeded initial weights."""
    engine = engine_for(model_cfg, layout, precision)
    batch = local_batch(global_batches(1, model_cfg.vocab_size)[0])
    targets = batch.targets.clone()
    targets[:, : SEQ // 2] = -100  # the context of each row
    with engine.evaluating():
        return engine.evaluation_log_probs(batch.inputs, targets, None)


def downstream_scores(
    rank: int, model_cfg: ModelConfig, layout: dict[str, Any], tasks: list, batch_tokens: int
) -> tuple[torch.Tensor, dict]:
    """Downstream scoring of `tasks` (trainer.downstream) through this layout's engine: every
    request's log-likelihood and the tasks' metrics, as this rank ends up with them."""
    return score_tasks(engine_for(model_cfg, layout), tasks, batch_tokens, model_cfg.vocab_size - 1)


def score_tasks(engine: TrainingEngine, tasks: list, batch_tokens: int, pad_id: int) -> tuple:
    from trainer.downstream.evaluator import DownstreamEvaluator

    evaluator = DownstreamEvaluator(tasks, batch_tokens, pad_id)
    cpu = torch.device("cpu")
    with engine.evaluating():
        together = engine.scoring_share()  # tp (and pipeline) ranks score one batch together
        sums = evaluator.log_likelihoods(engine.evaluation_log_probs, cpu, together=together)
        return sums, evaluator.evaluate(engine.evaluation_log_probs, cpu, together=together)
