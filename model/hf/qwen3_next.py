"""Qwen3-Next (`Qwen3NextForCausalLM`) and Qwen3.5's text model (`Qwen3_5ForCausalLM`): Gated
DeltaNet layers (`gdn`) with gated softmax attention (`gqa` with output_gate and QK-norm), usually
3:1, and (Qwen3-Next) MoE FFNs with a sigmoid-gated shared expert.

Layout differences from ours, converted both ways (fp32 exact except the norm shift, see below):
  attention  q_proj (H 2D, C) interleaves [q_h | gate_h] per head; ours: q_proj and gate_proj.
  GDN        Qwen3-Next fuses in_proj_qkvz (per key head: [q | k | v of its value heads | z]) and
             in_proj_ba (per key head: [b | a]); Qwen3.5 has in_proj_qkv ([q | k | v]), in_proj_z,
             in_proj_b, in_proj_a. conv1d, A_log, dt_bias, norm (plain gain), out_proj as ours.
  norms      the decoder, final and QK norms are zero-centred, x_hat (1 + w); ours store 1 + w.
  MoE        gate.weight (router), experts fused (transformers 5), shared_expert, shared_expert_gate.
A `qwen3_5` directory (the multimodal checkpoint) imports its text model, as transformers'
Qwen3_5ForCausalLM does: `model.language_model.*`, ignoring the vision tower and the MTP weights
(released Qwen3-Next checkpoints carry MTP weights too; they are skipped likewise).
Export picks the family by the FFNs: MoE hybrids write Qwen3-Next, dense ones Qwen3.5 (so a dense
Qwen3-Next checkpoint imports and re-exports as Qwen3_5ForCausalLM, with the same logits).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from model.config import (
    AttentionConfig,
    ConfigError,
    FFNConfig,
    GDNConfig,
    InitConfig,
    ModelConfig,
    MoEConfig,
)
from model.hf.family import HF_FAMILIES
from model.hf.layered import (
    DENSE_FFN,
    LayeredFamily,
    Params,
    block_checks,
    experts_from_hf,
    experts_to_hf,
    first_failing,
    interleave_groups,
    layout_fields,
    optional_rename,
    pop,
    rename,
    split_groups,
)
from model.hf.llama import gqa_hf_config
from model.hf.rope import rope_from_hf, rope_rows, rope_scaling
from model.mixers.rope import half_to_interleaved, interleaved_to_half

HYBRID_MIXERS = {"gdn": "linear_attention", "gqa": "full_attention"}
PLAIN = {n: n for n in ("k_proj.weight", "v_proj.weight", "o_proj.weight")}
PLAIN_BIASES = {n: n for n in ("k_proj.bias", "v_proj.bias", "o_proj.bias")}
GDN_SHARED = {"conv.weight": "conv1d.weight", "A_log": "A_log", "dt_bias": "dt_bias"}
GDN_SHARED |= {"norm.weight": "norm.weight", "o_proj.weight": "out_proj.weight"}
SHARED_EXPERT = {f"shared.{n}": f"shared_expert.{n}" for n in DENSE_FFN}
DENSE_NAMES = ("gate_proj", "up_proj", "down_proj")  # per-expert matrices in checkpoints


def _qwen_unsupported(cfg: ModelConfig) -> str | None:
    """The first option of `cfg` no Qwen3-Next / Qwen3.5 model has (`key=value (why)`), or None."""
    att, rope = cfg.attention, cfg.rope
    checks = block_checks(cfg, "Qwen3-Next", tuple(HYBRID_MIXERS))
    checks += [
        (att.kind != "gqa", lambda: f"attention.kind={att.kind!r} (full layers are gated GQA)"),
        (cfg.position != "rope", lambda: f"position={cfg.position!r} (Qwen3-Next uses RoPE)"),
        (not att.output_gate, lambda: "attention.output_gate=false (full layers are gated)"),
        (not att.qk_norm, lambda: "attention.qk_norm=false (full layers have QK-norm)"),
        (rope.scaling == "ntk", lambda: "rope.scaling='ntk' (static NTK: raise rope.theta)"),
        (rope.mscale_all_dim > 0, lambda: f"rope.mscale_all_dim={rope.mscale_all_dim}"),
        (cfg.gdn.allow_neg_eigval, lambda: "gdn.allow_neg_eigval=true (OLMo-hybrid's variant)"),
    ]
    return first_failing(checks)


def _moe_unsupported(cfg: ModelConfig) -> str | None:
    moe = cfg.moe
    checks = [
        (moe.score_func != "softmax", lambda: f"moe.score_func={moe.score_func!r} (softmax)"),
        (moe.n_groups > 1, lambda: f"moe.n_groups={moe.n_groups} (no group-limited routing)"),
        (moe.route_scale != 1.0, lambda: f"moe.route_scale={moe.route_scale}"),
        (moe.n_shared_experts != 1, lambda: f"moe.n_shared_experts={moe.n_shared_experts} (1)"),
        (not moe.shared_expert_gate, lambda: "moe.shared_expert_gate=false (it is gated)"),
        (moe.bias_update_rate > 0, lambda: "moe.bias_update_rate>0 (the router has no bias)"),
        (moe.capacity_factor > 0, lambda: f"moe.capacity_factor={moe.capacity_factor}"),
    ]
    return first_failing(checks)


class QwenHybrid(LayeredFamily):
    """What Qwen3-Next and Qwen3.5's text model share."""

    mixer_modules: ClassVar[dict[str, str]] = {"gdn": "linear_attn", "gqa": "self_attn"}
    zero_centred = True

    def claims(self, cfg: ModelConfig) -> bool:
        return "gdn" in cfg.mixer_kinds()

    def unsupported(self, cfg: ModelConfig) -> str | None:
        option = _qwen_unsupported(cfg) or self._family_unsupported(cfg)
        return None if option is None else f"model.{option} has no {self.architecture} equivalent"

    def _family_unsupported(self, cfg: ModelConfig) -> str | None:
        raise NotImplementedError

    # ---- config ---------------------------------------------------------------------------------

    def to_hf_config(self, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
        g = cfg.gdn
        rope = {"rope_type": "default", "rope_theta": cfg.rope.theta}
        rope |= rope_scaling(cfg.rope) or {}
        return (
            self.base_hf_config(cfg, dtype)
            | gqa_hf_config(cfg)
            | {
                "rope_parameters": rope | {"partial_rotary_factor": cfg.rope.fraction},
                "layer_types": [HYBRID_MIXERS[kind] for kind in cfg.mixer_kinds()],
                "linear_conv_kernel_dim": g.conv_kernel,
                "linear_key_head_dim": g.head_dim,
                "linear_value_head_dim": g.v_head_dim or g.head_dim,
                "linear_num_key_heads": g.n_heads,
                "linear_num_value_heads": g.n_v_heads or g.n_heads,
            }
        )

    def from_hf_config(self, hf: dict[str, Any], rope_pairing: str) -> ModelConfig:
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act={hf['hidden_act']!r} is not supported (SwiGLU: silu)")
        n_layers = hf["num_hidden_layers"]
        types = hf.get("layer_types") or [
            "full_attention"
            if (i + 1) % hf.get("full_attention_interval", 4) == 0
            else "linear_attention"
            for i in range(n_layers)
        ]
        kinds = {v: k for k, v in HYBRID_MIXERS.items()}
        unknown = sorted({t for t in types if t not in kinds})
        if unknown:
            raise ConfigError(
                f"layer_types {unknown} are not supported (linear_attention, full_attention)"
            )
        hf = dict(hf)
        params = hf.get("rope_parameters") or {}
        if "partial_rotary_factor" not in params and "partial_rotary_factor" not in hf:
            hf["partial_rotary_factor"] = 0.25  # transformers' default for these families
        ignored = ("mrope_section", "mrope_interleaved")
        rope, max_seq_len = rope_from_hf(hf, rope_pairing, partial=True, ignored=ignored)
        heads = hf["num_attention_heads"]
        return ModelConfig(
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            n_layers=n_layers,
            max_seq_len=max_seq_len,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=rope,
            **layout_fields([kinds[t] for t in types], "gqa"),
            attention=AttentionConfig(
                n_heads=heads,
                n_kv_heads=hf.get("num_key_value_heads") or heads,
                head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                qk_norm=True,
                output_gate=True,
                bias=bool(hf.get("attention_bias", False)),
            ),
            gdn=GDNConfig(
                n_heads=hf["linear_num_key_heads"],
                n_v_heads=hf["linear_num_value_heads"],
                head_dim=hf["linear_key_head_dim"],
                v_head_dim=hf["linear_value_head_dim"],
                conv_kernel=hf.get("linear_conv_kernel_dim", 4),
            ),
            ffn=FFNConfig(kind="swiglu", hidden=hf["intermediate_size"]),
            moe=self._moe_from_hf(hf),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init=InitConfig(std=float(hf.get("initializer_range", 0.02))),
        )

    def _moe_from_hf(self, hf: dict[str, Any]) -> MoEConfig:
        return MoEConfig()

    def from_hf_state(
        self, hf_state: Params, cfg: ModelConfig, part: int | None = None
    ) -> tuple[Params, list[str]]:
        text = {}
        for name, tensor in hf_state.items():
            if name.startswith(("model.visual.", "mtp.")):
                continue  # the vision tower and MTP head (transformers' text models skip them too)
            text[name.replace("model.language_model.", "model.", 1)] = tensor
        return super().from_hf_state(text, cfg, part)

    # ---- weights --------------------------------------------------------------------------------

    def mixer_to_hf(self, kind: str, params: Params, cfg: ModelConfig) -> Params:
        if kind == "gdn":
            return self.gdn_to_hf(params, cfg) | rename(params, GDN_SHARED)
        H = cfg.attention.n_heads
        q = rope_rows(pop(params, "q_proj.weight"), cfg, interleaved_to_half)
        k = rope_rows(pop(params, "k_proj.weight"), cfg, interleaved_to_half)
        out = {
            "q_proj.weight": interleave_groups([q, pop(params, "gate_proj.weight")], H),
            "k_proj.weight": k,
        }
        for name in ("q_norm.weight", "k_norm.weight"):
            out[name] = self.gain_to_hf(rope_rows(pop(params, name), cfg, interleaved_to_half))
        if "q_proj.bias" in params:
            q_bias = rope_rows(pop(params, "q_proj.bias"), cfg, interleaved_to_half)
            out["q_proj.bias"] = interleave_groups([q_bias, pop(params, "gate_proj.bias")], H)
            out["k_proj.bias"] = rope_rows(pop(params, "k_proj.bias"), cfg, interleaved_to_half)
        plain = {n: t for n, t in PLAIN.items() if n != "k_proj.weight"}
        return out | rename(params, plain) | optional_rename(params, PLAIN_BIASES)

    def mixer_from_hf(self, kind: str, params: Params, cfg: ModelConfig, where: str) -> Params:
        if kind == "gdn":
            shared = rename(params, {v: k for k, v in GDN_SHARED.items()}, where)
            return self.gdn_from_hf(params, cfg, where) | shared
        H, D = cfg.attention.n_heads, cfg.head_dim
        q, gate = split_groups(pop(params, "q_proj.weight", where), H, [D, D])
        out = {
            "q_proj.weight": rope_rows(q, cfg, half_to_interleaved),
            "gate_proj.weight": gate,
            "k_proj.weight": rope_rows(
                pop(params, "k_proj.weight", where), cfg, half_to_interleaved
            ),
        }
        for name in ("q_norm.weight", "k_norm.weight"):
            gain = rope_rows(pop(params, name, where), cfg, half_to_interleaved)
            out[name] = self.gain_from_hf(gain)
        if "q_proj.bias" in params:
            q_bias, gate_bias = split_groups(params.pop("q_proj.bias"), H, [D, D])
            out["q_proj.bias"] = rope_rows(q_bias, cfg, half_to_interleaved)
            out["gate_proj.bias"] = gate_bias
            out["k_proj.bias"] = rope_rows(
                pop(params, "k_proj.bias", where), cfg, half_to_interleaved
            )
        plain = {n: t for n, t in PLAIN.items() if n != "k_proj.weight"}
        return out | rename(params, plain, where) | optional_rename(params, PLAIN_BIASES)

    def gdn_to_hf(self, params: Params, cfg: ModelConfig) -> Params:
        raise NotImplementedError

    def gdn_from_hf(self, params: Params, cfg: ModelConfig, where: str) -> Params:
        raise NotImplementedError

    def ffn_to_hf(self, kind: str, params: Params, cfg: ModelConfig) -> Params:
        if kind == "dense":
            return rename(params, {n: n for n in DENSE_FFN})
        bias = params.pop("router.expert_bias", None)
        if bias is not None and not bias.is_meta and bias.any():  # HF routes without one
            raise ConfigError(
                "the routers' expert_bias (aux-loss-free balancing) is not zero: "
                f"{self.architecture} routes without a selection bias"
            )
        out = {"gate.weight": pop(params, "router.gate.weight")}
        out |= experts_to_hf(params, DENSE_NAMES)
        out |= rename(params, SHARED_EXPERT)
        return out | {"shared_expert_gate.weight": pop(params, "shared_gate.weight")}

    def ffn_from_hf(self, kind: str, params: Params, cfg: ModelConfig, where: str) -> Params:
        if kind == "dense":
            return rename(params, {n: n for n in DENSE_FFN}, where)
        E = cfg.moe.n_routed_experts
        out = {
            "router.gate.weight": pop(params, "gate.weight", where),
            "router.expert_bias": torch.zeros(E, dtype=torch.float32),
        }
        out |= experts_from_hf(params, DENSE_NAMES, E, where)
        out |= rename(params, {v: k for k, v in SHARED_EXPERT.items()}, where)
        return out | {"shared_gate.weight": pop(params, "shared_expert_gate.weight", where)}


def _gdn_heads(cfg: ModelConfig) -> tuple[int, int, int, int]:
    """(key heads, value heads per key head, Dk, Dv)."""
    g = cfg.gdn
    n_v = g.n_v_heads or g.n_heads
    return g.n_heads, n_v // g.n_heads, g.head_dim, g.v_head_dim or g.head_dim


@HF_FAMILIES.register("qwen3_next")
class Qwen3Next(QwenHybrid):
    model_types = ("qwen3_next",)
    architecture = "Qwen3NextForCausalLM"

    def claims(self, cfg: ModelConfig) -> bool:
        return super().claims(cfg) and cfg.moe.enabled

    def _family_unsupported(self, cfg: ModelConfig) -> str | None:
        return _moe_unsupported(cfg) if cfg.moe.enabled else None

    def to_hf_config(self, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
        moe = cfg.moe
        fields = {
            "num_experts": moe.n_routed_experts,
            "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": cfg.expert_hidden,
            "shared_expert_intermediate_size": cfg.shared_hidden,
            "norm_topk_prob": moe.norm_topk_prob,
            "router_aux_loss_coef": moe.aux_loss_coef,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(moe.first_k_dense)),
        }
        return super().to_hf_config(cfg, dtype) | (fields if moe.enabled else {"num_experts": 0})

    def _moe_from_hf(self, hf: dict[str, Any]) -> MoEConfig:
        E = hf.get("num_experts", 0)
        if not E:
            return MoEConfig()
        step, dense = hf.get("decoder_sparse_step", 1), list(hf.get("mlp_only_layers") or [])
        if step != 1:
            raise ConfigError(
                f"decoder_sparse_step={step} is not supported (MoE in every layer: 1)"
            )
        if dense != list(range(len(dense))):
            raise ConfigError(
                f"mlp_only_layers={dense} is not supported (only the first k layers can be dense)"
            )
        return MoEConfig(
            n_routed_experts=E,
            top_k=hf["num_experts_per_tok"],
            expert_hidden=hf["moe_intermediate_size"],
            n_shared_experts=1,
            shared_hidden=hf["shared_expert_intermediate_size"],
            shared_expert_gate=True,
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)),
            first_k_dense=len(dense),
        )

    def gdn_to_hf(self, params: Params, cfg: ModelConfig) -> Params:
        Hk = cfg.gdn.n_heads
        q, k, v, z, b, a = (pop(params, f"{n}_proj.weight") for n in "qkvzba")
        return {
            "in_proj_qkvz.weight": interleave_groups([q, k, v, z], Hk),
            "in_proj_ba.weight": interleave_groups([b, a], Hk),
        }

    def gdn_from_hf(self, params: Params, cfg: ModelConfig, where: str) -> Params:
        Hk, group, Dk, Dv = _gdn_heads(cfg)
        qkvz = pop(params, "in_proj_qkvz.weight", where)
        parts = split_groups(qkvz, Hk, [Dk, Dk, group * Dv, group * Dv])
        parts += split_groups(pop(params, "in_proj_ba.weight", where), Hk, [group, group])
        return {f"{n}_proj.weight": t for n, t in zip("qkvzba", parts, strict=True)}


