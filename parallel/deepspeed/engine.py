"""DeepSpeed as the training engine (`parallel.engine=deepspeed`, settings `parallel.deepspeed`).

`deepspeed.initialize` takes the plain model (no FSDP2, no DTensors: ZeRO partitions plain
parameters itself) with activation checkpointing and compile applied as under FSDP2, and the
trainer's optimizer as a client optimizer (its parameter groups, weight decay by role and
learning rates intact; with optimizer offload, DeepSpeed's CPU Adam over the same groups). The
trainer's semantics carry over:

  batch        each rank's micro-batches (trainer.micro_batch_size) accumulate into one step;
               the loop marks the last one, and scales each loss by 1 / micro-batches itself
  clipping     trainer.grad_clip, by DeepSpeed inside its step over the partitioned gradients
               (ZeRO-0: by the engine over the whole averaged gradients, as under FSDP2)
  bad steps    a non-finite gradient norm: DeepSpeed's own skip; a bad loss (judged by the loop
               before the step): the step's gradients are dropped through the same path
  precision    fp32; bf16 = autocast over fp32 weights (DeepSpeed's torch_autocast);
               bf16_master = bf16 weights with fp32 masters in the optimizer (DeepSpeed's bf16)

Checkpoints are DeepSpeed's own files in `<step dir>/deepspeed/`, written and committed by the
trainer's scheme (temporary directory, checksums, `latest`, fallback past damaged ones); on
another number of ranks or another ZeRO stage (1-3) they load through DeepSpeed's universal
checkpoint (converted beside the step directory, then removed). Every file is read with the
weights-only unpickler (parallel.deepspeed.safe_load). ZeRO stages 1-3 need a process group; one process gets a 1-rank
gloo group. Muon and MuonClip run through DeepSpeed's own Muon (parallel.deepspeed.muon); expert
parallelism through DeepSpeed's expert groups (parallel.deepspeed.experts, ZeRO 1-2); Engram's
tables outside ZeRO, whole on every rank (parallel.deepspeed.tables).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from model.errors import ConfigError
from model.training_hooks import RowScaler
from model.transformer import Transformer, build_model
from parallel.activation import apply_activation_checkpointing, compile_model
from parallel.checkpoint_format import DCPSource
from parallel.collective import worst_over_ranks
from parallel.deepspeed.checkpoint import (
    CHECKPOINT_FOLDER,
    check_partitions,
    read_layout,
    saved_stage,
    write_layout,
)
from parallel.deepspeed.experts import (
    declared_expert_layers,
    expert_parallel_problems,
    local_expert_weights,
    localize_experts,
    split_expert_groups,
)
from parallel.deepspeed.muon import MUON_OPTIMIZERS, deepspeed_muon, muon_problems
from parallel.deepspeed.reshard import convert_on_main, load_universal, remove_conversion
from parallel.deepspeed.safe_load import guard_engine
from parallel.deepspeed.tables import (
    AllGroups,
    HiddenTables,
    include_in_norm,
    tables_only_optimizer,
)
from parallel.engine import (
    ENGINES,
    CheckpointRefusal,
    Edit,
    EngineRequest,
    Objective,
    TrainingEngine,
)
from parallel.expert_parallel import expert_layers
from parallel.grad_norm import clip_grad_norm
from parallel.init import load_weights, whole_weights
from parallel.precision import autocast_factory

log = logging.getLogger("parallel.deepspeed")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ensure_process_group(device: torch.device) -> None:
    """DeepSpeed communicates through torch.distributed (one process gets a 1-rank group) and
    reads the launcher's rank variables (set here from the group where no launcher did)."""
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=0, world_size=1)
    os.environ.setdefault("RANK", str(dist.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])  # one node; torchrun/srun set it


