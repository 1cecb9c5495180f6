"""`trainer.precision=float8`: matmuls in float8 through torchao, the rest as `bf16`.

The model's modules decide which matmuls qualify (model/float8_filter.py: the head, routers,
recurrent gates and odd-sized layers stay in bf16); `trainer.float8.filter=auto` then keeps the
GEMMs too small to gain in bf16 too (torchao's thresholds, measured on H100), and
`trainer.float8.skip` any the user names. What qualifies is converted on the meta device, before
tensor parallelism, compile and FSDP2 (parallel/compose.py):

- linear maps: tensorwise / rowwise / rowwise_with_gw_hp become torchao's `Float8Linear`
  (`convert_to_float8_training`), mxfp8 its `MXFP8Linear`. The weights stay ordinary parameters
  with the same names and dtype: checkpoints are the same as a bf16 run's, so a float8 run resumes
  in bf16 and the reverse, and exports write bf16/fp32 weights.
- tensorwise under FSDP2 (`trainer.float8.fsdp_all_gather`): the weights are gathered in float8
  (torchao's `WeightWithDynamicFloat8CastTensor`), their scales computed for all of them in one
  all-reduce after each optimizer step (`Float8Plan.after_step`). Gloo has no float8 all-gather,
  so on gloo groups the gather moves the same bytes as uint8 (`ByteAllGather`).
- routed experts: their grouped GEMMs through torchao's scaled grouped GEMMs (fp8 rowwise on
  SM90/SM100, `torch._scaled_grouped_mm`; MXFP8 on SM100 or emulated on CPU), each expert's rows
  padded to the kernel's alignment by the experts module (model/moe/experts.py).

One process autocasts fp32 weights to bf16; torchao's linears follow only CUDA's autocast, so on
other devices the input is cast to the autocast dtype here (`_AutocastInput`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from model.errors import ConfigError
from model.float8_filter import EXPERTS, LINEAR, Float8Candidate, float8_candidates
from model.moe.experts import ScaledGroupedMM
from parallel.config import Float8Config

log = logging.getLogger("parallel")
TORCHAO_MIN = (0, 16)
MXFP8_BLOCK, FP8_BLOCK = 32, 16  # the dims (and expert rows) each recipe's kernels need


def require_torchao() -> None:
    """torchao importable and recent enough, else a one-line ConfigError naming the fix.
    Without CUDA, torchao's warnings that its CUDA kernel libraries did not load are silenced
    (expected there: CPU runs use torch's kernels and emulation)."""
    logger = logging.getLogger("torchao")
    level = logger.level
    if not torch.cuda.is_available():
        logger.setLevel(logging.ERROR)
    try:
        import torchao
    except ImportError as error:
        raise ConfigError(
            "trainer.precision=float8 needs torchao: pip install 'lmforge[float8]' (torchao>=0.16)"
        ) from error
    finally:
        logger.setLevel(level)
    version = tuple(int(p) for p in re.findall(r"\d+", torchao.__version__)[:2])
    if version < TORCHAO_MIN:
        raise ConfigError(
            f"trainer.precision=float8 needs torchao>=0.16 (found {torchao.__version__}): "
            "pip install -U 'lmforge[float8]'"
        )


def check_float8_device(recipe: str, device: torch.device) -> None:
    """A one-line ConfigError where `device` cannot run `recipe`: float8 needs CUDA compute
    capability 8.9 (Ada, Hopper) or newer, MXFP8 10.0 (Blackwell). CPUs run torch's float8
    kernels (and MXFP8 emulated): slowly, for tests."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    if (major, minor) < (8, 9):
        raise ConfigError(
            f"trainer.precision=float8: {name} (compute capability {major}.{minor}) has no float8 "
            "tensor cores (8.9+: L4/L40S, H100/H200, B200); use trainer.precision=bf16"
        )
    if recipe == "mxfp8" and major < 10:
        raise ConfigError(
            f"trainer.float8.recipe=mxfp8 needs an SM100 GPU (B200/GB200); {name} is "
            f"{major}.{minor}: use trainer.float8.recipe=tensorwise or rowwise"
        )
    if recipe == "mxfp8" and not _sm100_kernels():
        raise ConfigError(
            "trainer.float8.recipe=mxfp8: this torchao build has no SM100 MXFP8 kernels (its "
            "CUDA extensions did not load); install a torchao wheel built for your CUDA and torch"
        )


def _sm100_kernels() -> bool:
    from torchao.prototype.moe_training import mxfp8_grouped_mm

    return bool(mxfp8_grouped_mm._SM100_KERNELS_AVAILABLE)


def check_float8_tokens(recipe: str, tokens: int) -> None:
    """MXFP8 quantizes the weight gradient's inner dim, the tokens of one micro-batch on one
    rank, in blocks of 32: a one-line ConfigError when they do not split."""
    if recipe == "mxfp8" and tokens % MXFP8_BLOCK:
        raise ConfigError(
            f"trainer.float8.recipe=mxfp8 needs each rank's micro-batch to hold a multiple of "
            f"{MXFP8_BLOCK} tokens (its weight gradients are quantized in blocks of {MXFP8_BLOCK} "
            f"along them); it holds {tokens}: change data.seq_len or trainer.micro_batch_size"
        )


@dataclass
class Float8Plan:
    """What `convert_to_float8` did: the matmuls in float8 and those kept, with reasons."""

    recipe: str
    candidates: list[Float8Candidate]
    all_gather: bool = False  # FSDP2 gathers float8 weights (tensorwise)
    grouped: str = ""  # the experts' scaled grouped GEMM ("" = none)
    modules: list[nn.Module] = field(default_factory=list)  # the roots converted (after_step)
    _by_mesh: list[nn.ModuleList] | None = None  # the gathered float8 linears by weight mesh

    @property
    def converted(self) -> list[Float8Candidate]:
        return [c for c in self.candidates if c.qualifies]

    @property
    def _experts_converted(self) -> bool:
        return any(c.kind == EXPERTS for c in self.converted)

    def summary(self) -> str:
        """The start-up log line: counts, then each reason with the names it kept (layer
        indices collapsed: `layers.*.attn.b_proj`)."""
        kept: dict[str, set[str]] = {}
        for c in self.candidates:
            if not c.qualifies:
                kept.setdefault(c.reason, set()).add(re.sub(r"\.\d+\.", ".*.", c.name))
        lines = [
            f"float8 ({self.recipe}): {len(self.converted)} of {len(self.candidates)} matmul "
            f"modules in float8"
            + (f", experts by {self.grouped}" if self._experts_converted else "")
            + (", FSDP2 gathers float8 weights" if self.all_gather else "")
        ]
        lines += [
            f"  kept in bf16 ({reason}): {', '.join(sorted(names))}"
            for reason, names in kept.items()
        ]
        return "\n".join(lines)

    def after_step(self) -> None:
        """After each optimizer step: the float8 scales of the weights FSDP2 gathers, one
        all-reduce of their amaxes per device mesh (torchao stacks them: under tensor
        parallelism the split linears' weights live on the (dp, tp) mesh, the unsplit ones, such
        as MLA's down projections, on the data-parallel mesh alone)."""
        if not self.all_gather:
            return
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        if self._by_mesh is None:
            self._by_mesh = _float8_linears_by_mesh(self.modules)
        for group in self._by_mesh:
            precompute_float8_dynamic_scale_for_fsdp(group)


def _float8_linears_by_mesh(roots: list[nn.Module]) -> list[nn.ModuleList]:
    """The float8 linears whose weights FSDP2 gathers in float8, grouped by their mesh."""
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[nn.Module]] = {}
    for root in roots:
        for module in root.modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, DTensor) and hasattr(weight._local_tensor, "_precomputed_scale"):
                groups.setdefault(weight.device_mesh, []).append(module)
    return [nn.ModuleList(group) for group in groups.values()]


