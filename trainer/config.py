"""The root config of `python -m trainer` and its structured-config registration.

Each group is the owning component's dataclass (model.config.ModelConfig, data.config.LoaderConfig,
optim.config.OptimConfig) or a trainer dataclass below. Registering them as Hydra structured
configs makes a misspelled key or a wrong type fail when the config is composed, before any
process group or file is touched; trainer/build.py and trainer/run_settings.py then check the rules
that span groups.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore

from data.config import LoaderConfig
from model.config import ModelConfig
from model.errors import ConfigError
from optim.bounds import AT_LEAST_ONE, NON_NEGATIVE, Bounds, broken_rule
from optim.config import OptimConfig
from parallel.config import Float8Config, ParallelConfig
from trainer.downstream.config import EvalConfig

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
PRECISIONS = ("auto", "bf16", "bf16_master", "float8", "fp32")
WANDB_MODES = ("disabled", "offline", "online")
DEVICES = ("auto", "cpu", "cuda")
CPU_MALLOC_CHOICES = ("keep", "system")  # trainer/cpu_malloc.py
COMPILE_CHOICES = ("auto", "true", "false")
# trainer.compile=auto compiles runs of at least this many steps. On the README's 2-core CPU
# the tiny preset's first compile took 22-28 s on a fresh machine (Inductor's CPU options in
# parallel/activation.py) and 2.5-4 s from the cache on disk, and saved 0.03-0.08 s a step
# (bench/compile_cost.py, bench/default_speed.py): a first run pays back after 230-900 steps,
# a later one after 30-130. From 300 steps (the default run) a first run is level with eager
# within this machine's noise and every later run is faster; a GPU (Triton kernels, no C++
# compiler) pays back sooner
COMPILE_MIN_STEPS = 300
COMPILE_EVAL_CHOICES = ("auto", "true", "false")
# trainer.compile_eval=auto: a compiled run compiles its validation forwards when this process's
# evaluations forward at least this many batches. Measured on the README's 2-core CPU with the
# tiny preset at 8 x 256 (bench/eval_speed.py): after the training graphs, the no-grad graphs'
# compile took 12-13 s from an empty cache (0.3-1.2 s from the cache on disk) and saved 33-47 ms
# a batch, paying back after 280-360 batches on a first run. Other devices and models differ (on
# a GPU a larger model saves more per batch): set true or false to choose. Samples are always
# eager: a few dozen tokens, whose compile (8-11 s; one graph per decoding shape) saves ~0.08 s
# a sample
EVAL_COMPILE_MIN_BATCHES = 300


# every numeric field of TrainerConfig -> its rule (finite, in the interval; optim.bounds)
TRAINER_NUMBERS = {
    "max_steps": AT_LEAST_ONE,
    "batch_size": AT_LEAST_ONE,
    "micro_batch_size": Bounds(0, note="0 = the whole local batch"),
    "log_every": AT_LEAST_ONE,
    "eval_every": Bounds(0, note="0 = only at the end"),
    "sample_tokens": NON_NEGATIVE,
    "grad_clip": Bounds(0, note="0 = off"),
    "max_bad_steps": AT_LEAST_ONE,
    "spike_factor": Bounds(
        1, low_open=True, or_zero=True, note="0 = off; a multiple of the mean loss"
    ),
    "threads": Bounds(0, note="0 = torch's default"),
    "peak_flops": Bounds(0, note="0 = the device table or a measurement"),
    "fault_step": Bounds(-1, note="-1 = off"),
    "fault_rank": Bounds(-1, note="-1 = every rank"),
    "orphan_grace_s": NON_NEGATIVE,
}


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(kw_only=True)
class TrainerConfig:
    """The training run. These defaults are `python -m trainer`'s (conf/trainer/default.yaml sets
    nothing): a few minutes on 2 CPU cores, 300 steps of 8 x 256 tokens (about 0.6M tokens)."""

    max_steps: int = 300  # optimizer steps
    batch_size: int = 8  # sequences per global batch (all ranks, all micro-batches)
    micro_batch_size: int = 0  # sequences per forward on one rank; 0 = the whole local batch
    log_every: int = 10  # steps between metrics.jsonl rows
    eval_every: int = 50  # steps between evaluations (and at the end); 0 = only at the end
    sample_tokens: int = 48  # tokens sampled after each evaluation (0 = none)
    sample_prompt: str = ""  # prompt of that sample; "" = the start of a validation document
    grad_clip: float = 1.0  # global gradient-norm clip; 0 = off
    # auto (bf16 where the device multiplies bf16 natively: GPUs from Ampere, CPUs with
    # AVX512-BF16 / AMX; else fp32: parallel/precision.py) | bf16 (autocast over fp32 weights) |
    # bf16_master (bf16 weights, fp32 masters in the optimizer) | float8 (bf16, with the large
    # matmuls in float8 through torchao: trainer.float8, parallel/float8.py) | fp32
    precision: str = "auto"
    float8: Float8Config = field(default_factory=Float8Config)  # trainer.precision=float8 only
    # torch.compile every block and the fused head + loss (tiny on the README's 2-core CPU:
    # 22-28 s on a fresh machine, 2.5-4 s from the cache on disk, bench/compile_cost.py):
    # true | false | auto (compile runs of at least COMPILE_MIN_STEPS steps, bench/default_speed.py;
    # an engine built from Python for a short measurement or test passes false)
    compile: str = "auto"
    # a compiled run's validation forwards: auto (compiled from EVAL_COMPILE_MIN_BATCHES
    # evaluation batches in the run, else eager) | true | false; samples are always eager
    compile_eval: str = "auto"
    doc_mask: bool = False  # attention within documents, positions restart at each (packed data)
    device: str = "auto"  # auto (cuda when available) | cpu | cuda
    max_bad_steps: int = 5  # consecutive skipped steps (non-finite or spiking) before stopping
    spike_factor: float = 0.0  # skip a step whose loss exceeds this x the running mean; 0 = off
    threads: int = 0  # torch intra-op threads on CPU; 0 = torch's default
    # CPU runs: keep (glibc keeps freed blocks for the next step: no page faults on every large
    # activation, trainer/cpu_malloc.py) | system (glibc's defaults)
    cpu_malloc: str = "keep"
    peak_flops: float = 0.0  # per-device peak FLOP/s for MFU; 0 = table (GPU) or measured (CPU)
    fault_step: int = -1  # testing: raise SIGKILL on this step (once per run directory)
    fault_rank: int = -1  # testing: the rank that dies at fault_step; -1 = every rank
    requeue: bool = True  # under SLURM: after SIGUSR2 (pre-timeout), requeue the job if allowed
    orphan_grace_s: float = 120.0  # under torchrun: seconds to save and exit once the agent died

    def __post_init__(self) -> None:
        broken = broken_rule("trainer", self, TRAINER_NUMBERS)
        _require(broken is None, str(broken))
        _require(
            self.precision in PRECISIONS,
            f"trainer.precision={self.precision!r} is not one of {PRECISIONS}",
        )
        _require(self.device in DEVICES, f"trainer.device={self.device!r} is not one of {DEVICES}")
        _require(
            self.cpu_malloc in CPU_MALLOC_CHOICES,
            f"trainer.cpu_malloc={self.cpu_malloc!r} is not one of {CPU_MALLOC_CHOICES}",
        )
        self.compile = str(self.compile).lower()  # a bool from Python or YAML: true / false
        _require(
            self.compile in COMPILE_CHOICES,
            f"trainer.compile={self.compile!r} is not one of {COMPILE_CHOICES}",
        )
        self.compile_eval = str(self.compile_eval).lower()
        _require(
            self.compile_eval in COMPILE_EVAL_CHOICES,
            f"trainer.compile_eval={self.compile_eval!r} is not one of {COMPILE_EVAL_CHOICES}",
        )


def cpp_compiler() -> str:
    """The C++ compiler torch.compile builds with (Inductor's CPU kernels, Triton's launchers):
    $CXX, else g++ (clang++ on macOS, cl on Windows)."""
    default = {"darwin": "clang++", "win32": "cl"}.get(sys.platform, "g++")
    return os.environ.get("CXX", default)


def compiles(trainer: TrainerConfig) -> bool:
    """Whether the run compiles its blocks: trainer.compile, with auto resolved by the run's
    length (COMPILE_MIN_STEPS) and whether there is a C++ compiler to compile with."""
    if trainer.compile == "auto":
        long_enough = trainer.max_steps >= COMPILE_MIN_STEPS
        return long_enough and shutil.which(cpp_compiler()) is not None
    return trainer.compile == "true"


def evaluations_left(max_steps: int, eval_every: int, start_step: int) -> int:
    """Evaluations a process starting at `start_step` runs (trainer/loop.py): at step 0 when
    the run is fresh, at every multiple of eval_every after the start, and at the last step."""
    if start_step >= max_steps:
        return 0
    multiples = max_steps // eval_every - start_step // eval_every if eval_every else 0
    last = 1 if not eval_every or max_steps % eval_every else 0
    return (start_step == 0) + multiples + last


def compiles_evaluation(compiled: bool, compile_eval: str, batches: int) -> bool:
    """Whether a run's validation forwards run compiled (else eagerly, with no inference
    compile): never when the run is not `compiled`; else trainer.compile_eval, auto when this
    process's evaluations forward at least EVAL_COMPILE_MIN_BATCHES batches."""
    if not compiled or compile_eval == "false":
        return False
    return compile_eval == "true" or batches >= EVAL_COMPILE_MIN_BATCHES