def refuse_unsupported(request: EngineRequest, optimizer_name: str) -> None:
    """The settings this engine does not take yet, each with its reason (ConfigError)."""
    cfg, ds = request.model_cfg, request.parallel.deepspeed
    problems = []
    if request.dims.ep > 1:
        problems += expert_parallel_problems(ds.zero_stage, ds.offload_optimizer)
    if request.dims.tp > 1:
        problems.append(
            "parallel.tp > 1: tensor parallelism runs on parallel.engine=fsdp2 (DeepSpeed's "
            "AutoTP is not wired in); use parallel.engine=fsdp2 with parallel.tp"
        )
    if request.dims.cp > 1:
        problems.append(
            "parallel.cp > 1: context parallelism runs on parallel.engine=fsdp2 (DeepSpeed's "
            "Ulysses sequence parallelism is not wired in); use parallel.engine=fsdp2"
        )
    if request.dims.dp_replicate > 1:
        problems.append(
            "parallel.dp_replicate > 1 (HSDP) is FSDP2's layout; ZeRO partitions over every rank"
        )
    if cfg.engram.enabled and cfg.engram.sharding != "replicated":
        problems.append(
            f"model.engram.sharding={cfg.engram.sharding} is FSDP2's: DeepSpeed keeps the tables "
            "out of ZeRO, whole on every rank; set model.engram.sharding=replicated"
        )
    if cfg.engram.enabled and cfg.engram.offload and request.dims.world_size > 1:
        problems.append(
            "model.engram.offload=true keeps the tables in one process's host memory; it does "
            "not work with several ranks yet: set model.engram.offload=false"
        )
    if ds.zero_stage == 0 and request.precision == "bf16_master":
        problems.append(
            "trainer.precision=bf16_master with parallel.deepspeed.zero_stage=0 (DeepSpeed's fp16 "
            "wrapper path): use zero_stage >= 1, or trainer.precision=bf16 / fp32"
        )
    if problems:
        raise ConfigError("parallel.engine=deepspeed: " + "; ".join(problems))


def deepspeed_config(request: EngineRequest) -> dict[str, Any]:
    """DeepSpeed's config: the user's JSON (parallel.deepspeed.config) with the trainer's and
    parallel.deepspeed's settings filled in; a key the JSON sets to another value is refused."""
    ds = request.parallel.deepspeed
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    for key, device in (
        ("offload_optimizer", ds.offload_optimizer),
        ("offload_param", ds.offload_params),
    ):
        if device != "none":
            zero[key] = {"device": device} | (
                {"nvme_path": ds.nvme_path} if device == "nvme" else {}
            )
    if request.optimizer_name in MUON_OPTIMIZERS and ds.zero_stage == 3:
        zero["reduce_scatter"] = False  # DeepSpeed's ZeRO-3 Muon gathers whole gradients
    if ds.zero_stage > 0:  # the loop reports and judges the norm; the tables' clip needs it
        zero["compute_grad_norm"] = True
    if request.dims.ep > 1:  # each rank's experts live only in its fp32 partitions
        zero["load_from_fp32_weights"] = True
    ours: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": request.micro_batch_size,
        "gradient_accumulation_steps": request.micro_batches,
        "gradient_clipping": request.grad_clip if ds.zero_stage > 0 else 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": request.precision == "bf16_master"},
        # gradients reduced in fp32, as FSDP2 does (DeepSpeed's default under bf16 is bf16)
        "communication_data_type": "fp32",
        "steps_per_print": 2**31 - 1,
        "zero_allow_untested_optimizer": True,
    }
    if request.precision == "bf16":
        # no module's weights communicated in bf16 (DeepSpeed's default marks nn.Linear's)
        ours["torch_autocast"] = {
            "enabled": True,
            "dtype": "bfloat16",
            "lower_precision_safe_modules": [],
        }
    theirs: dict[str, Any] = {}
    if ds.config:
        path = Path(ds.config)
        if not path.is_file():
            raise ConfigError(f"parallel.deepspeed.config={ds.config}: no such file")
        try:
            theirs = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"parallel.deepspeed.config={ds.config} is not JSON: {err}") from None
    return _merge(theirs, ours, "")


