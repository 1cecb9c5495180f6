"""Grouped experts: the grouped-GEMM path and the loop fallback against a per-expert float64 loop,
forward and gradients, with empty experts, in fp32 and bf16."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from model.init import InitStds
from model.moe import GroupedExperts, grouped_mm_supported
from model.moe import experts as experts_module

COUNTS = [5, 0, 3, 0, 9, 1, 0, 6]  # empty experts, including the last but one and at the start


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32: elementwise, summation order only (atol 1e-5, rtol 1e-4). bf16: the inputs are the same
    bf16 values, but intermediate activations are rounded to 8 bits, so single elements of a
    gradient (sums with cancellation) can be off by several percent: compare the relative
    Frobenius error, < 1%."""
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual.double(), expected, atol=1e-5, rtol=1e-4)
    else:
        error = (actual.double() - expected).norm() / expected.norm().clamp(min=1e-12)
        assert error < 1e-2, f"relative error {error:.2e}"


def make(C: int = 32, F_: int = 48, counts: list[int] = COUNTS, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    experts = GroupedExperts(len(counts), C, F_, F.silu)
    experts.init_weights(InitStds(inner=0.2, value=0.2, out=0.2))
    experts.to(dtype)
    x = torch.randn(sum(counts), C, dtype=dtype, requires_grad=True)
    return experts, x, torch.tensor(counts)


def reference(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor):
    """Per-expert loop in float64; returns output and gradients for the upstream gradient g."""
    params = [
        w.detach().double().requires_grad_() for w in (experts.w_gate, experts.w_up, experts.w_down)
    ]
    xd = x.detach().double().requires_grad_()
    rows, start = [], 0
    for e, n in enumerate(counts.tolist()):
        chunk = xd[start : start + n]
        rows.append((F.silu(chunk @ params[0][e]) * (chunk @ params[1][e])) @ params[2][e])
        start += n
    return torch.cat(rows), xd, params


def impls() -> list[str]:
    grouped = ["grouped_mm"] if hasattr(torch, "_grouped_mm") else []
    return ["loop", "padded_bmm", "threaded_mm", *grouped]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", impls())
def test_experts_match_the_per_expert_loop(impl, dtype):
    if impl == "grouped_mm" and not experts_module._grouped_mm_probe("cpu", dtype):
        pytest.skip(
            f"machine: torch._grouped_mm does not run on cpu/{dtype}"
        )  # eager fp32 is enough
    experts, x, counts = make(dtype=dtype)
    experts.impl = impl
    y = experts(x, counts)
    g = torch.randn(y.shape, dtype=dtype)
    (y * g).sum().backward()
    want, xd, params = reference(experts, x, counts)
    (want * g.double()).sum().backward()
    assert y.dtype == dtype
    assert_close(y, want)
    assert_close(x.grad, xd.grad)
    for w, ref in zip((experts.w_gate, experts.w_up, experts.w_down), params):
        assert_close(w.grad, ref.grad)
        for e, n in enumerate(COUNTS):
            if n == 0:
                assert w.grad[e].abs().sum() == 0  # an empty expert gets a zero gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_three_paths_agree(dtype):
    outs = []
    for impl in impls():
        experts, x, counts = make(dtype=dtype)
        experts.impl = impl
        y = experts(x, counts)
        y.sum().backward()  # an expanded upstream gradient (strides 0): the GEMM backward needs help
        outs.append((y, x.grad, experts.w_down.grad))
    first, *others = outs
    for other in others:
        for a, b in zip(other, first):
            assert_close(a, b.double())


def test_every_expert_empty_gives_an_empty_result():
    experts, _, _ = make()
    x = torch.zeros(0, 32, requires_grad=True)
    for impl in impls():
        experts.impl = impl
        y = experts(x, torch.zeros(8, dtype=torch.int64))
        assert y.shape == (0, 32)
        y.sum().backward()


def test_auto_uses_the_grouped_gemm_when_aligned_and_falls_back_otherwise(monkeypatch):
    if not grouped_mm_supported("cpu", torch.bfloat16):
        pytest.skip("machine: no grouped GEMM here")
    calls = []
    real = experts_module.grouped_mm
    monkeypatch.setattr(
        experts_module, "grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    experts, x, counts = make(dtype=torch.bfloat16)  # C=32, F=48: rows of 64/96 bytes
    experts(x, counts)
    assert len(calls) == 3  # gate, up, down (the padding would be 72 rows for 24: too much)
    calls.clear()
    experts, x, counts = make(C=12, F_=20, dtype=torch.bfloat16)  # 24-byte rows: not allowed
    y = experts(x, counts)
    assert calls == []
    want, _, _ = reference(experts, x, counts)
    assert_close(y, want)


BALANCED = [4, 3, 4, 2, 4, 4, 1, 4]  # padded: 8 x 4 = 32 <= 2 x 26 rows


def test_auto_pads_balanced_loads_on_cpu_in_bf16(monkeypatch):
    chosen = []
    real = GroupedExperts._padded_bmm
    monkeypatch.setattr(
        GroupedExperts, "_padded_bmm", lambda self, *a: chosen.append(1) or real(self, *a)
    )
    experts, x, counts = make(counts=BALANCED, dtype=torch.bfloat16)
    y = experts(x, counts)
    assert chosen == [1]
    want, _, _ = reference(experts, x, counts)
    assert_close(y, want)


@pytest.mark.parametrize("compiling", [False, True])
def test_auto_takes_per_group_gemms_in_eager_fp32_on_cpu_and_pads_when_compiling(
    monkeypatch, compiling
):
    if not experts_module._grouped_mm_probe("cpu", torch.float32):
        pytest.skip("machine: torch._grouped_mm does not run fp32 on this CPU")
    experts, x, counts = make(counts=BALANCED * 2)  # 16 groups of about 3 rows: small
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    want = "padded_bmm" if compiling else "threaded_mm"  # CPU's meta kernel takes only bf16
    assert experts.choose("cpu", torch.float32, x.shape[0], counts) == want
    assert experts.choose("cpu", torch.bfloat16, x.shape[0], counts) == "padded_bmm"
    big = torch.tensor([1100] * 16)  # large groups: torch's grouped GEMM splits each over threads
    want_big = "padded_bmm" if compiling else "grouped_mm"
    assert experts.choose("cpu", torch.float32, 17600, big) == want_big
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)  # 2 groups a thread: grouped
    assert experts.choose("cpu", torch.float32, x.shape[0], counts) == want_big
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    experts_odd, x_odd, _ = make(C=30, F_=48, counts=BALANCED * 2)  # 120-byte rows: unaligned
    assert experts_odd.choose("cpu", torch.float32, x_odd.shape[0], counts) == "padded_bmm"
    monkeypatch.undo()
    y = experts(x, counts)
    want_y, _, _ = reference(experts, x, counts)
    assert_close(y, want_y)


@pytest.mark.parametrize("threads, small", [(1, False), (2, True), (8, True), (9, False)])
def test_small_groups_need_two_threads_eight_groups_a_thread_and_few_rows(
    monkeypatch, threads, small
):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    limit_fused, limit = experts_module.SMALL_GROUP_FUSED, experts_module.SMALL_GROUP_UNFUSED
    assert experts_module.small_groups(64 * (limit_fused - 1), 64, fused=True) == small
    assert not experts_module.small_groups(64 * limit_fused, 64, fused=True)
    assert experts_module.small_groups(64 * (limit - 1), 64, fused=False) == small
    assert not experts_module.small_groups(64 * limit, 64, fused=False)


def test_no_threads_under_a_dispatch_mode_such_as_selective_checkpointing(monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert experts_module.small_groups(64 * 100, 64, fused=True)
    with Passthrough():
        assert not experts_module.small_groups(64 * 100, 64, fused=True)


def test_autocast_computes_in_bf16_from_fp32_weights():
    experts, x, counts = make()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = experts(x, counts)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert experts.w_gate.grad.dtype == torch.float32
    want, _, _ = reference(experts, x, counts)
    assert_close(y, want)


def test_local_takes_the_shard_of_a_distributed_tensor():
    class Sharded:  # what a DTensor offers: the local experts
        def __init__(self, local):
            self.local = local

        def to_local(self):
            return self.local

    t = torch.ones(2, 3)
    assert experts_module._local(Sharded(t)) is t
    assert experts_module._local(t) is t


def test_counts_must_match_the_local_experts():
    experts, x, _ = make()
    with pytest.raises(ValueError, match="3 expert counts for 8 local experts"):
        experts(x, torch.tensor([10, 10, sum(COUNTS) - 20]))


@pytest.mark.skipif(
    not grouped_mm_supported("cpu", torch.bfloat16), reason="machine: no grouped GEMM"
)
def test_the_compiled_grouped_gemm_path_matches_eager_over_changing_counts():
    """Compiled as one graph (no gradient hook while compiling, no data_ptr() alignment check:
    model/moe/experts.py) with the row count changing from call to call (dynamic shapes, as
    routing makes them): outputs and gradients equal the eager grouped GEMM's."""
    torch._dynamo.reset()
    experts, _, _ = make(dtype=torch.bfloat16)
    experts.impl = "grouped_mm"
    compiled = torch.compile(experts, fullgraph=True)  # no break, no fallback to eager
    for counts in ([5, 0, 3, 0, 9, 1, 0, 6], [2, 7, 0, 4, 4, 0, 8, 1], [0, 0, 16, 1, 3, 3, 3, 2]):
        x = torch.randn(sum(counts), 32, dtype=torch.bfloat16, requires_grad=True)
        got = compiled(x, torch.tensor(counts))
        (got.float() * torch.arange(32.0)).sum().backward()
        grads = [x.grad, *(w.grad for w in experts.parameters())]
        x.grad = None
        experts.zero_grad()
        want = experts(x, torch.tensor(counts))
        (want.float() * torch.arange(32.0)).sum().backward()
        # bf16: Inductor keeps silu(gate) * up in fp32 where eager rounds it, a few bf16 ulps
        for a, b in zip([got, *grads], [want, x.grad, *(w.grad for w in experts.parameters())]):
            assert (a.float() - b.float()).abs().max() <= 2e-2 * b.float().abs().max()
        x.grad = None
        experts.zero_grad()


@pytest.mark.skipif(
    not grouped_mm_supported("cpu", torch.bfloat16), reason="machine: no grouped GEMM"
)
@pytest.mark.parametrize(
    ("checkpointed", "positions"), [(False, None), (True, None), (False, (8, 24))]
)
def test_a_compiled_moe_layer_is_one_graph_unless_checkpointed(
    monkeypatch, checkpointed, positions
):
    """The MoE layer as compiled blocks run it on a GPU (grouped GEMMs, the gather combine): one
    graph (fullgraph) with its statistics inside: no break at the expert counts (bincount), the
    grouped-GEMM probe, the alignment check or the recompute check, nor at the rows of
    `local_positions` (tensor parallelism's share of the routed work; a nonzero() broke there).
    Under activation checkpointing the recompute check stays eager (autograd's task id; a
    forward rerun in backward must not count twice): that break only. Outputs, gradients, the
    balance loss (popped once per forward) and the token counts equal eager's."""
    from model.init import block_init_stds
    from model.moe import slots
    from model.moe.layer import MoE
    from model.presets import load_preset

    monkeypatch.setattr(slots, "embedding_bag_combines", lambda device_type: False)
    cfg = load_preset("tiny_moe", {"moe.aux_loss_coef": 0.01})
    torch.manual_seed(0)
    layer = MoE(cfg, 1)
    layer.init_weights(block_init_stds(cfg.init, cfg.n_layers, 1))
    layer.experts.impl = "grouped_mm"
    layer.checkpointed = checkpointed
    layer.local_positions = positions
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # with positions as compile_model compiles blocks, without fullgraph: fullgraph traced the
    # nonzero() with an unbacked length instead of breaking (torch 2.13), still a host sync
    compiled = torch.compile(layer, fullgraph=not checkpointed and positions is None)
    x = torch.randn(2, 32, cfg.d_model, generator=torch.Generator().manual_seed(1))
    results = []
    for fn in (compiled, layer):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(xi)
        aux = layer.pop_aux_losses()
        assert len(aux) == 1
        (out.float().sum() + aux[0]).backward()
        counts = layer.tokens_per_expert.clone()
        layer.tokens_per_expert.zero_()
        grads = (xi.grad, layer.experts.w_up.grad, layer.router.gate.weight.grad)
        results.append((out, aux[0], counts, *grads))
        layer.zero_grad()
    assert results[0][2].sum() == 2 * 32 * cfg.moe.top_k  # each slot counted once
    reasons = list(torch._dynamo.utils.counters["graph_break"])
    assert all("non-Tensor" in r for r in reasons) and bool(reasons) == checkpointed, reasons
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_the_grouped_gemm_probe_answers_the_same_under_inference_mode():
    """The probe runs a backward; first asked under inference_mode it must not cache False."""
    from model.moe.experts import _grouped_mm_probe

    expected = _grouped_mm_probe.__wrapped__("cpu", torch.bfloat16)
    _grouped_mm_probe.cache_clear()
    with torch.inference_mode():
        assert _grouped_mm_probe("cpu", torch.bfloat16) == expected
    assert _grouped_mm_probe("cpu", torch.bfloat16) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_gemm_is_supported_exactly_where_it_also_compiles(dtype):
    """grouped_mm_supported answers for eager and compiled layers alike: CPU's eager kernel runs
    fp32 but its meta kernel takes only bf16 (an fp32 MoE layer compiled on CPU raised)."""
    from model.moe.experts import grouped_mm

    torch._dynamo.reset()
    x = torch.randn(16, 32, dtype=dtype)
    w = torch.randn(4, 32, 16, dtype=dtype)
    offsets = torch.tensor([3, 8, 8, 16], dtype=torch.int32)
    try:
        got = torch.compile(grouped_mm, fullgraph=True)(x, w, offsets)
    except Exception:  # dynamo's wrapper of the meta kernel's refusal
        compiles = False
    else:
        torch.testing.assert_close(got, grouped_mm(x, w, offsets))
        compiles = True
    assert grouped_mm_supported("cpu", dtype) == compiles


def test_a_compiled_fp32_moe_layer_on_cpu_runs_with_an_unbalanced_load(monkeypatch):
    """Compiled fp32 on CPU with a load too unbalanced to pad (PAD_LIMIT 0 here; in a run, a
    few hot experts at initialization): after the graph break at the largest count, dynamo
    compiles every frame it enters, and it traced the grouped-GEMM probes' failing fp32 meta
    call with fake tensors and raised (`python -m trainer model=tiny_moe` on an AVX2 CPU
    crashed at its first step). The probes run eagerly, and the layer equals eager's."""
    from model.moe.layer import MoE
    from model.presets import load_preset

    monkeypatch.setattr(experts_module, "PAD_LIMIT", 0.0)
    experts_module._grouped_mm_probe.cache_clear()  # first asked inside the compiled layer
    experts_module._grouped_mm_meta_probe.cache_clear()
    cfg = load_preset("tiny_moe")
    torch.manual_seed(0)
    layer = MoE(cfg, 1)
    layer.init_weights(InitStds(inner=0.02, value=0.02, out=0.02))
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="eager")
    x = torch.randn(2, 16, cfg.d_model, generator=torch.Generator().manual_seed(1))
    outs = []
    for fn in (compiled, layer):
        xi = x.clone().requires_grad_()
        out = fn(xi)
        out.sum().backward()
        layer.pop_aux_losses()
        outs.append((out, xi.grad, layer.experts.w_down.grad.clone()))
        layer.zero_grad()
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch: no grouped GEMM")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cast_weights_take_the_gate_and_up_projections_as_one_grouped_gemm(monkeypatch, dtype):
    """Weights cast to the compute dtype (bf16: autocast over fp32 weights, the GPU runs; fp32:
    fp64 weights, to check the fp32 arithmetic) run x [W_gate | W_up] as one grouped GEMM of
    width 2F: its output equals two GEMMs' bit for bit (the same dot products). dx is one GEMM
    over 2F accumulated in fp32 instead of two (each rounded to x's dtype) and their sum: fp32
    summation order (1.4e-7 relative Frobenius here; bound 1e-6), a bf16 rounding or two in
    bf16 (3e-3; bound 1e-2, 2.5 bf16 epsilons). The weights' gradients are the same GEMMs
    (equal here; same bounds). Weights already in the compute dtype keep three GEMMs."""
    calls = []
    real = experts_module.grouped_mm
    monkeypatch.setattr(
        experts_module, "grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    weight_dtype = torch.float64 if dtype == torch.float32 else torch.float32
    experts, x, counts = make(C=32, F_=48, dtype=weight_dtype)
    experts.impl = "grouped_mm"
    x = x.detach().to(dtype).requires_grad_()
    cot = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    weights = (experts.w_gate, experts.w_up, experts.w_down)
    results = []
    for fused in (True, False):
        if fused:
            y = (
                experts(x, counts)
                if dtype == torch.float32
                else autocast_experts(experts, x, counts)
            )
            assert len(calls) == 2  # [gate | up], down
        else:
            w = [weight.to(dtype) for weight in weights]
            mm = functools.partial(real, offsets=counts.cumsum(0).int())
            y = mm(F.silu(mm(x, w[0])) * mm(x, w[1]), w[2])
        results.append((y, *torch.autograd.grad(y, (x, *weights), cot)))
    (y, *grads), (want_y, *want_grads) = results
    assert y.dtype == dtype and torch.equal(y, want_y)
    for got, want in zip(grads, want_grads, strict=True):
        error = (got.double() - want.double()).norm() / want.double().norm()
        assert error < (1e-6 if dtype == torch.float32 else 1e-2), f"relative error {error:.2e}"
    calls.clear()
    experts.to(dtype)(x, counts)  # weights in the compute dtype: no cast, three GEMMs
    assert len(calls) == 3


def autocast_experts(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return experts(x, counts)
