"""The training-engine interface: everything the trainer's loop asks of what runs the model.

The loop (trainer/step.py, trainer/loop.py) talks to one `TrainingEngine`; it never touches
FSDP, DTensors, master weights or the optimizer's internals. An engine owns the (wrapped) model
and the optimizer and offers:

  model                  the model module itself (a Transformer, possibly sharded in place):
                         evaluation runs its forward and the training hooks
                         (model.training_hooks) are built on it; a wrapping engine puts its
                         inner module here
  optimizer              its param groups are what the schedules set (lr, Muon momentum)
  autocast()             the compute precision of forwards
  evaluation_loss(...)   one batch's loss without gradients (validation); `evaluating()`: the
                         model in evaluation mode inside
  evaluation_log_probs(...)  each target's log-probability without gradients (scoring)
  forward_backward(..., objective)  one micro-batch: forward, backward of objective(loss)
                         (accumulating); the only way the loop reaches the model
  clip_gradients(c)      the global gradient norm over every shard, clipped to c
  step(edit)             the update; `edit` (the hooks' after_update, e.g. QK-clip) gets
                         `updated_weights()` after it: the module the optimizer updated (the fp32
                         masters when there are) and `row_scaler()`, how to scale its rows
  finish_step(c, ok, edit)  clip, then step unless the loss was bad (`ok` False) or the norm is
                         not finite: what the loop calls (by default the two above)
  zero_grad()            drop the gradients (also how a bad step is skipped)
  full_weights()         a context with whole weights for generation (sampling)
  state_dict() / load_state_dict(state)   model + optimizer state for checkpoints, in DCP's
                         form (names independent of the layout, so loading reshards)
  checkpoint_format, write_checkpoint, checkpoint_conflict, read_checkpoint   what the engine
                         writes into a checkpoint and reads back (parallel.checkpoint_format;
                         DCP by default, DeepSpeed's own files)
  state_module           the module whose weights the optimizer updates and checkpoints hold
  weight_modules()       the distinct modules holding weights (model, then state_module)
  nonfinite_weights()    the weights holding NaN or inf on this rank (never saved, sampled)
  ranks_per_forward      consecutive ranks that run one forward on the same inputs (tensor
                         parallelism: they hold the same statistics and score the same requests;
                         context-parallel ranks split only training forwards, so each scores
                         its own)

The engine knows no model feature: what a feature adds to a step comes through the objective
and the edit the trainer's step passes in, and parallel code finds parts by parameter role.
Engines register by name in `ENGINES` (`parallel.engine`). `fsdp2` is the built-in one: one
process or FSDP2/HSDP (+ expert parallelism), built by one composition path (`build_fsdp2`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from model.config import ModelConfig
from model.registry import Registry
from model.training_hooks import RowScaler, UpdatedWeights
from parallel.checkpoint_format import CheckpointFormat
from parallel.collective import rank_and_size
from parallel.config import Float8Config, ParallelConfig
from parallel.fsdp import replicated_tables
from parallel.grad_norm import clip_grad_norm, tp_size
from parallel.mesh import ParallelDims
from parallel.precision import MasterWeights, autocast_factory
from parallel.sequence_parallel import sum_partial_gradients
from parallel.sparse_sync import average_sparse_gradients

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]


Objective = Callable[[Tensor], Tensor]  # the language-model loss -> the loss to backpropagate
Edit = Callable[[UpdatedWeights], None]  # what runs on the updated weights (the trainer's hooks)


def plain_loss(loss: Tensor) -> Tensor:
    """The objective of a model without extra terms: the language-model loss itself."""
    return loss


class ModuleState(CheckpointFormat):
    """A module and its optimizer as one checkpointable state (DCP's state-dict helpers)."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = module, optimizer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.module,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )


class CheckpointRefusal(RuntimeError):
    """An engine's own checkpoint reader cannot use a checkpoint here (not damage: the trainer
    refuses it by name instead of falling back past it)."""


class TrainingEngine(CheckpointFormat):
    """The interface (see the module docstring); subclasses implement every method. The
    checkpoint methods (parallel.checkpoint_format) default to DCP over state_dict()."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    # the run's directory, for an engine's temporary files (DeepSpeed's checkpoint conversion);
    # set by the trainer, None elsewhere (then beside the checkpoint read)
    scratch_dir: Path | None = None
    # consecutive ranks that run one forward together on the same inputs (tensor parallelism);
    # they hold the same statistics and score the same requests
    ranks_per_forward: int = 1
    # the ranks whose training hooks hold statistics of the same layers, which they reduce
    # together (None: every rank; a pipeline: the ranks of one pipeline rank's stages)
    statistics_group: Any = None

    @property
    def state_module(self) -> nn.Module:
        raise NotImplementedError

    def autocast(self) -> AbstractContextManager:
        raise NotImplementedError

    def forward_backward(
        self,
        inputs: Tensor,
        targets: Tensor,
        doc_ids: Tensor | None,
        divide_by: int,
        last: bool,
        objective: Objective,
    ) -> Tensor:
        """Forward of one micro-batch, backward of objective(loss) / divide_by (the features'
        terms added: model.training_hooks.objective_with); returns the detached language-model
        loss. `last`: the step's final micro-batch. The only way the loop reaches the model."""
        raise NotImplementedError

    def forward_backward_step(
        self,
        inputs: Tensor,
        targets: Tensor,
        doc_ids: Tensor | None,
        micro_batches: int,
        objective: Objective,
    ) -> Tensor:
        """A step's forwards and backwards over this rank's rows (B, T), split into
        `micro_batches` equal parts (gradient accumulation); returns the sum of their detached
        language-model losses. By default `forward_backward` per part; a pipeline engine runs
        them through its schedule."""
        total = torch.zeros((), device=inputs.device)
        parts = [t.chunk(micro_batches) if t is not None else None for t in (inputs, targets)]
        docs = doc_ids.chunk(micro_batches) if doc_ids is not None else [None] * micro_batches
        for index, (x, y, d) in enumerate(zip(*parts, docs)):
            last = index == micro_batches - 1
            total += self.forward_backward(x, y, d, micro_batches, last, objective)
        return total

    def scoring_share(self) -> tuple[int, int, bool]:
        """(this rank's scoring group, how many groups, whether it reports the group's scores):
        the `ranks_per_forward` consecutive ranks of a group score the same batches."""
        rank, size = rank_and_size()
        together = self.ranks_per_forward
        return rank // together, size // together, rank % together == 0

    def gather_metrics(
        self, metrics: dict[str, float], combine: dict[str, str]
    ) -> dict[str, float]:
        """The hooks' metrics of the whole model: a pipeline merges its stages' (`combine`:
        model.training_hooks.merge_stage_metrics)."""
        return metrics

    def evaluation_loss(self, inputs: Tensor, targets: Tensor, doc_ids: Tensor | None) -> Tensor:
        """One batch's mean language-model loss, without gradients (validation): the loop's
        only other way to the model (a pipeline engine runs it through its stages)."""
        with torch.no_grad(), self.autocast():
            return self.model(inputs, targets, doc_ids=doc_ids)

    def evaluation_log_probs(
        self, inputs: Tensor, targets: Tensor, doc_ids: Tensor | None = None
    ) -> Tensor:
        """Each target's log-probability (B, T) fp32, 0 where the target is ignored, without
        gradients: downstream scoring (a continuation's log-likelihood is the sum over its
        tokens). Every rank scores its own rows; the model runs its forward as in training."""
        with torch.no_grad(), self.autocast():
            return self.model(inputs, targets, doc_ids=doc_ids, per_token=True)

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        """The model in evaluation mode inside (validation, sampling), training mode after."""
        self.model.eval()
        try:
            yield
        finally:
            self.model.train()

    def clip_gradients(self, max_norm: float) -> Tensor:
        raise NotImplementedError

    def step(self, edit: Edit | None = None) -> None:
        """The optimizer update, then `edit` on the weights it updated (`updated_weights`)."""
        raise NotImplementedError

    def updated_weights(self) -> UpdatedWeights:
        """What an `edit` after the update gets: the module whose weights the optimizer updates
        (`state_module`) and how to scale rows of its parameters (`row_scaler`)."""
        return UpdatedWeights(self.state_module, self.row_scaler())

    def row_scaler(self) -> RowScaler | None:
        """How to scale a parameter's rows in place where this engine keeps the updated weights;
        None: on the tensor itself (a DTensor's local rows), the default."""
        return None

    def finish_step(
        self, max_norm: float, apply: bool, edit: Edit | None = None
    ) -> tuple[float, bool]:
        """The end of a step: the accumulated gradients clipped to `max_norm` and, when `apply`
        (the loss was good) and their global norm is finite, the update (`edit` after it).
        Returns (the norm before clipping, whether the update was applied). Engines that clip
        and judge the norm inside their own step (DeepSpeed) override this."""
        norm = float(self.clip_gradients(max_norm))
        if apply and math.isfinite(norm):
            self.step(edit)
            return norm, True
        return norm, False

    def zero_grad(self) -> None:
        raise NotImplementedError

    def full_weights(self) -> AbstractContextManager[nn.Module]:
        raise NotImplementedError

    def nonfinite_weights(self) -> list[str]:
        """The names of the weights that hold NaN or inf in this rank's part of them (no
        collective: the caller agrees with the other ranks)."""
        return [
            name
            for name, param in self.state_module.named_parameters()
            if not bool(torch.isfinite(self.local_part(param)).all())
        ]

    def local_part(self, param: Tensor) -> Tensor:
        """This rank's values of `param` (a DTensor's local shard)."""
        return param.to_local() if isinstance(param, DTensor) else param

    def weight_modules(self) -> list[nn.Module]:
        """The distinct modules holding the model's weights: the running model, then the one
        checkpoints hold if that is another (an fp32 master copy); training hooks start on them."""
        return list({id(m): m for m in (self.model, self.state_module)}.values())


class FSDP2Engine(TrainingEngine):
    """One process, or FSDP2/HSDP (+ EP) over several: the same code, with these differences:

    - precision: several ranks keep sharded fp32 parameters and compute in FSDP2's param dtype
      (`parallel.param_dtype`); one process autocasts fp32 weights (`trainer.precision=bf16`) or
      keeps bf16 weights with an fp32 copy (`bf16_master`, `MasterWeights`);
    - gradient accumulation reduce-scatters after every micro-batch but all-reduces across HSDP
      replicas only after the last (`set_requires_all_reduce`);
    - sampling gathers the root's weights by hand (generation calls methods, not `forward`)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        precision: str,
        device: torch.device,
        master: MasterWeights | None = None,
    ) -> None:
        self.model, self.optimizer, self.master = model, optimizer, master
        self._autocast = autocast_factory(precision, device)
        self._replicated = replicated_tables(model)
        self.ranks_per_forward = tp_size(model)
        self.float8 = None  # trainer.precision=float8: the conversion (parallel/float8.py)

    @property
    def state_module(self) -> nn.Module:
        return self.master.master if self.master is not None else self.model

    @property
    def sharded(self) -> bool:
        return isinstance(self.model, FSDPModule)

    def autocast(self) -> AbstractContextManager:
        return self._autocast()

    def forward_backward(
        self,
        inputs: Tensor,
        targets: Tensor,
        doc_ids: Tensor | None,
        divide_by: int,
        last: bool,
        objective: Objective,
    ) -> Tensor:
        if self.sharded:
            self.model.set_requires_all_reduce(last)
        with self._autocast():
            loss = self.model(inputs, targets, doc_ids=doc_ids)
        (objective(loss) / divide_by).backward()
        return loss.detach().float()

    def clip_gradients(self, max_norm: float) -> Tensor:
        if self.sharded and self._replicated:  # Engram tables held whole by every rank
            average_sparse_gradients([t.weight for t in self._replicated])
        sum_partial_gradients(self.model)  # sequence parallelism's per-position weights
        if self.master is not None:  # bf16 gradients -> the fp32 master weights
            self.master.grads_to_master()
            params = [m for _, m in self.master.pairs if m.grad is not None]
        else:
            params = [p for p in self.model.parameters() if p.grad is not None]
        return clip_grad_norm(params, max_norm, self.ranks_per_forward)

    def step(self, edit: Edit | None = None) -> None:
        self.optimizer.step()
        if edit is not None:
            edit(self.updated_weights())
        if self.master is not None:
            self.master.master_to_model()
        if self.float8 is not None:  # the float8 weights' scales for the next gathers
            self.float8.after_step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    @contextmanager
    def full_weights(self) -> Iterator[nn.Module]:
        if not self.sharded:
            yield self.model
            return
        first = next(self.model.parameters())
        with torch.no_grad():  # a forward first: FSDP2 initializes itself lazily in one
            self.model(torch.zeros(1, 1, dtype=torch.long, device=first.device))
        self.model.unshard()
        try:
            yield self.model
        finally:
            self.model.reshard()

    def state_dict(self) -> dict[str, Any]:
        if self.master is not None:  # buffers the loop changes (MoE biases) live on the model
            self.master.buffers_to_master()
        return ModuleState(self.state_module, self.optimizer).state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ModuleState(self.state_module, self.optimizer).load_state_dict(state)
        if self.master is not None:
            self.master.master_to_model(buffers=True)


@dataclass(frozen=True)
class EngineRequest:
    """What an engine builder gets: the model and parallel configs, the trainer's precision and
    compile choice, the resolved layout and device, the seed, how to make the optimizer, and the
    step's shape (clip value, micro-batch size and count) for engines that own accumulation."""

    model_cfg: ModelConfig
    parallel: ParallelConfig
    precision: str  # trainer.precision, resolved (fp32 | bf16 | bf16_master | float8)
    compile: bool  # trainer.compile, resolved
    dims: ParallelDims
    device: torch.device
    seed: int
    make_optimizer: OptimizerFactory
    grad_clip: float = 0.0  # trainer.grad_clip (engines that clip inside their own step)
    micro_batch_size: int = 1  # sequences per forward on one rank
    micro_batches: int = 1  # forwards accumulated into one step on each rank
    seq_len: int = 0  # tokens per training sequence (a pipeline's stage shapes and split)
    optimizer_name: str = "adamw"  # optim.name (engines that cannot run every optimizer)
    # the whole weights (names of Transformer.state_dict()) to start from instead of the seeded
    # initialization, in parts (parallel.init.load_weights); called once, on every rank
    # (init_from)
    initial_weights: Callable[[], Iterable[dict[str, Tensor]]] | None = None
    float8: Float8Config = field(default_factory=Float8Config)  # trainer.float8 (precision float8)

    @property
    def float8_config(self) -> Float8Config | None:
        """trainer.float8 when the run trains in float8, else None."""
        return self.float8 if self.precision == "float8" else None


EngineBuilder = Callable[[EngineRequest], TrainingEngine]
ENGINES: Registry = Registry("training engine (parallel.engine)")  # name -> EngineBuilder


def build_engine(name: str, request: EngineRequest) -> TrainingEngine:
    """The engine `name` builds for `request` (a ConfigError listing the choices if unknown)."""
    return ENGINES.get(name)(request)