@HF_FAMILIES.register("qwen3_5")
class Qwen3_5(QwenHybrid):
    model_types = ("qwen3_5_text", "qwen3_5")
    architecture = "Qwen3_5ForCausalLM"

    def claims(self, cfg: ModelConfig) -> bool:
        return super().claims(cfg) and not cfg.moe.enabled

    def _family_unsupported(self, cfg: ModelConfig) -> str | None:
        if cfg.moe.enabled:
            return "moe (Qwen3.5's dense text model; MoE hybrids export as Qwen3-Next)"
        return None

    def from_hf_config(self, hf: dict[str, Any], rope_pairing: str) -> ModelConfig:
        if hf.get("model_type") == "qwen3_5":  # the multimodal checkpoint: its text model
            text = dict(hf.get("text_config") or {})
            text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
            hf = text
        return super().from_hf_config(hf, rope_pairing)

    def gdn_to_hf(self, params: Params, cfg: ModelConfig) -> Params:
        q, k, v = (pop(params, f"{n}_proj.weight") for n in "qkv")
        out = {"in_proj_qkv.weight": torch.cat([q, k, v])}
        return out | {f"in_proj_{n}.weight": pop(params, f"{n}_proj.weight") for n in "zba"}

    def gdn_from_hf(self, params: Params, cfg: ModelConfig, where: str) -> Params:
        Hk, group, Dk, Dv = _gdn_heads(cfg)
        qkv = pop(params, "in_proj_qkv.weight", where)
        q, k, v = qkv.split([Hk * Dk, Hk * Dk, Hk * group * Dv])
        out = {"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v}
        return out | {f"{n}_proj.weight": pop(params, f"in_proj_{n}.weight", where) for n in "zba"}