def plan_float8(
    model: nn.Module, cfg: Float8Config, device: torch.device, sharded: bool, tp: int = 1
) -> Float8Plan:
    """Which of `model`'s matmuls `convert_to_float8` converts (nothing is changed); `tp`: the
    tensor-parallel degree the model will be split by."""
    block = MXFP8_BLOCK if cfg.recipe == "mxfp8" else FP8_BLOCK
    grouped = _grouped_name(cfg, device)
    candidates = []
    for c in float8_candidates(model, block, tp):
        reason = c.reason or _user_reason(c, cfg, grouped)
        candidates.append(dataclasses.replace(c, reason=reason))
    all_gather = sharded and cfg.recipe == "tensorwise" and cfg.fsdp_all_gather
    return Float8Plan(cfg.recipe, candidates, all_gather, grouped)


def _user_reason(c: Float8Candidate, cfg: Float8Config, grouped: str) -> str:
    """Why the run's settings keep a qualifying matmul out of float8 ("" if they do not)."""
    if any(part in c.name for part in cfg.skip):
        return "trainer.float8.skip"
    if c.kind == EXPERTS:
        if not cfg.experts:
            return "trainer.float8.experts=false"
        if not grouped:
            return "no float8 grouped GEMM here (fp8 rowwise: CUDA SM90/SM100; MXFP8: SM100, CPU)"
        return ""
    if cfg.filter == "auto" and not _large_enough(c.shape, cfg.recipe):
        return "filter=auto: too small to gain (torchao's H100 thresholds)"
    return ""


