"""Pipeline parallelism: the stack split into stages over `parallel.pp` ranks, run by
torch.distributed.pipelining's schedules, behind the same engine interface as FSDP2.

Build (`build_pipeline`): the whole model on the meta device gives the plan
(parallel/pipeline_split.py); each rank prunes it to its stages (model/stages.py: the parameter
names stay the whole model's), applies expert, tensor and context parallelism, activation
checkpointing and compile to what it holds, makes each stage a module of its own, shards every
stage with FSDP2 over the data (and context) ranks of its pipeline rank, and only then
materialises and initialises what it holds, as one process would (parallel/init.py), or reads
only its layers from `init_from` weights. Each stage gets static input/output shapes (the
residual stream declares what crosses a stage), so no metadata forward runs with made-up values.

A step (`forward_backward_step`) hands the rank's rows to the schedule, which splits them into
the micro-batches of the plan (its gradient accumulation). The last stage's loss per micro-batch
is objective(loss) / micro-batches, as the loop does without a pipeline (the schedule does not
divide again: scale_grads=False). A stage before the last adds its layers' objective terms (MoE
balance losses) through its output: `_with_term` gives them gradient 1 in that stage's backward.
Gradients are reduced by FSDP2 once per step; a shared embedding (tied head, MTP) has a copy on
the last stage whose gradient is summed with the first stage's before clipping, so both copies
take the same update. The gradient norm is global over every stage (each parameter counted
once), the loss is the last stage's, broadcast to the pipeline, so every rank clips, skips and
logs alike. Validation and scoring forwards pass the stages in order, point to point.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

from model.errors import ConfigError
from model.stages import (
    StageLayout,
    embedding_copy,
    holds_embedding,
    keep_stages,
    shares_embedding,
    stage_view,
)
from model.training_hooks import Metrics, merge_stage_metrics
from model.transformer import Transformer
from parallel.compose import fsdp_param_dtype, parallelize
from parallel.engine import EngineRequest, FSDP2Engine, Objective
from parallel.float8 import gather_float8_as_bytes
from parallel.fsdp import apply_fsdp, mixed_precision
from parallel.grad_norm import global_grad_norm
from parallel.init import init_like_single_process, load_weights
from parallel.mesh import Meshes, build_meshes
from parallel.pipeline_generate import PipelinedModel
from parallel.pipeline_split import (
    SPLIT_BACKWARD,
    PipelinePlan,
    check_pipeline_model,
    plan_pipeline,
    schedule_class,
)

log = logging.getLogger("parallel")


class _WithTerm(torch.autograd.Function):
    """output unchanged; in backward the term (a scalar) gets gradient 1: a stage's objective
    terms join the backward that the next stage's gradient starts (Megatron-LM's
    MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, output: Tensor, term: Tensor) -> Tensor:
        ctx.term_shape, ctx.term_dtype = term.shape, term.dtype
        return output.clone()  # (not a view: the zero-bubble schedules detach outputs in place)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
        return grad, torch.ones(ctx.term_shape, dtype=ctx.term_dtype, device=grad.device)