def _merge(theirs: dict, ours: dict, prefix: str) -> dict:
    merged = dict(theirs)
    for key, value in ours.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(theirs.get(key), dict):
            merged[key] = _merge(theirs[key], value, name + ".")
        elif key in theirs and theirs[key] != value:
            raise ConfigError(
                f"parallel.deepspeed.config sets {name}={theirs[key]!r}, but the run sets it to "
                f"{value!r} (from trainer.* / parallel.deepspeed.*): set it in one place"
            )
        else:
            merged[key] = value
    return merged


class DeepSpeedEngine(TrainingEngine):
    """The TrainingEngine over a `deepspeed.DeepSpeedEngine` (see the module docstring)."""

    def __init__(
        self,
        ds_engine: Any,
        precision: str,
        device: torch.device,
        grad_clip: float,
        muon: bool = False,
        ep: int = 1,
        tables: HiddenTables | None = None,
    ):
        self.ds = ds_engine
        self.ep = ep  # expert-parallel degree (parallel.deepspeed.experts)
        self.tables = tables  # Engram's, outside ZeRO (parallel.deepspeed.tables)
        self.model: Transformer = ds_engine.module
        # param_groups: the client optimizer's groups (and the tables' row-wise Adam groups)
        self.optimizer = (
            ds_engine.optimizer
            if tables is None
            else AllGroups(ds_engine.optimizer, tables.optimizer)
        )
        self.stage = ds_engine.zero_optimization_stage()
        self._tables_square = torch.zeros(())  # the tables' part of the step's norm, squared
        if tables is not None and self.stage > 0:
            include_in_norm(ds_engine.optimizer, lambda: self._tables_square)
        self.grad_clip = grad_clip
        self.muon = muon
        # ZeRO 1-3's norm under Muon covers Muon's orthogonalized updates, not the gradients
        self.reports_norm = not (muon and self.stage > 0)
        self._universal: Path | None = None  # a converted checkpoint read_checkpoint loads
        self._autocast = autocast_factory(precision, device)
        self._buffer_names = set(self.model.state_dict().keys()) - {
            name for name, _ in self.model.named_parameters()
        }  # persistent buffers (MoE selection biases): not partitioned by ZeRO

    @property
    def state_module(self) -> nn.Module:
        return self.model

    def autocast(self) -> AbstractContextManager:
        """For forwards outside DeepSpeed's (evaluation): its own applies torch_autocast."""
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
        self.ds.set_gradient_accumulation_boundary(last)
        loss = self.ds(inputs, targets, doc_ids=doc_ids)
        self.ds.backward(objective(loss) / divide_by, scale_wrt_gas=False)
        return loss.detach().float()

    def clip_gradients(self, max_norm: float) -> Tensor:
        """ZeRO-0 only (whole averaged gradients on every rank); ZeRO 1-3 clip in their step."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.tables is not None:  # DeepSpeed averaged the others in its backward
            self.tables.average_gradients()
            params += list(self.tables.named_weights().values())
        return clip_grad_norm(params, max_norm)

    def step(self, edit: Edit | None = None) -> None:
        """DeepSpeed's step, the tables' (clipped by DeepSpeed's factor under ZeRO 1-3), then
        `edit` (QK-clip) on the model: its row scalings go through `scale_rows`, which edits
        DeepSpeed's fp32 masters and the module's copy alike."""
        self._sync_muon_momentum()
        self.ds.step()
        applied = self.ds.was_step_applied()
        if self.tables is not None:
            if applied:
                if self.stage > 0:
                    self.tables.clip(float(self.ds.get_global_grad_norm()), self.grad_clip)
                self.tables.step()
            self.tables.zero_grad()
        if edit is not None and applied:
            edit(self.updated_weights())

    def _sync_muon_momentum(self) -> None:
        """ZeRO-3 reads Muon's momentum once, at its start (`muon_beta`); the trainer's schedule
        sets it per step in the groups (optim.muon_momentum_warmup): passed on here."""
        if self.stage != 3 or getattr(self.ds.optimizer, "muon_beta", None) is None:
            return
        momenta = {g["momentum"] for g in self.optimizer.param_groups if g.get("use_muon")}
        if len(momenta) > 1:
            raise ConfigError(f"ZeRO-3's Muon takes one momentum for all groups, got {momenta}")
        if momenta:
            (self.ds.optimizer.muon_beta,) = momenta

    def row_scaler(self) -> RowScaler:
        """QK-clip's row scalings go through `scale_rows`: DeepSpeed keeps the weights."""
        return self.scale_rows

    def scale_rows(self, param: nn.Parameter, rows: Tensor) -> None:
        """param[r, ...] *= rows[r] on the weight the optimizer updates: ZeRO-0's parameter
        itself; under ZeRO 1-3 the fp32 master (gathered whole through DeepSpeed's safe
        accessors, collective) and the module's copy, which otherwise would only follow at the
        next step (ZeRO-3: its partitions, rewritten from rank 0's whole tensor)."""
        shape = getattr(param, "ds_shape", param.shape)  # ZeRO-3: the data is a (0,) placeholder
        factor = rows.view(-1, *([1] * (len(shape) - 1)))
        if self.stage == 0:
            param.data.mul_(factor.to(param.dtype))
            return
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        master = safe_get_full_fp32_param(param)
        master.mul_(factor.to(master.device, master.dtype))
        set_fp32_master(param, master)
        if self.stage == 3:
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if dist.get_rank() == 0:
                    param.data.copy_(master.view_as(param).to(param.dtype))
        else:
            param.data.copy_(master.view_as(param).to(param.dtype))

    def finish_step(
        self, max_norm: float, apply: bool, edit: Edit | None = None
    ) -> tuple[float, bool]:
        if self.stage == 0:  # plain data parallel: the FSDP2 engine's order
            return super().finish_step(max_norm, apply, edit)
        configured = self.grad_clip if self.grad_clip > 0 else math.inf
        if max_norm != configured:
            raise ValueError(f"DeepSpeed clips at {configured} (its config), asked {max_norm}")
        if self.tables is not None:  # their norm joins DeepSpeed's (include_in_norm)
            self.tables.average_gradients()
            self._tables_square = self.tables.square_norm()
            apply = apply and math.isfinite(float(self._tables_square))
        if not apply:
            with self._forced_skip():  # drop the step's gradients the way DeepSpeed does
                self.ds.step()
            return math.nan, False
        self.step(edit)
        norm = self.ds.get_global_grad_norm() if self.reports_norm else None
        return (math.nan if norm is None else float(norm)), bool(self.ds.was_step_applied())

    @contextmanager
    def _forced_skip(self) -> Iterator[None]:
        """One step that DeepSpeed's ZeRO optimizer treats as an overflow: it clears the
        accumulated gradients and partitions, updates nothing and counts a skipped step."""
        optimizer = self.ds.optimizer
        if self.stage == 3:  # before anything (Muon's momentum) is touched: the overflow check
            name = "_overflow_check_and_loss_scale_update"

            def fake(update_scale: bool = True) -> bool:
                optimizer.overflow = True
                return (
                    True
                    if not update_scale
                    else optimizer._loss_scale_update_and_overflow_cleanup()
                )
        else:  # ZeRO-1/2 keep Muon's momentum only once the step survives its norm
            name = "scaled_global_norm"
            fake = lambda *a, **k: torch.tensor(math.inf)  # noqa: E731
        before = optimizer.__dict__.get(name)  # the tables' norm wrapper, if any
        setattr(optimizer, name, fake)
        try:
            yield
        finally:
            if before is None:
                delattr(optimizer, name)
            else:
                setattr(optimizer, name, before)
            if self.tables is not None:
                self.tables.zero_grad()

    def zero_grad(self) -> None:
        self.ds.zero_grad()
        if self.tables is not None:
            self.tables.zero_grad()

    @contextmanager
    def full_weights(self) -> Iterator[nn.Module]:
        """ZeRO-3 partitions the weights, and a forward releases each module's weights after it
        (the tied head too): sampling, which calls methods rather than forward, gets a whole
        copy gathered for the occasion (one model's memory while it lasts)."""
        if self.stage != 3:
            yield self.model
            return
        import deepspeed

        params = dict(self.model.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values())):
            state = {name: p.detach().clone() for name, p in params.items()}
        state |= {name: b for name, b in self.model.named_buffers() if name in self._buffer_names}
        if self.tables is not None:
            state |= self.tables.named_weights()
        device = next(iter(state.values())).device
        whole = build_model(self.model.cfg, device=device)
        whole.load_state_dict(state)
        yield whole.train(self.model.training)

    def local_part(self, param: Tensor) -> Tensor:
        """ZeRO-3's partition of `param` on this rank (the module keeps an empty placeholder)."""
        return getattr(param, "ds_tensor", param)

    # checkpoints: DeepSpeed's own files in <step dir>/deepspeed/, inside the trainer's scheme
    # (trainer/checkpoint/save.py: temporary directory, checksums, commit, latest, fallback)
    checkpoint_format = CHECKPOINT_FOLDER

    def write_checkpoint(
        self, directory: Path, background: bool = False, group: ProcessGroup | None = None
    ) -> None:
        """DeepSpeed's save (collective): model, optimizer partitions, its step counters; never
        in the background (`background` and `group` are DCP's)."""
        self.ds.save_checkpoint(str(directory), tag=CHECKPOINT_FOLDER, save_latest=False)
        if dist.get_rank() == 0:
            folder = directory / CHECKPOINT_FOLDER
            write_layout(folder, ranks=dist.get_world_size(), ep=self.ep, zero_stage=self.stage)
            if self.tables is not None:
                self.tables.write(folder)

    def checkpoint_conflict(self, directory: Path) -> str | None:
        """Why this run cannot load the checkpoint in `directory` (None: it can; collective).
        A checkpoint of another number of ranks or another ZeRO stage (1-3) is converted here
        to DeepSpeed's universal checkpoint (rank 0 runs DeepSpeed's converter into this run's
        scratch directory while the others wait on its status file), which read_checkpoint
        then loads; Muon's momentum and expert-parallel partitions have no universal form, and
        ZeRO-0 keeps no partitions, so such changes are refused. Partition files missing
        against the layout record raise: the checkpoint is damaged, not in conflict."""
        folder = directory / CHECKPOINT_FOLDER
        if not folder.is_dir():
            return f"{directory} has no {CHECKPOINT_FOLDER}/ folder"
        self._universal = None
        written, size = check_partitions(folder), dist.get_world_size()
        stage, saved_ep = saved_stage(folder), read_layout(folder).get("ep", 1)
        if saved_ep != self.ep:
            return (
                f"{directory} holds experts split over parallel.ep={saved_ep} and this run has "
                f"parallel.ep={self.ep}: resume with parallel.ep={saved_ep}, or start a new run "
                f"from its weights: init_from={directory}"
            )
        same_stage = stage == self.stage or {stage, self.stage} == {1, 2}  # same files
        if same_stage and (not written or written == size):
            return None
        change = (
            f"partitions of {written} ranks and this run has {size}"
            if same_stage
            else f"ZeRO-{stage} partitions and this run has parallel.deepspeed.zero_stage="
            f"{self.stage}"
        )
        keep = (
            f"on {written} ranks" if same_stage else f"with parallel.deepspeed.zero_stage={stage}"
        )
        if 0 in (stage, self.stage) and not same_stage:
            why = "ZeRO-0 keeps no partitions to convert"
        elif self.ep > 1:
            why = "DeepSpeed's universal checkpoint knows only its own MoE layers"
        elif self.muon:
            why = "DeepSpeed's universal checkpoint has no Muon state"
        else:
            return self._convert(directory, folder, written or 1, size, stage)
        return (
            f"{directory} holds {change}: {why}. Resume {keep}, or start a new run from its "
            f"weights: init_from={directory}"
        )

    def _convert(self, directory: Path, folder: Path, written: int, size: int, stage: int):
        """Convert `folder` to the universal form read_checkpoint loads (None), or the reason
        it could not be (its scratch folder is removed either way)."""
        name = directory.resolve().name  # never "..": the folder below is emptied first
        universal = (self.scratch_dir or directory.parent) / ".deepspeed-universal" / name
        what = f"ZeRO-{stage} on {written} rank(s) -> ZeRO-{self.stage} on {size}"
        problem = convert_on_main(folder, universal / CHECKPOINT_FOLDER, what, self.stage == 3)
        if problem:
            return problem
        self._universal = universal
        return None

    def read_checkpoint(self, directory: Path, source: DCPSource | None = None) -> None:
        """DeepSpeed's load (collective): weights, optimizer partitions, its step counters;
        from the universal checkpoint checkpoint_conflict made when the rank count or the ZeRO
        stage differs (removed after, whatever happens); then Engram's tables from their own
        file. (`source` is DCP's reader: DeepSpeed reads its own files.)"""
        if getattr(self, "_universal", None) is not None:
            universal, self._universal = self._universal, None
            self._read_universal(directory, universal)
        else:
            self._read_own(directory)
        if self.tables is not None:
            self.tables.read(directory / CHECKPOINT_FOLDER)

    def _read_universal(self, directory: Path, universal: Path) -> None:
        problem = "interrupted"
        try:
            load_universal(self.ds, universal, CHECKPOINT_FOLDER)
            problem = ""
        except Exception as err:  # an incompatibility, not damage
            problem = f"{type(err).__name__}: {err}".splitlines()[0]
        finally:  # the agreement first: no rank may still be reading what rank 0 removes
            failed, problem = worst_over_ranks(int(bool(problem)), problem)
            if dist.get_rank() == 0:
                remove_conversion(universal)
        if failed:
            raise CheckpointRefusal(
                f"the universal form of {directory} (converted for this run's ranks and ZeRO "
                f"stage) did not load ({problem}): resume with the rank count and "
                f"parallel.deepspeed.zero_stage that wrote it"
            )

    def _read_own(self, directory: Path) -> None:
        path, _ = self.ds.load_checkpoint(
            str(directory), tag=CHECKPOINT_FOLDER, load_lr_scheduler_states=False
        )
        if path is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint in {directory}")
        if self.ep > 1:
            # DeepSpeed's module file (rank 0's) holds rank 0's experts, which its load put on
            # every rank; each rank's own are in its fp32 ZeRO partitions, loaded just now:
            # copied into the module (collective over each group's ranks)
            self.ds.optimizer.update_lp_params()

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError("DeepSpeed writes its own checkpoint format (write_checkpoint)")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError("DeepSpeed reads its own checkpoint format (read_checkpoint)")