def _large_enough(shape: tuple[int, ...], recipe: str) -> bool:
    """torchao's auto filter for the recipe (rowwise's thresholds for rowwise_with_gw_hp and
    mxfp8, which have none of their own)."""
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    probe = nn.Linear(shape[1], shape[0], bias=False, device="meta")
    return _auto_filter_for_recipe("tensorwise" if recipe == "tensorwise" else "rowwise", [])(
        probe, "probe"
    )


def _grouped_name(cfg: Float8Config, device: torch.device) -> str:
    """The scaled grouped GEMM the experts can use on `device` ("" = none)."""
    if cfg.recipe == "mxfp8":
        return "mxfp8" if device.type in ("cpu", "cuda") else ""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] in (9, 10):
        return "fp8_rowwise"
    return ""


def convert_to_float8(
    model: nn.Module, cfg: Float8Config, device: torch.device, sharded: bool, tp: int = 1
) -> Float8Plan:
    """Convert `model`'s qualifying matmuls (on the meta device, before TP / compile / FSDP2)
    and return the plan; `sharded`: FSDP2 will shard the weights (the float8 all-gather)."""
    require_torchao()
    check_float8_device(cfg.recipe, device)
    plan = plan_float8(model, cfg, device, sharded, tp)
    linears = {c.name for c in plan.converted if c.kind == LINEAR}
    if cfg.recipe == "mxfp8":
        _convert_mxfp8(model, linears, device)
    else:
        _convert_float8(model, linears, cfg.recipe, plan.all_gather)
    experts = {c.name for c in plan.converted if c.kind == EXPERTS}
    if experts:
        scaled = _scaled_grouped_mm(plan.grouped, device)
        for name, module in model.named_modules():
            if name in experts:
                module.scaled_mm = scaled
    plan.modules = [model]
    return plan


class _AutocastInput:
    """torchao's float8 linears cast their input to CUDA's autocast dtype only; elsewhere (one
    process on CPU autocasts fp32 weights to bf16) the input is cast here and the float8 matmul
    runs outside autocast, so its output and gradients are in the autocast dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if device == "cuda" or not torch.is_autocast_enabled(device):
            return super().forward(x)
        with torch.autocast(device, enabled=False):
            return super().forward(x.to(torch.get_autocast_dtype(device)))


class _MXFP8Autocast(_AutocastInput):
    """The same for torchao's MXFP8Linear, which also needs its weight in the input's dtype
    (its emulated GEMM dequantizes each operand to its own dtype): one process's fp32 weights
    are cast to the autocast dtype first, as FSDP2 gathers them in bf16 on several ranks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm

        device = x.device.type
        autocast = torch.is_autocast_enabled(device)
        x = x.to(torch.get_autocast_dtype(device)) if autocast else x
        with torch.autocast(device, enabled=False):
            y = _to_mxfp8_then_scaled_mm(
                x,
                self.weight.to(x.dtype),
                kernel_preference=self.kernel_preference,
                scale_calculation_mode=self.scale_calculation_mode,
                wgrad_with_hp=self.wgrad_with_hp,
            )
        return y if self.bias is None else y + self.bias.to(y.dtype)


@functools.cache
def _autocast_class(base: type) -> type:
    mixin = _MXFP8Autocast if base.__name__ == "MXFP8Linear" else _AutocastInput
    return type(base.__name__, (mixin, base), {"__module__": __name__})