class PipelineEngine(FSDP2Engine):
    """FSDP2 per stage under a pipeline schedule (see the module docstring)."""

    def __init__(
        self,
        model: Transformer,
        views: list[nn.Module],
        plan: PipelinePlan,
        meshes: Meshes,
        optimizer: torch.optim.Optimizer,
        precision: str,
        device: torch.device,
        micro_batches: int,
        compute_dtype: torch.dtype,
    ) -> None:
        super().__init__(model, optimizer, precision, device)
        self.views, self.plan, self.device = views, plan, device
        self.micro_batches, self.compute_dtype = micro_batches, compute_dtype
        # what crosses a stage is in the stream's dtype (mHC's n streams stay fp32)
        self.boundary_dtype = model.stream.boundary_dtype(compute_dtype)
        self.pp_group = meshes.pp.get_group()
        self.pp_rank = meshes.pp.get_local_rank()
        self.statistics_group = meshes.stage.get_group()
        self._by_index = {view.stage.index: view for view in views}
        self._objective: Objective | None = None
        self._losses: list[Tensor] = []
        self._embedding_group = _embedding_group(model, plan, meshes)
        # the last stage's own copy of the embedding, when this rank holds the first too
        copy = embedding_copy(model, views)
        self._copy = copy.weight if copy is not None else None
        self._copy_embedding()
        # the schedule for each local batch shape (built on first use: its stage shapes are the
        # micro-batches')
        self._schedules: dict[tuple[int, ...], object] = {}
        for view in views:
            view.register_forward_hook(self._attach_terms)

    # -- training ---------------------------------------------------------------------------
    def forward_backward(self, inputs, targets, doc_ids, divide_by, last, objective) -> Tensor:
        raise RuntimeError("a pipeline runs whole steps: forward_backward_step")

    def forward_backward_step(
        self,
        inputs: Tensor,
        targets: Tensor,
        doc_ids: Tensor | None,
        micro_batches: int,
        objective: Objective,
    ) -> Tensor:
        if micro_batches != self.micro_batches:
            raise ValueError(
                f"the pipeline was built for {self.micro_batches} micro-batches, got {micro_batches}"
            )
        schedule = self._schedule_for(inputs.shape)
        self._objective, self._losses = objective, []
        kwargs = {"ids": inputs, "targets": targets}
        if doc_ids is not None:
            kwargs["doc_ids"] = doc_ids
        args = (inputs,) if 0 in self._by_index else ()
        with self._autocast():
            schedule.step(*args, target=targets, return_outputs=False, **kwargs)
        total = torch.zeros((), device=self.device)
        if self._losses:
            total = torch.stack(self._losses).sum()
        self._objective, self._losses = None, []
        return self.from_last_stage(total)

    def _loss(self, output: Tensor, target: Tensor) -> Tensor:
        """The schedule's loss of one micro-batch on the last stage: the stage returned the
        language-model loss (the features' terms ride on it), divided by the micro-batches."""
        self._losses.append(output.detach().float())
        return output / self.micro_batches

    def _attach_terms(self, module: nn.Module, args: tuple, output):
        """After a stage's forward: its layers' objective terms (popped at once, so each
        micro-batch gets its own; on the last stage MTP's too) ride on its first output tensor,
        inside the stage's own graph (the zero-bubble schedules split its backward)."""
        if not isinstance(output, Tensor):  # the stream's state, in its declared dtype
            output = tuple(self._own(t.to(self.boundary_dtype), args) for t in output)
        if self._objective is None or not torch.is_grad_enabled():
            return output
        zero = torch.zeros((), device=self.device)
        term = self._objective(zero)
        if not term.requires_grad:
            return output
        if isinstance(output, Tensor):  # the last stage's loss
            return _WithTerm.apply(output, term / self.micro_batches)
        first, *rest = output
        return (_WithTerm.apply(first, term / self.micro_batches), *rest)

    @staticmethod
    def _own(tensor: Tensor, inputs: tuple) -> Tensor:
        """`tensor` as an output of the stage's own: a copy where it is a view or one of the
        stage's inputs passed on (AttnRes' earlier sources), which torch's split-backward
        schedules would detach in place."""
        if tensor._is_view() or any(tensor is given for given in inputs):
            return tensor.clone()
        return tensor

    def _schedule_for(self, shape: torch.Size):
        """The schedule for local batches of `shape` (built once; a new shape builds anew)."""
        if tuple(shape) in self._schedules:
            return self._schedules[tuple(shape)]
        rows, length = shape
        if rows % self.micro_batches:
            raise ValueError(
                f"{rows} rows per rank do not split into {self.micro_batches} micro-batches"
            )
        stages = [
            self._pipeline_stage(view, rows // self.micro_batches, length) for view in self.views
        ]
        cls = schedule_class(self.plan.schedule)
        multi = issubclass(cls, PipelineScheduleMulti)
        try:
            schedule = cls(
                stages if multi else stages[0],
                n_microbatches=self.micro_batches,
                loss_fn=self._loss,
                scale_grads=False,
            )
        except (ValueError, AssertionError) as err:
            raise ConfigError(
                f"parallel.pp_schedule={self.plan.schedule} with {self.micro_batches} "
                f"micro-batches on {len(self.plan.stages)} stages: {err}"
            ) from err
        self._schedules[tuple(shape)] = schedule
        return schedule

    def _pipeline_stage(self, view: nn.Module, rows: int, length: int) -> PipelineStage:
        layout: StageLayout = view.stage
        inputs = self._boundary(layout.layers[0], rows, length)  # (every stage has a block)
        if layout.first:
            inputs = (torch.zeros(rows, length, dtype=torch.long, device=self.device),)
        after = layout.layers[-1] + 1
        outputs = self._boundary(after, rows, length)
        if layout.last:
            outputs = (torch.zeros((), device=self.device),)
        return PipelineStage(
            view,
            layout.index,
            layout.count,
            self.device,
            input_args=inputs,
            output_args=outputs,
            group=self.pp_group,
        )

    def _boundary(self, layers: int, rows: int, length: int) -> tuple[Tensor, ...]:
        """Empty tensors shaped as the state after `layers` blocks (what crosses a stage)."""
        split = self.model.context_split
        local = split.local_length(length) if split is not None else length
        shapes = self.model.stream.boundary_shapes(layers, rows, local)
        return tuple(  # (requiring gradients: the stage before gets them back)
            torch.empty(shape, dtype=self.boundary_dtype, device=self.device, requires_grad=True)
            for shape in shapes
        )

    def from_last_stage(self, value: Tensor) -> Tensor:
        """`value` as the last stage's rank holds it, on every pipeline rank."""
        value = value.contiguous()
        dist.broadcast(value, group=self.pp_group, group_src=self._last_rank)
        return value

    @property
    def _last_rank(self) -> int:
        return self.plan.rank_of(len(self.plan.stages) - 1)

    def clip_gradients(self, max_norm: float) -> Tensor:
        copy = self._norm_excluded()
        if self._embedding_group is not None:
            self._sum_embedding_gradients()
        if self._copy is not None and self._copy.grad is not None:  # into the first stage's
            embed = self.model.embed.weight
            if embed.grad is None:
                embed.grad = self._copy.grad
            else:
                _local(embed.grad).add_(_local(self._copy.grad))
            self._copy.grad = None
        params = [p for p in self.model.parameters() if p.grad is not None and p is not copy]
        norm = global_grad_norm(params, self.ranks_per_forward)
        if max_norm != float("inf"):
            scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            if scale.item() < 1.0:
                grads = [_local(p.grad) for p in self.model.parameters() if p.grad is not None]
                torch._foreach_mul_(grads, scale)
        return norm

    def step(self, edit=None) -> None:
        super().step(edit)
        self._copy_embedding()

    def zero_grad(self) -> None:
        super().zero_grad()
        if self._copy is not None:
            self._copy.grad = None

    def load_state_dict(self, state) -> None:
        super().load_state_dict(state)
        self._copy_embedding()

    @torch.no_grad()
    def _copy_embedding(self) -> None:
        """The first stage's embedding into the last stage's copy on this rank (same layout)."""
        if self._copy is not None:
            _local(self._copy).copy_(_local(self.model.embed.weight))

    def _norm_excluded(self) -> nn.Parameter | None:
        """The last stage's copy of a shared embedding (counted in the norm by the first's)."""
        if self._embedding_group is None or any(v.stage.first for v in self.views):
            return None
        return self.model.embed.weight

    def _sum_embedding_gradients(self) -> None:
        weight = self.model.embed.weight
        grad = _local(weight.grad) if weight.grad is not None else None
        if grad is None:  # (an embedding no forward reached: contribute zeros)
            weight.grad = torch.zeros_like(weight)
            grad = _local(weight.grad)
        dist.all_reduce(grad, group=self._embedding_group)

    # -- evaluation -------------------------------------------------------------------------
    def evaluation_loss(self, inputs: Tensor, targets: Tensor, doc_ids: Tensor | None) -> Tensor:
        return self._forward_whole(inputs, targets, doc_ids, per_token=False)

    def evaluation_log_probs(
        self, inputs: Tensor, targets: Tensor, doc_ids: Tensor | None = None
    ) -> Tensor:
        return self._forward_whole(inputs, targets, doc_ids, per_token=True)

    @torch.no_grad()
    def _forward_whole(
        self, inputs: Tensor, targets: Tensor, doc_ids: Tensor | None, per_token: bool
    ) -> Tensor:
        """One forward through every stage in order (point to point between ranks), without
        gradients: the loss, or each target's log-probability (B, T), on every pipeline rank."""
        rows, length = inputs.shape
        split = self.model.context_split
        if split is not None and not per_token:  # (scoring forwards run whole under cp)
            length = split.local_length(length)
        kwargs = {"ids": inputs, "targets": targets, "doc_ids": doc_ids, "per_token": per_token}
        carried: tuple[Tensor, ...] | None = None
        out = torch.zeros(inputs.shape if per_token else (), device=self.device)
        with self._autocast():
            for layout in self.plan.stages:
                view = self._by_index.get(layout.index)
                if view is None:
                    carried = None
                    continue
                if layout.first:
                    carried = (inputs,)
                elif carried is None:  # from the rank of the stage before
                    carried = self.receive_state(layout, rows, length)
                result = view(*carried, **kwargs)
                if layout.last:
                    out = result.float()
                    break
                carried = tuple(result)
                self.send_state(layout, carried)
        return self.from_last_stage(out)

    def stage_views(self) -> dict[int, nn.Module]:
        """This rank's stages by index."""
        return self._by_index

    def send_state(self, layout: StageLayout, tensors: tuple[Tensor, ...]) -> None:
        """What stage `layout` sent on, to the next stage's rank when that is another."""
        rank = self.plan.rank_of(layout.index + 1)
        if rank != self.pp_rank:
            for tensor in tensors:
                dist.send(tensor.contiguous(), group=self.pp_group, group_dst=rank)

    def receive_state(self, layout: StageLayout, rows: int, length: int) -> tuple[Tensor, ...]:
        """The stream's state entering stage `layout`, from the previous stage's rank: the
        shapes the stream declares for `rows` x `length` positions."""
        first = layout.layers[0]
        tensors = []
        for shape in self.model.stream.boundary_shapes(first, rows, length):
            tensor = torch.empty(shape, dtype=self.boundary_dtype, device=self.device)
            dist.recv(tensor, group=self.pp_group, group_src=self.plan.rank_of(layout.index - 1))
            tensors.append(tensor)
        return tuple(tensors)

    @contextmanager
    def full_weights(self) -> Iterator[PipelinedModel]:
        """Sampling and generation through the stages (parallel/pipeline_generate.py): each
        stage's root weights gathered meanwhile (a first forward initializes FSDP2)."""
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self._forward_whole(ids, ids, None, per_token=False)
        for view in self.views:
            view.unshard()
        try:
            yield PipelinedModel(self)
        finally:
            for view in self.views:
                view.reshard()

    def scoring_share(self) -> tuple[int, int, bool]:
        """The pipeline ranks of a data index score the same batches (every stage's forward),
        as do the tp ranks within a stage; one of them reports."""
        rank, stage = dist.get_rank(), dist.get_world_size() // self.plan.pp
        at, tp = rank % stage, self.ranks_per_forward
        return at // tp, stage // tp, at % tp == 0 and self.pp_rank == 0

    def gather_metrics(self, metrics: Metrics, combine: dict[str, str]) -> Metrics:
        """Every stage's metrics merged on every rank (model.training_hooks.merge_stage_metrics),
        with every stage's combine rules (a rank without MoE layers has no MoE hook)."""
        every: list[tuple[Metrics, dict[str, str]] | None] = [None] * self.plan.pp
        dist.all_gather_object(every, (metrics, combine), group=self.pp_group)
        rules = {key: how for _, theirs in every for key, how in theirs.items()}
        return merge_stage_metrics([mine for mine, _ in every], rules)

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        """Every stage module (and the rank's model) in evaluation mode inside."""
        modules = [self.model, *self.views]
        for module in modules:
            module.eval()
        try:
            yield
        finally:
            for module in modules:
                module.train()
            self._reshard()

    def _reshard(self) -> None:
        """Free the weights that evaluation forwards gathered (kept gathered through a
        training step's micro-batches, they would stay until the next backward)."""
        for view in self.views:
            for module in view.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _embedding_group(model: Transformer, plan: PipelinePlan, meshes: Meshes):
    """The process group that sums a shared embedding's gradient: for each data/context/tensor
    position, the ranks of the first and the last stage (None without a shared embedding, or
    when one rank holds both)."""
    if not shares_embedding(model.cfg):
        return None
    first, last = plan.rank_of(0), plan.rank_of(len(plan.stages) - 1)
    if first == last:
        return None
    size = meshes.dims.ranks_per_stage  # pp is outermost: rank = pp_rank x size + position
    pairs = [[first * size + at, last * size + at] for at in range(size)]
    group, _ = dist.new_subgroups_by_enumeration(pairs)  # (every rank takes part)
    return group if holds_embedding(model.cfg, model.pipeline_stages) else None


def build_pipeline(request: EngineRequest) -> PipelineEngine:
    dims, device, parallel = request.dims, request.device, request.parallel
    meshes = build_meshes(dims, device.type)
    with torch.device("meta"):
        model = Transformer(request.model_cfg)
    plan = plan_pipeline(
        model,
        request.seq_len or request.model_cfg.max_seq_len,  # (callers that give no seq_len)
        dims.pp,
        parallel.pp_schedule,
        parallel.pp_stages_per_rank,
        parallel.pp_layers,
    )
    check_pipeline_model(request.model_cfg, parallel)
    if request.compile and plan.schedule in SPLIT_BACKWARD:
        # their input pass keeps the graph for the weight pass (retain_graph), which compiled
        # graphs whose saved buffers AOTAutograd donates refuse (torchtitan does the same)
        torch._functorch.config.donated_buffer = False
    pp_rank = meshes.pp.get_local_rank()
    layouts = plan.stages_of(pp_rank)
    keep_stages(model, layouts)
    param_dtype = fsdp_param_dtype(parallel, request.precision)
    float8 = parallelize(
        model,
        meshes,
        parallel,
        param_dtype,
        request.compile,
        device.type,
        fsdp=False,
        float8=request.float8_config,
    )
    views = [stage_view(model, layout) for layout in layouts]
    recompute = parallel.activation_checkpoint != "none"
    for view in views:  # gathered weights stay for the step's micro-batches (torchtitan's too)
        apply_fsdp(view, meshes, mixed_precision(param_dtype), False, recompute=recompute)
        if float8 is not None and float8.all_gather:
            gather_float8_as_bytes(view)
    for view in views:  # (a V schedule's last stage may hold an embedding copy of its own)
        view.to_empty(device=device)
    model.to_empty(device=device)
    init_like_single_process(model, device, request.seed)
    if request.initial_weights is not None:
        load_weights(model, request.initial_weights())
    optimizer = request.make_optimizer(model)
    if dist.get_rank() == 0:
        log.info("%s", plan.describe())
    engine = PipelineEngine(
        model,
        views,
        plan,
        meshes,
        optimizer,
        request.precision,
        device,
        request.micro_batches,
        param_dtype,
    )
    engine.float8 = float8
    return engine
