"""Router and MoE layer against slow float64 references written here from the formulas: a per-token
router (scores, group limit, top-k, renormalization, scale, selection bias) and a per-token,
per-expert loop for the layer (dropless and with capacity dropping), forward and gradients."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from model import FFNConfig, ModelConfig, MoEConfig
from model.moe import MoE, local_dispatch, pop_aux_loss

# fp32 module vs float64 reference over <= 48 tokens and widths <= 32: summation-order error only
ATOL, RTOL = 1e-5, 1e-4


def moe_config(d_model: int = 32, hidden: int = 24, **moe: Any) -> ModelConfig:
    return ModelConfig(
        vocab_size=64,
        d_model=d_model,
        n_layers=2,
        ffn=FFNConfig(hidden=hidden),
        moe=MoEConfig(**({"n_routed_experts": 8, "top_k": 2} | moe)),
    )


def make_layer(seed: int = 0, **moe: Any) -> MoE:
    torch.manual_seed(seed)
    cfg = moe_config(**moe)
    layer = MoE(cfg, layer_id=1)
    from model.init import block_init_stds

    layer.init_weights(block_init_stds(cfg.init, cfg.n_layers, 1))
    with torch.no_grad():  # larger weights than the init so every term is visible
        for p in layer.parameters():
            p.mul_(10)
    return layer


def inputs(B: int = 3, T: int = 8, C: int = 32, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, C, generator=g)


# ---- references ---------------------------------------------------------------------------------


def ref_route(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, cfg: MoEConfig
) -> list[tuple[list[int], torch.Tensor]]:
    """Per token (float64): the selected experts (in selection order) and their weights."""
    out = []
    E, G = cfg.n_routed_experts, cfg.n_groups
    for t in range(x.shape[0]):
        logits = weight.double() @ x[t].double()
        s = logits.softmax(-1) if cfg.score_func == "softmax" else logits.sigmoid()
        choice = s + bias.double()
        if cfg.topk_groups < G:
            size = E // G
            group_score = [
                sorted(choice[g * size : (g + 1) * size].tolist(), reverse=True)[:2]
                for g in range(G)
            ]
            best = sorted(range(G), key=lambda g: -sum(group_score[g]))[: cfg.topk_groups]
            for g in range(G):
                if g not in best:
                    choice[g * size : (g + 1) * size] = -math.inf
        idx = sorted(range(E), key=lambda e: -choice[e].item())[: cfg.top_k]
        w = s[idx]
        if cfg.norm_topk_prob:
            w = w / w.sum()
        out.append((idx, w * cfg.route_scale))
    return out


def ref_expert(x: torch.Tensor, w_gate, w_up, w_down) -> torch.Tensor:
    return (F.silu(x @ w_gate) * (x @ w_up)) @ w_down


def ref_moe(layer: MoE, x: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """Float64 loop over tokens and their experts; `params` are float64 copies (for gradients).
    Capacity: each expert serves its first ceil(cf N k / E) tokens in token order."""
    cfg = layer.cfg
    B, T, C = x.shape
    flat = x.reshape(-1, C)
    routes = ref_route(flat.detach(), params["router.gate.weight"], layer.router.expert_bias, cfg)
    # the weights are differentiable functions of the router weight: recompute them with autograd
    capacity = math.inf
    if cfg.capacity_factor:
        capacity = math.ceil(cfg.capacity_factor * flat.shape[0] * cfg.top_k / cfg.n_routed_experts)
    served = [0] * cfg.n_routed_experts
    rows = []
    for t, (idx, _) in enumerate(routes):
        logits = params["router.gate.weight"] @ flat[t]
        s = logits.softmax(-1) if cfg.score_func == "softmax" else logits.sigmoid()
        w = s[idx]
        if cfg.norm_topk_prob:
            w = w / w.sum()
        w = w * cfg.route_scale
        y = torch.zeros(C, dtype=torch.float64)
        for j, e in enumerate(idx):
            served[e] += 1
            if served[e] > capacity:
                continue  # dropped: this slot contributes nothing
            y = y + w[j] * ref_expert(
                flat[t],
                params["experts.w_gate"][e],
                params["experts.w_up"][e],
                params["experts.w_down"][e],
            )
        if layer.shared is not None:
            y = (
                y
                + (
                    F.silu(flat[t] @ params["shared.gate_proj.weight"].T)
                    * (flat[t] @ params["shared.up_proj.weight"].T)
                )
                @ params["shared.down_proj.weight"].T
            )
        rows.append(y)
    return torch.stack(rows).view(B, T, C)


def double_params(layer: MoE) -> dict[str, torch.Tensor]:
    return {n: p.detach().double().requires_grad_() for n, p in layer.named_parameters()}


# ---- router --------------------------------------------------------------------------------------

ROUTINGS = {
    "softmax": dict(score_func="softmax"),
    "softmax_no_renorm_scaled": dict(score_func="softmax", norm_topk_prob=False, route_scale=1.7),
    "sigmoid": dict(score_func="sigmoid", route_scale=2.5),
    "sigmoid_no_renorm": dict(score_func="sigmoid", norm_topk_prob=False),
    "groups": dict(
        score_func="sigmoid",
        n_routed_experts=16,
        top_k=4,
        n_groups=4,
        topk_groups=2,
        route_scale=2.5,
    ),
    "groups_softmax": dict(n_routed_experts=12, top_k=3, n_groups=6, topk_groups=2),
}


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("with_bias", [False, True])
def test_router_matches_the_per_token_reference(routing, with_bias):
    layer = make_layer(**ROUTINGS[routing])
    if with_bias:
        layer.router.expert_bias.copy_(0.3 * torch.randn(layer.n_experts))
    x = inputs().reshape(-1, 32)
    r = layer.router(x)
    assert r.topk_idx.dtype == torch.int64 and r.topk_weight.dtype == torch.float32
    assert r.scores.dtype == r.logits.dtype == torch.float32
    ref = ref_route(x, layer.router.gate.weight, layer.router.expert_bias, layer.cfg)
    for t, (idx, w) in enumerate(ref):
        order = torch.argsort(r.topk_idx[t])  # compare as sets: sort both by expert id
        ref_order = torch.argsort(torch.tensor(idx))
        assert r.topk_idx[t][order].tolist() == sorted(idx)
        torch.testing.assert_close(
            r.topk_weight[t][order].double(), w[ref_order], atol=ATOL, rtol=RTOL
        )


def test_group_limit_changes_the_selection_and_keeps_it_inside_the_best_groups():
    cfg = dict(score_func="sigmoid", n_routed_experts=16, top_k=4, n_groups=4)
    limited, free = make_layer(**cfg, topk_groups=2), make_layer(**cfg, topk_groups=4)
    x = inputs().reshape(-1, 32)
    a, b = limited.router(x).topk_idx, free.router(x).topk_idx
    assert (a.sort().values != b.sort().values).any(dim=-1).sum() >= 5  # the limit matters here
    assert all(len(set((row // 4).tolist())) <= 2 for row in a)  # experts from at most 2 groups


def test_selection_bias_changes_the_choice_but_not_the_weights():
    layer = make_layer(score_func="sigmoid", route_scale=2.0)
    x = inputs().reshape(-1, 32)
    layer.router.expert_bias[5] = 100.0  # every token now picks expert 5
    r = layer.router(x)
    assert (r.topk_idx == 5).any(dim=-1).all()
    want = r.scores.gather(1, r.topk_idx)  # unbiased scores, renormalized and scaled
    torch.testing.assert_close(r.topk_weight, 2.0 * want / want.sum(-1, keepdim=True))
    assert (r.topk_weight < 2.0).all()  # a +100 bias in the weights would dominate them


def test_router_logits_are_fp32_under_bf16_autocast():
    layer = make_layer()
    x = inputs().reshape(-1, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = layer.router(x.bfloat16())
    assert r.logits.dtype == torch.float32
    want = x.bfloat16().float() @ layer.router.gate.weight.T
    torch.testing.assert_close(r.logits, want, atol=1e-5, rtol=1e-5)


# ---- layer ---------------------------------------------------------------------------------------

LAYERS = {
    "softmax_top2": dict(),
    "shared_softmax": dict(n_shared_experts=2, shared_hidden=16),
    "deepseek_like": dict(
        score_func="sigmoid",
        n_routed_experts=16,
        top_k=4,
        n_groups=4,
        topk_groups=2,
        route_scale=2.5,
        n_shared_experts=1,
        expert_hidden=16,
    ),
    "top1_no_renorm": dict(top_k=1, norm_topk_prob=False),
}


@pytest.mark.parametrize("config", list(LAYERS))
@pytest.mark.parametrize("impl", ["auto", "grouped_mm", "padded_bmm", "threaded_mm", "loop"])
def test_moe_layer_matches_the_reference_forward_and_gradients(config, impl):
    layer = make_layer(**LAYERS[config])
    layer.experts.impl = impl
    layer.router.expert_bias.copy_(0.05 * torch.randn(layer.n_experts))
    x = inputs().requires_grad_()
    g = torch.randn(x.shape)
    y = layer(x)
    (y * g).sum().backward()

    params = double_params(layer)
    xd = x.detach().double().requires_grad_()
    want = ref_moe(layer, xd, params)
    (want * g.double()).sum().backward()
    torch.testing.assert_close(y.double(), want, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(x.grad.double(), xd.grad, atol=ATOL, rtol=RTOL)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p.grad.double(), params[name].grad, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 1.25])
def test_capacity_dropping_matches_the_reference_and_counts_the_drops(capacity_factor):
    layer = make_layer(capacity_factor=capacity_factor, n_shared_experts=1)
    layer.router.expert_bias[2] = 0.5  # a popular expert, so some slots overflow
    x = inputs().requires_grad_()
    y = layer(x)
    g = torch.randn(x.shape)
    (y * g).sum().backward()
    params = double_params(layer)
    xd = x.detach().double().requires_grad_()
    want = ref_moe(layer, xd, params)
    (want * g.double()).sum().backward()
    torch.testing.assert_close(y.double(), want, atol=ATOL, rtol=RTOL)
    # a dropped slot adds nothing: no gradient to its token, its expert or its routing weight
    torch.testing.assert_close(x.grad.double(), xd.grad, atol=ATOL, rtol=RTOL)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p.grad.double(), params[name].grad, atol=ATOL, rtol=RTOL)

    N, k, E = 24, 2, 8
    capacity = math.ceil(capacity_factor * N * k / E)
    idx = layer.router(x.detach().reshape(-1, 32)).topk_idx
    counts = torch.bincount(idx.flatten(), minlength=E)
    want_dropped = (counts - capacity).clamp(min=0).sum().item()
    assert layer.dropped_tokens.item() == want_dropped
    assert torch.equal(layer.tokens_per_expert, counts.clamp(max=capacity).float())
    if capacity_factor == 0.5:
        assert want_dropped > 0


def test_dispatch_is_the_only_path_to_the_experts_in_global_expert_order():
    layer = make_layer(n_shared_experts=1)
    calls = []

    def spy(x_sorted, counts, experts):
        calls.append((x_sorted.detach().clone(), counts.clone()))
        return local_dispatch(x_sorted, counts, experts)

    x = inputs()
    plain = layer(x)
    layer.dispatch = spy
    torch.testing.assert_close(layer(x), plain, atol=0, rtol=0)
    ((x_sorted, counts),) = calls
    flat = x.reshape(-1, 32)
    idx = layer.router(flat).topk_idx
    assert (
        counts.dtype == torch.int64
        and counts.tolist() == torch.bincount(idx.flatten(), minlength=8).tolist()
    )
    # rows grouped by ascending expert id, tokens in order within an expert
    want = torch.cat([flat[(idx == e).any(-1)] for e in range(8)])
    assert torch.equal(x_sorted, want)

    layer.dispatch = lambda x_sorted, counts, experts: torch.zeros_like(x_sorted)
    torch.testing.assert_close(layer(x), layer.shared(x), atol=0, rtol=0)  # routed part gone


@pytest.mark.parametrize("weights", ["fp32", "bf16"])
def test_output_dtype_follows_a_dense_ffn(weights):
    layer = make_layer(n_shared_experts=1)
    x = inputs()
    if weights == "bf16":
        layer.to(torch.bfloat16)
        assert layer(x.bfloat16()).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x.to(next(layer.parameters()).dtype))
    assert y.dtype == torch.bfloat16
    want = layer.float()(x)
    torch.testing.assert_close(y.float(), want, atol=0.05, rtol=0.05)  # bf16 compute


@pytest.mark.parametrize("early_stop", [True, False])
def test_stats_count_training_forwards_only_and_not_checkpoint_recomputes(early_stop):
    """Non-reentrant checkpointing recomputes the forward inside backward; with early stop off the
    recompute runs the whole layer, statistics code included."""
    layer = make_layer(aux_loss_coef=0.01, seq_aux_loss_coef=0.001, z_loss_coef=0.001)
    x = inputs().requires_grad_()
    idx = layer.router(x.detach().reshape(-1, 32)).topk_idx
    once = torch.bincount(idx.flatten(), minlength=8).float()

    layer(x).sum().backward()
    assert torch.equal(layer.tokens_per_expert, once)
    layer(x)
    assert torch.equal(layer.tokens_per_expert, 2 * once)  # accumulates
    with torch.no_grad():
        layer(x)
    assert torch.equal(layer.tokens_per_expert, 2 * once)  # not in no-grad (evaluation)
    assert len(layer.pop_aux_losses()) == 2

    plain_grads = torch.autograd.grad(
        layer(x).square().sum() + pop_aux_loss(layer), list(layer.parameters())
    )
    layer.tokens_per_expert.zero_()
    with set_checkpoint_early_stop(early_stop):
        y = checkpoint(layer, x, use_reentrant=False)
        losses = layer.pop_aux_losses()
        assert len(losses) == 1
        ckpt_grads = torch.autograd.grad(y.square().sum() + losses[0], list(layer.parameters()))
    assert torch.equal(layer.tokens_per_expert, once)  # the recompute did not count again
    assert layer.pop_aux_losses() == []  # nor keep another loss
    for a, b in zip(plain_grads, ckpt_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_evaluation_forwards_drop_nothing_whatever_the_batch():
    """Capacity limits training forwards only: in eval mode a row's output does not depend on
    which other rows share its batch (downstream scores do not depend on their packing)."""
    layer = make_layer(capacity_factor=0.5)
    layer.router.expert_bias[2] = 0.5  # a popular expert: training forwards overflow it
    x = inputs()
    layer.train()
    with torch.no_grad():
        trained_together = layer(x)
        trained_alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
    assert not torch.allclose(trained_together, trained_alone)  # training drops per batch
    layer.eval()
    with torch.no_grad():
        together = layer(x)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)


# ---- host syncs ----------------------------------------------------------------------------------

_aten = torch.ops.aten
# ops that make a CUDA host wait for the device: a value or a data-dependent size copied back
HOST_SYNCS = {
    _aten._local_scalar_dense.default,  # .item(), int(t), bool(t), .tolist() of a scalar
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten.bincount.default,
    _aten._unique2.default,
    _aten.unique_consecutive.default,
    _aten.repeat_interleave.Tensor,  # without output_size only (its length)
    _aten.index.Tensor,  # with a bool mask only
}


class HostSyncs(TorchDispatchMode):
    """Counts the ops of HOST_SYNCS that a CUDA run would wait on, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        syncs = func in HOST_SYNCS
        if func is _aten.repeat_interleave.Tensor:
            syncs = kwargs.get("output_size") is None
        if func is _aten.index.Tensor:
            syncs = any(i is not None and i.dtype == torch.bool for i in args[1])
        if syncs:
            self.seen[str(func)] = self.seen.get(str(func), 0) + 1
        return func(*args, **kwargs)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch: no grouped GEMM")