def _convert_float8(model: nn.Module, names: set[str], recipe: str, all_gather: bool) -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    # pad_inner_dim: CUDA's float8 GEMM needs inner dims in multiples of 16, and the weight
    # gradient's inner dim is the micro-batch's token count: padded with zeros where it is not
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), pad_inner_dim=True)
    if all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, n: n in names)
    _swap_classes(model, names)


def _convert_mxfp8(model: nn.Module, names: set[str], device: torch.device) -> None:
    from torchao.float8.float8_linear_utils import swap_linear_layers
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear

    preference = _mxfp8_kernels(device)

    def from_float(mod: nn.Linear) -> nn.Module:
        with torch.device("meta"):
            new = MXFP8Linear(
                mod.in_features, mod.out_features, bias=False, kernel_preference=preference
            )
        new.weight, new.bias = mod.weight, mod.bias
        return new

    swap_linear_layers(model, from_float, module_filter_fn=lambda m, n: n in names)
    _swap_classes(model, names)


def _swap_classes(model: nn.Module, names: set[str]) -> None:
    for name, module in model.named_modules():
        if name in names:
            module.__class__ = _autocast_class(type(module))


def _mxfp8_kernels(device: torch.device):
    """torchao's CUTLASS / CUDA kernels on SM100, its emulation in torch ops elsewhere."""
    from torchao.quantization.quantize_.common import KernelPreference

    sm100 = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10
    return KernelPreference.AUTO if sm100 else KernelPreference.EMULATED


def _scaled_grouped_mm(name: str, device: torch.device) -> ScaledGroupedMM:
    if name == "mxfp8":
        from torchao.prototype.moe_training import _to_mxfp8_then_scaled_grouped_mm

        preference = _mxfp8_kernels(device)
        fn = functools.partial(
            _to_mxfp8_then_scaled_grouped_mm,
            out_dtype=torch.bfloat16,
            kernel_preference=preference,
        )
        if preference.name == "EMULATED":  # Inductor's CPU code generation failed on the
            fn = torch.compiler.disable(fn)  # emulation's reshapes (torch 2.13): run it eagerly
        return ScaledGroupedMM(fn, MXFP8_BLOCK, name)
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    fn = functools.partial(
        _to_fp8_rowwise_then_scaled_grouped_mm,
        out_dtype=torch.bfloat16,
        pad_token_groups_for_grouped_mm=False,  # the experts pad each group themselves
    )
    return ScaledGroupedMM(fn, FP8_BLOCK, name)


class ByteAllGather:
    """FSDP2's all-gather moving float8 buffers as uint8 (gloo has no float8 type; the bytes
    are the same). Other dtypes pass through unchanged."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        if output_tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            output_tensor, input_tensor = (
                output_tensor.view(torch.uint8),
                input_tensor.view(torch.uint8),
            )
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


def gather_float8_as_bytes(model: nn.Module) -> None:
    """On gloo process groups: every FSDP2 unit of `model` gathers float8 weights as bytes."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            groups = state._fsdp_param_groups
            if groups and dist.get_backend(groups[0].mesh_info.shard_process_group) == "gloo":
                module.set_custom_all_gather(ByteAllGather())


def float8_tp_style(style: type, module: nn.Module) -> type:
    """The float8 version of a tensor-parallel style for `module`: torchao's Float8Colwise /
    Float8RowwiseParallel for tensorwise float8 linears (the input cast to float8 before its
    redistribution, the output's gradient after), else `style` itself."""
    config = getattr(module, "config", None)
    if config is None or not getattr(config, "cast_config_input", None):
        return style
    from torchao.float8.config import ScalingGranularity

    if config.cast_config_input.scaling_granularity is not ScalingGranularity.TENSORWISE:
        return style
    return _float8_styles().get(style, style)


@functools.cache
def _float8_styles() -> dict[type, type]:
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from parallel.tensor_parallel_styles import RowwiseSummable

    class Float8RowwiseSummable(Float8RowwiseParallel):
        """RowwiseSummable's partial output (sequence parallelism's reduce-scatter) with
        torchao's float8 input cast."""

        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            module.partial_output = False
            return super()._apply(module, device_mesh)

        @staticmethod
        def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
            return RowwiseSummable._prepare_output_fn(
                output_layouts, use_local_output, mod, outputs, device_mesh
            )

    return {ColwiseParallel: Float8ColwiseParallel, RowwiseSummable: Float8RowwiseSummable}