@dataclass(kw_only=True)
class CheckpointConfig:
    every: int = 100  # steps between checkpoints (one is also written at the end); 0 = end only
    keep: int = 3  # complete checkpoints kept (oldest removed first)
    async_save: bool = False  # write in the background (dcp.async_save) while training goes on
    verify: bool = True  # check every file's checksum before loading (all ranks share the reads)

    def __post_init__(self) -> None:
        _require(self.every >= 0, f"checkpoint.every={self.every} must be >= 0")
        _require(self.keep >= 1, f"checkpoint.keep={self.keep} must be >= 1")


@dataclass(kw_only=True)
class LoggingConfig:
    wandb: str = "disabled"  # disabled | offline | online
    project: str = "lmforge"  # wandb project
    entity: str | None = None  # wandb entity (user or team); None = your default entity
    name: str | None = None  # run name shown in wandb; default: the run directory's name
    progress: bool = True  # a progress bar of steps on the console

    def __post_init__(self) -> None:
        _require(
            self.wandb in WANDB_MODES, f"logging.wandb={self.wandb!r} is not one of {WANDB_MODES}"
        )


@dataclass(kw_only=True)
class RootConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: LoaderConfig = field(default_factory=LoaderConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)  # downstream tasks (trainer/downstream/)
    seed: int = 0  # seeds weight init, the data order and sampling
    resume: str = "auto"  # auto (newest complete checkpoint in this run directory) | none | <path>
    # a checkpoint (step or run directory, either engine) whose weights a new run starts from,
    # with a fresh optimizer at step 0; ignored when the run resumes a checkpoint of its own
    init_from: str = ""


def register_configs() -> None:
    ConfigStore.instance().store(name="root_schema", node=RootConfig)