@ENGINES.register("deepspeed")
def build_deepspeed(request: EngineRequest) -> DeepSpeedEngine:
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if request.device.type == "cuda" else "cpu")
    try:
        import deepspeed
    except ImportError:
        raise ConfigError(
            'parallel.engine=deepspeed needs DeepSpeed: pip install -e ".[deepspeed]"'
        ) from None
    refuse_unsupported(request, request.optimizer_name)
    _ensure_process_group(request.device)
    model = build_model(request.model_cfg, device=request.device, seed=request.seed)
    initial = None  # every rank holds the whole model until ZeRO partitions it
    if request.initial_weights is not None:  # before ZeRO copies them into its partitions
        initial = whole_weights(request.initial_weights())
        load_weights(model, [initial])
    ep = request.dims.ep
    if ep > 1:  # this rank's experts, tagged for DeepSpeed, with the all-to-all dispatch
        deepspeed.init_distributed(dist_backend=dist.get_backend())  # its groups, made here
        localize_experts(model, ep)
    apply_activation_checkpointing(model, request.parallel.activation_checkpoint)
    if request.compile:
        compile_model(model, request.device.type)
    config = deepspeed_config(request)
    tables = None
    if request.model_cfg.engram.enabled:  # out of ZeRO, with an optimizer of their own
        tables = HiddenTables(model, tables_only_optimizer(model, request.make_optimizer))
    client = request.make_optimizer(model)
    if ep > 1:
        split_expert_groups(client)
    if request.optimizer_name in MUON_OPTIMIZERS:
        ds = request.parallel.deepspeed
        problems = muon_problems(client, ds.zero_stage, request.grad_clip, ds.offload_optimizer)
        if problems:
            raise ConfigError(
                f"parallel.engine=deepspeed, optim={request.optimizer_name}: " + "; ".join(problems)
            )
        client = deepspeed_muon(client)
    kwargs: dict[str, Any] = {"optimizer": client}
    if request.parallel.deepspeed.offload_optimizer != "none":  # DeepSpeed's CPU Adam, same groups
        config["optimizer"] = _ds_adamw(client)
        kwargs = {"model_parameters": [dict(g) for g in client.param_groups]}
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its config dump, per rank
    experts = [layer.n_experts for layer in expert_layers(model)]
    with declared_expert_layers(experts) if ep > 1 else nullcontext():
        ds_engine, *_ = deepspeed.initialize(model=model, config=config, **kwargs)
    check_zero_optimizer(ds_engine)
    guard_engine(ds_engine)  # its checkpoint loads through the weights-only unpickler
    if request.parallel.deepspeed.zero_stage == 3:
        register_external_parameters(model)
    if initial is not None and request.precision == "bf16_master":
        # DeepSpeed built them from the bf16-rounded weights
        set_fp32_masters(model, local_expert_weights(model, initial))
    muon = request.optimizer_name in MUON_OPTIMIZERS
    return DeepSpeedEngine(
        ds_engine, request.precision, request.device, request.grad_clip, muon, ep, tables
    )