@pytest.mark.parametrize("positions", [None, (2, 6)])  # every token; tp's share of routed work
def test_the_gpu_route_waits_on_no_device_value(monkeypatch, positions):
    """One eager forward + backward of the route CUDA runs (grouped GEMM experts, the gather
    combine, bf16 autocast), with the balance losses and statistics, reads no value back and
    makes no data-dependent size: the host never waits for the GPU. With `local_positions`
    the rows come from the positions, not from the mask's nonzero(). Capacity dropping (a kept
    mask over the sorted slots) would wait: 1 sync."""
    from model.moe import slots

    monkeypatch.setattr(slots, "embedding_bag_combines", lambda device_type: False)
    for capacity_factor, syncs in ((0.0, {}), (1.0, {"aten.index.Tensor": 1})):
        if positions is not None and capacity_factor:
            continue  # tp leaves a dropping layer's work repeated (parallel/routed_work.py)
        layer = make_layer(aux_loss_coef=0.01, capacity_factor=capacity_factor)
        layer.experts.impl = "grouped_mm"
        layer.local_positions = positions
        x = inputs().requires_grad_()
        with HostSyncs() as mode, torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
            (y.float().sum() + pop_aux_loss(layer)).backward()
        assert mode.seen == syncs
        assert x.grad is not None and layer.experts.w_up.grad is not None


def test_own_rows_are_the_nonzero_rows_of_own_tokens():
    layer = make_layer()
    for positions in ((0, 8), (3, 5), (4, 4)):
        layer.local_positions = positions
        want = layer._own_tokens(3, 8, torch.device("cpu")).nonzero()[:, 0]
        assert torch.equal(layer._own_rows(3, 8, torch.device("cpu")), want)


def test_the_dispatch_receives_rows_in_the_compute_dtype_under_autocast():
    """Rows reach the experts (or expert parallelism's all-to-all) already in bf16: the N token
    rows are cast before M are gathered."""
    layer = make_layer()
    seen = []
    layer.dispatch = lambda x_sorted, counts, experts: (
        seen.append(x_sorted.dtype) or local_dispatch(x_sorted, counts, experts)
    )
    layer.experts.impl = "loop"  # the general route (CPU's padded one has no dispatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(inputs())
    assert seen == [torch.bfloat16]
