"""A base for families whose layers differ (hybrid stacks, MoE): weights convert layer by layer
through per-mixer and per-FFN converters, so fused tensors (Qwen3-Next's in_proj_qkvz,
transformers' fused expert stacks) are built from and split into our separate ones.

A converter maps the parameters of one of our modules (names relative to it, e.g. `q_proj.weight`)
to the HF module's (relative to it, e.g. `in_proj_qkvz.weight`) and back. The HF layout of a layer:
    model.layers.{i}.input_layernorm, .<mixer module>.*, .post_attention_layernorm, .mlp.*
    model.embed_tokens, model.norm, lm_head
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import Tensor

from model.config import ConfigError, LayerSpec, ModelConfig
from model.hf.expert_stack import ExpertStack
from model.hf.family import GLOBALS, HFFamily

Params = dict[str, Tensor]


DENSE_FFN = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


def take(state: Params, prefix: str) -> Params:
    """Remove and return the tensors under `prefix`, named relative to it."""
    names = [n for n in state if n.startswith(prefix)]
    return {n[len(prefix) :]: state.pop(n) for n in names}


def put(prefix: str, params: Params) -> Params:
    return {prefix + n: t for n, t in params.items()}


def pop(params: Params, name: str, where: str = "") -> Tensor:
    """`params[name]`, removed; a ConfigError naming it when the checkpoint lacks it."""
    if name not in params:
        raise ConfigError(f"the checkpoint has no tensor {where}{name}")
    return params.pop(name)


def rename(params: Params, table: dict[str, str], where: str = "") -> Params:
    """The tensors of `table`'s keys under its values' names (all must be present)."""
    return {new: pop(params, old, where) for old, new in table.items()}


def optional_rename(params: Params, table: dict[str, str]) -> Params:
    """Like `rename`, for tensors that exist only with some options (biases)."""
    return {new: params.pop(old) for old, new in table.items() if old in params}


def interleave_groups(parts: list[Tensor], groups: int) -> Tensor:
    """Rows of several projections, interleaved per group: each part (groups * r_i, ...) ->
    (groups * sum r_i, ...) with group g's rows of every part together (HF's fused layouts)."""
    viewed = [p.reshape(groups, -1, *p.shape[1:]) for p in parts]
    merged = torch.cat(viewed, dim=1)
    return merged.reshape(-1, *parts[0].shape[1:])


def split_groups(fused: Tensor, groups: int, rows: list[int]) -> list[Tensor]:
    """The inverse of `interleave_groups`: rows[i] = rows of part i per group."""
    viewed = fused.reshape(groups, sum(rows), *fused.shape[1:])
    return [p.reshape(-1, *fused.shape[1:]) for p in viewed.split(rows, dim=1)]


def experts_to_hf(params: Params, names: tuple[str, str, str]) -> Params:
    """Our (E, C, F) w_gate / w_up and (E, F, C) w_down -> one (out, in) matrix per expert, as
    checkpoints store them: experts.{j}.{gate | up | down name}.weight."""
    stacks = [pop(params, f"experts.{n}") for n in ("w_gate", "w_up", "w_down")]
    return {
        f"experts.{j}.{name}.weight": stack[j].T
        for j in range(stacks[0].shape[0])
        for name, stack in zip(names, stacks, strict=True)
    }


def experts_from_hf(params: Params, names: tuple[str, str, str], E: int, where: str) -> Params:
    """The inverse of `experts_to_hf`; also reads transformers 5's fused runtime layout,
    gate_up_proj (E, 2F, C) = [W_gate; W_up] per expert and down_proj (E, C, F). Per-expert
    matrices become `ExpertStack`s, stacked when read (model/hf/expert_stack.py)."""
    if "experts.gate_up_proj" in params:
        gate, up = pop(params, "experts.gate_up_proj").transpose(1, 2).chunk(2, dim=2)
        down = pop(params, "experts.down_proj", where).transpose(1, 2)
    else:
        gate, up, down = (
            ExpertStack(
                [pop(params, f"experts.{j}.{name}.weight", where) for j in range(E)],
                f"{where}experts.*.{name}.weight: ",
            )
            for name in names
        )
    return {"experts.w_gate": gate, "experts.w_up": up, "experts.w_down": down}


SHARED_EXPERTS = {f"shared.{n}": f"shared_experts.{n}" for n in DENSE_FFN}


def deepseek_moe_to_hf(params: Params, expert_names: tuple[str, str, str]) -> Params:
    """A DeepSeekMoE FFN (DeepSeek-V3, Kimi Linear): the router with its score-correction bias
    (ours: the aux-loss-free `expert_bias`), per-expert matrices, the shared experts."""
    out = {
        "gate.weight": pop(params, "router.gate.weight"),
        "gate.e_score_correction_bias": pop(params, "router.expert_bias"),
    }
    return out | experts_to_hf(params, expert_names) | rename(params, SHARED_EXPERTS)


def deepseek_moe_from_hf(
    params: Params, expert_names: tuple[str, str, str], E: int, where: str
) -> Params:
    out = {
        "router.gate.weight": pop(params, "gate.weight", where),
        "router.expert_bias": pop(params, "gate.e_score_correction_bias", where).float(),
    }
    out |= experts_from_hf(params, expert_names, E, where)
    return out | rename(params, {v: k for k, v in SHARED_EXPERTS.items()}, where)


Check = tuple[bool, Callable[[], str]]


def block_checks(cfg: ModelConfig, family: str, mixers: tuple[str, ...]) -> list[Check]:
    """What every layered family here shares: its layer kinds, pre-norm RMSNorm blocks with
    SwiGLU FFNs and no FFN bias, no sliding window or custom softmax scale. (bad, describe)
    pairs, in order; `describe()` gives `key=value (why)`."""
    att = cfg.attention
    other = next((kind for kind in cfg.mixer_kinds() if kind not in mixers), None)
    layers = f"{family} layers are {' or '.join(mixers)}"
    return [
        (other is not None, lambda: f"layer_types/layer_pattern with {other!r} layers ({layers})"),
        (cfg.residual != "pre", lambda: f"residual={cfg.residual!r} ({family} is pre-norm)"),
        (cfg.norm != "rms", lambda: f"norm={cfg.norm!r}"),
        (cfg.ffn.kind != "swiglu", lambda: f"ffn.kind={cfg.ffn.kind!r} (SwiGLU only)"),
        (cfg.ffn.bias, lambda: "ffn.bias=true"),
        (att.sliding_window > 0, lambda: f"attention.sliding_window={att.sliding_window}"),
        (att.softmax_scale > 0, lambda: f"attention.softmax_scale={att.softmax_scale}"),
    ]


def deepseek_moe_checks(cfg: ModelConfig) -> list[Check]:
    """What a DeepSeekMoE FFN (DeepSeek-V3, Kimi Linear) needs of a MoE config: sigmoid scores,
    ungated shared experts as wide as the routed ones, no capacity limit (none for dense)."""
    moe = cfg.moe
    if not moe.enabled:
        return []
    return [
        (moe.score_func != "sigmoid", lambda: f"moe.score_func={moe.score_func!r} (sigmoid)"),
        (moe.n_shared_experts < 1, lambda: "moe.n_shared_experts=0 (it has shared experts)"),
        (
            moe.shared_hidden not in (0, cfg.expert_hidden),
            lambda: f"moe.shared_hidden={moe.shared_hidden} (= the routed experts' width)",
        ),
        (moe.shared_expert_gate, lambda: "moe.shared_expert_gate=true"),
        (moe.capacity_factor > 0, lambda: f"moe.capacity_factor={moe.capacity_factor}"),
    ]


def first_failing(checks: list[Check]) -> str | None:
    return next((describe() for bad, describe in checks if bad), None)


class LayeredFamily(HFFamily):
    """Per-layer conversion; subclasses give the mixer modules and converters."""

    mixer_modules: ClassVar[
        dict[str, str]
    ] = {}  # our mixer kind -> HF module name in a decoder layer
    # our FFN kind (dense | moe) -> HF module names in a decoder layer (export writes the first)
    ffn_modules: ClassVar[dict[str, tuple[str, ...]]] = {"dense": ("mlp",), "moe": ("mlp",)}
    ties_on_load = True  # transformers ties lm_head to the embedding when the config says so
    zero_centred = False  # HF's decoder norms compute x_hat * (1 + w) (Qwen3-Next), ours x_hat * w

    # ---- converters (subclasses) ----------------------------------------------------------------

    def mixer_to_hf(self, kind: str, params: Params, cfg: ModelConfig) -> Params:
        raise NotImplementedError

    def mixer_from_hf(self, kind: str, params: Params, cfg: ModelConfig, where: str) -> Params:
        raise NotImplementedError

    def ffn_to_hf(self, kind: str, params: Params, cfg: ModelConfig) -> Params:
        raise NotImplementedError

    def ffn_from_hf(self, kind: str, params: Params, cfg: ModelConfig, where: str) -> Params:
        raise NotImplementedError

    def gain_to_hf(self, w: Tensor) -> Tensor:
        return (w.float() - 1).to(w.dtype) if self.zero_centred else w

    def gain_from_hf(self, w: Tensor) -> Tensor:
        """1 + w in fp32 (transformers' `1.0 + w.float()`; in bf16 the sum would round to 1/128)."""
        return w.float() + 1 if self.zero_centred else w

    # ---- the whole model ------------------------------------------------------------------------

    def to_hf_state(self, state: Params, cfg: ModelConfig, part: int | None = None) -> Params:
        s = dict(state)
        out = self._globals_to_hf(s, cfg) if part in (None, GLOBALS) else {}
        for spec in _specs(cfg, part):
            out |= self._layer_to_hf(spec, s, cfg)
        if s:
            raise ConfigError(
                f"parameters with no Hugging Face counterpart: {', '.join(list(s)[:5])}"
            )
        return out

    def _globals_to_hf(self, s: Params, cfg: ModelConfig) -> Params:
        out = {
            "model.embed_tokens.weight": pop(s, "embed.weight"),
            "model.norm.weight": self.gain_to_hf(pop(s, "norm.weight")),
        }
        if not cfg.tie_embeddings:
            out["lm_head.weight"] = pop(s, "head.weight")
        elif not self.ties_on_load:  # a copy: safetensors refuses two names for one storage
            out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
        s.pop("head.weight", None)  # tied: the embedding itself
        return out

    def _layer_to_hf(self, spec: LayerSpec, s: Params, cfg: ModelConfig) -> Params:
        ours, theirs = f"layers.{spec.index}.", f"model.layers.{spec.index}."
        out = {
            theirs + "input_layernorm.weight": self.gain_to_hf(pop(s, ours + "attn_norm.weight")),
            theirs + "post_attention_layernorm.weight": self.gain_to_hf(
                pop(s, ours + "ffn_norm.weight")
            ),
        }
        mixer = take(s, ours + "attn.")
        module = theirs + self.mixer_modules[spec.mixer] + "."
        converted = self.mixer_to_hf(spec.mixer, mixer, cfg)
        out |= put(module, self._all_used(converted, mixer, ours + "attn."))
        ffn = take(s, ours + "ffn.")
        converted = self.ffn_to_hf(spec.ffn, ffn, cfg)
        mlp = theirs + self.ffn_modules[spec.ffn][0] + "."
        return out | put(mlp, self._all_used(converted, ffn, ours + "ffn."))

    def from_hf_state(
        self, hf_state: Params, cfg: ModelConfig, part: int | None = None
    ) -> tuple[Params, list[str]]:
        s = dict(hf_state)
        out = self._globals_from_hf(s, cfg) if part in (None, GLOBALS) else {}
        for spec in _specs(cfg, part):
            converted, unknown = self._layer_from_hf(spec, s, cfg)
            out |= converted
            if unknown:
                return out, unknown
        return out, list(s)

    def _globals_from_hf(self, s: Params, cfg: ModelConfig) -> Params:
        out = {
            "embed.weight": pop(s, "model.embed_tokens.weight"),
            "norm.weight": self.gain_from_hf(pop(s, "model.norm.weight")),
        }
        if cfg.tie_embeddings:
            s.pop("lm_head.weight", None)  # the embedding itself
        else:
            out["head.weight"] = pop(s, "lm_head.weight")
        return out

    def _layer_from_hf(
        self, spec: LayerSpec, s: Params, cfg: ModelConfig
    ) -> tuple[Params, list[str]]:
        """(our tensors of layer `spec`, the HF names under its modules left unconverted)."""
        ours, theirs = f"layers.{spec.index}.", f"model.layers.{spec.index}."
        out = {
            ours + "attn_norm.weight": self.gain_from_hf(pop(s, theirs + "input_layernorm.weight")),
            ours + "ffn_norm.weight": self.gain_from_hf(
                pop(s, theirs + "post_attention_layernorm.weight")
            ),
        }
        module = theirs + self.mixer_modules[spec.mixer] + "."
        mixer = take(s, module)
        out |= put(ours + "attn.", self.mixer_from_hf(spec.mixer, mixer, cfg, module))
        unknown = [module + n for n in mixer]
        candidates = [theirs + m + "." for m in self.ffn_modules[spec.ffn]]
        module = next((p for p in candidates if any(n.startswith(p) for n in s)), candidates[0])
        mlp = take(s, module)
        out |= put(ours + "ffn.", self.ffn_from_hf(spec.ffn, mlp, cfg, module))
        return out, unknown + [module + n for n in mlp]

    @staticmethod
    def _all_used(converted: Params, left: Params, prefix: str) -> Params:
        if left:
            names = ", ".join(prefix + n for n in left)
            raise ConfigError(f"parameters with no Hugging Face counterpart: {names}")
        return converted


def _specs(cfg: ModelConfig, part: int | None) -> list[LayerSpec]:
    """The layers a conversion of `part` covers (None: all)."""
    specs = cfg.layer_specs()
    if part is None:
        return specs
    return [spec for spec in specs if spec.index == part]


def layout_fields(kinds: list[str], default: str) -> dict[str, list[str]]:
    """ModelConfig fields for a per-layer mixer list: nothing when every layer is `default`, the
    shortest repeating `layer_pattern` when there is one, else the explicit `layer_types`."""
    if all(kind == default for kind in kinds):
        return {}
    for period in range(1, len(kinds)):
        if len(kinds) % period == 0 and kinds == kinds[:period] * (len(kinds) // period):
            return {"layer_pattern": kinds[:period]}
    return {"layer_types": list(kinds)}