ZERO_OPTIMIZERS = ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3")


def check_zero_optimizer(ds_engine: Any) -> None:
    """ZeRO 1-3 must run through DeepSpeed's ZeRO optimizers, whose step the engine drops bad
    steps from and whose norm it extends; a user's JSON can make DeepSpeed pick another."""
    stage, name = ds_engine.zero_optimization_stage(), type(ds_engine.optimizer).__name__
    if stage > 0 and name not in ZERO_OPTIMIZERS:
        raise ConfigError(
            f"parallel.deepspeed.config made DeepSpeed use its {name} at ZeRO-{stage} (e.g. "
            "data_types.grad_accum_dtype=fp32 with bf16 at ZeRO-1); this engine runs DeepSpeed's "
            "ZeRO optimizers: remove that setting or use another stage"
        )


def set_fp32_masters(model: nn.Module, state: dict[str, Tensor]) -> None:
    """DeepSpeed's fp32 master weights set from the whole fp32 `state` (each rank its part)."""
    for name, param in model.named_parameters():
        set_fp32_master(param, state[name])


def set_fp32_master(param: nn.Parameter, full: Tensor) -> None:
    """One weight's fp32 master from its whole value (no collective). ZeRO-3: this rank's
    padded partition, cut here (DeepSpeed 0.19.8's full setter reads past the end on the last
    rank when the size does not divide by the ranks)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_local_fp32_param

    if not hasattr(param, "ds_id"):
        safe_set_full_fp32_param(param, full.float())
        return
    size = param.ds_tensor.numel()
    start = size * param._z3_optimizer._get_param_partition_rank(param)
    flat = full.detach().flatten().float()
    part = torch.zeros(size, dtype=torch.float32, device=flat.device)
    count = max(0, min(size, flat.numel() - start))
    part[:count] = flat[start : start + count]
    safe_set_local_fp32_param(param, part)


def register_external_parameters(model: nn.Module) -> None:
    """ZeRO-3 gathers a module's own weights around its forward and backward; weights a module
    reads from a submodule it does not call (`external_parameters()`, e.g. the MoE router's
    fp32 gate) are registered with it, or they stay partitioned (empty) there."""
    import deepspeed

    for module in model.modules():
        for param in getattr(module, "external_parameters", list)():
            deepspeed.zero.register_external_parameter(module, param)


def _ds_adamw(client: torch.optim.Optimizer) -> dict[str, Any]:
    defaults = client.defaults
    return {
        "type": "AdamW",
        "params": {
            "lr": defaults["lr"],
            "betas": list(defaults["betas"]),
            "eps": defaults["eps"],
            "weight_decay": defaults.get("weight_decay", 0.0),
        },
    }
