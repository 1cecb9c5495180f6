"""`model.attention.backend` (model/mixers/attention_backend.py): a model attending through the Triton
kernel (under Triton's interpreter on CPU), the plain matmul kernel or FlexAttention gives
SDPA's logits and gradients (fp32) with packed documents, sliding windows, GQA, MLA and ALiBi;
each forward builds only the mask form its layers read; cached generation, torch.compile, the
auto rule and the refusals."""

from __future__ import annotations

import pytest
import torch

from model import generate
from model.errors import ConfigError
from model.mixers.attention_backend import (
    MATMUL_MAX_KEYS,
    BiasedScores,
    matmul_attention,
    resolve_backend,
    sdpa,
)
from model.mixers.masks import AttentionContext, build_mask
from model.presets import load_preset
from model.transformer import build_model

SMALL = {"d_model": 64, "n_layers": 2, "vocab_size": 96, "max_seq_len": 64, "loss_chunk_tokens": 64}
VARIANTS = {  # name -> (preset, overrides): each attends inside documents
    "gqa + window": ("tiny", {"attention.sliding_window": 7}),
    "mha": ("tiny", {"attention.n_kv_heads": 4}),
    "mla": ("tiny_mla", {}),
}
MATMUL_VARIANTS = VARIANTS | {"alibi": ("tiny", {"position": "alibi"})}


def pair(variant: str, backend: str, **extra):
    preset, overrides = MATMUL_VARIANTS[variant]  # VARIANTS and ALiBi
    cfg = load_preset(preset, SMALL | overrides | extra | {"attention.backend": backend})
    return build_model(cfg, seed=0), cfg


def batch(cfg, B=2, T=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=gen)
    doc_ids = torch.randint(0, 3, (B, T), generator=gen).sort(dim=1).values
    return tokens[:, :-1], tokens[:, 1:], doc_ids


def loss_and_grads(model, tokens, targets, doc_ids):
    loss = model(tokens, targets, doc_ids=doc_ids)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return loss.detach(), grads


def assert_trains_like_sdpa(variant: str, backend: str) -> None:
    """Same weights (same seed), same packed batch: loss and every gradient as SDPA's (fp32)."""
    ref_model, cfg = pair(variant, "sdpa")
    model, _ = pair(variant, backend)
    tokens, targets, doc_ids = batch(cfg)
    loss, grads = loss_and_grads(model, tokens, targets, doc_ids)
    ref_loss, ref_grads = loss_and_grads(ref_model, tokens, targets, doc_ids)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for (name, _), got, want in zip(model.named_parameters(), grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("variant", VARIANTS)
def test_triton_backend_trains_like_sdpa(variant):
    pytest.importorskip("triton")
    assert_trains_like_sdpa(variant, "triton")


@pytest.mark.parametrize("variant", MATMUL_VARIANTS)
def test_matmul_backend_trains_like_sdpa(variant):
    assert_trains_like_sdpa(variant, "matmul")


@pytest.mark.parametrize("form", ["causal", "window", "documents", "alibi"])
def test_matmul_kernel_gives_sdpa_outputs_and_the_max_logits(form):
    """The kernel alone, GQA (4 query heads on 2 kv heads): SDPA's output in fp32 and in bf16
    (to bf16's precision), and each head's max logit as SDPA's path records it (fp32 q.k scale,
    without ALiBi's bias), in both dtypes."""
    gen = torch.Generator().manual_seed(0)
    B, H, K, T, D = 2, 4, 2, 24, 16
    q, k, v = (torch.randn(B, n, T, D, generator=gen) for n in (H, K, K))
    doc_ids = torch.randint(0, 3, (B, T), generator=gen).sort(dim=1).values
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    mask, causal = {
        "causal": (None, True),
        "window": build_mask(T, 0, window=5),  # one (1, 1, T, S) mask: the shared-bias GEMM
        "documents": build_mask(T, 0, doc_ids=doc_ids),
        "alibi": build_mask(T, 0, alibi_slopes=slopes),
    }[form]
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        args = [t.to(dtype) for t in (q, k, v)]
        typed = mask.to(dtype) if form == "alibi" else mask
        ctx = AttentionContext(positions=None, rope=None, mask=typed, is_causal=causal, start=0)
        want, want_max = sdpa(*args, ctx, 0.25, want_max=True)
        got, got_max = matmul_attention(*args, ctx, 0.25, want_max=True)
        torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(got_max, want_max, rtol=0, atol=0)
        # independently: fp32 q.k scale over the visible keys (ALiBi's bias left out)
        qf, kf = args[0].float(), args[1].float().repeat_interleave(H // K, dim=1)
        visible = torch.ones(T, T, dtype=torch.bool).tril()
        if form in ("documents", "window"):
            visible = visible & mask
        exact = (qf @ kf.mT * 0.25).masked_fill(~visible, float("-inf")).amax(dim=(0, 2, 3))
        torch.testing.assert_close(got_max, exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 48])
def test_matmul_kernel_shared_mask_gemm_equals_the_masked_fill_path(head_dim):
    """A causal mask shared by all rows goes through one baddbmm (bias + scale q.k); a per-row
    bool mask with the same content through q.k, scale, masked_fill. bf16: bitwise equal outputs
    and gradients for scale 1/8 (a power of two, so scaling after rounding is exact); another
    scale rounds once instead of twice, so equal to bf16's precision."""
    gen = torch.Generator().manual_seed(1)
    B, H, K, T = 2, 4, 2, 32
    q, k, v = (torch.randn(B, n, T, head_dim, generator=gen).bfloat16() for n in (H, K, K))
    grad_out = torch.randn(B, H, T, head_dim, generator=gen).bfloat16()
    per_row = torch.ones(T, T, dtype=torch.bool).tril().expand(B, 1, T, T)
    results = []
    for mask, causal in ((None, True), (per_row, False)):
        args = [t.clone().requires_grad_() for t in (q, k, v)]
        ctx = AttentionContext(positions=None, rope=None, mask=mask, is_causal=causal, start=0)
        out, _ = matmul_attention(*args, ctx, head_dim**-0.5, want_max=False)
        out.backward(grad_out)
        results.append([out.detach()] + [a.grad for a in args])
    for shared, masked in zip(*results):
        if head_dim == 64:
            assert torch.equal(shared, masked)
        else:
            torch.testing.assert_close(shared.float(), masked.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_biased_scores_give_baddbmms_gradients_with_the_keys_in_their_own_layout(dtype):
    """BiasedScores against baddbmm under autograd (the default model's shapes: 2 kv heads of
    64, 2 query heads per group, 256 tokens): the same values and gradients, and dk contiguous
    like k. In bf16 the two GEMM orders sum the same products (bitwise equal on the README's CPU,
    as bench/loss_curves.py's bf16 cases show; here to one bf16 rounding, for other BLAS)."""
    gen = torch.Generator().manual_seed(2)
    N, M, S, D = 4, 512, 256, 64
    q, k = torch.randn(N, M, D, generator=gen), torch.randn(N, S, D, generator=gen)
    bias = torch.zeros(M, S).masked_fill(torch.rand(M, S, generator=gen) < 0.3, float("-inf"))
    grad = torch.randn(N, M, S, generator=gen).to(dtype)
    q, k, bias = q.to(dtype), k.to(dtype), bias.to(dtype)
    results = []
    for scores in (lambda a, b: BiasedScores.apply(bias, a, b, 0.125),
                   lambda a, b: torch.baddbmm(bias, a, b.mT, alpha=0.125)):  # fmt: skip
        a, b = q.clone().requires_grad_(), k.clone().requires_grad_()
        out = scores(a, b)
        results.append((out.detach(), *torch.autograd.grad(out, (a, b), grad)))  # (as computed)
    assert results[0][2].is_contiguous()
    tol = (
        {"rtol": 2**-8, "atol": 1e-5} if dtype == torch.bfloat16 else {"rtol": 1e-12, "atol": 1e-12}
    )
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, **tol)


def test_biased_scores_under_autocast_take_fp32_inputs():
    """fp32 q, k under bf16 autocast (an explicit backend=matmul on fp32 activations): the GEMM
    runs in bf16 and the backward casts q, k to match, as baddbmm's own would."""
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 8, 16, generator=gen), torch.randn(2, 6, 16, generator=gen)
    bias = torch.zeros(8, 6)
    grads = []
    for scores in (lambda a, b: BiasedScores.apply(bias, a, b, 0.25),
                   lambda a, b: torch.baddbmm(bias, a, b.mT, alpha=0.25)):  # fmt: skip
        a, b = q.clone().requires_grad_(), k.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = scores(a, b)
        out.float().sum().backward()
        grads.append((a.grad, b.grad))
    for got, want in zip(*grads):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-2)


def test_auto_takes_the_matmul_kernel_for_short_bf16_sequences_on_cpu(monkeypatch):
    import model.mixers.attention_backend as backends

    used = []
    for name in ("sdpa", "matmul"):
        original = backends.ATTENTION_BACKENDS.get(name)
        spy = lambda *a, _f=original, _n=name: used.append(_n) or _f(*a)  # noqa: E731
        monkeypatch.setitem(backends.ATTENTION_BACKENDS._entries, name, spy)
    model, cfg = pair("gqa + window", "auto", max_seq_len=2 * MATMUL_MAX_KEYS)
    for T, dtype, expected in [
        (MATMUL_MAX_KEYS, torch.bfloat16, "matmul"),
        (MATMUL_MAX_KEYS + 1, torch.bfloat16, "sdpa"),  # longer: SDPA's flash kernel is faster
        (40, torch.float32, "sdpa"),  # fp32 trains through SDPA
    ]:
        used.clear()
        tokens, _, doc_ids = batch(cfg, T=T)
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=dtype != torch.float32):
            model(tokens, doc_ids=doc_ids)
        assert set(used) == {expected}, (T, dtype, used)


def test_flex_backend_evaluates_like_sdpa_and_refuses_to_train_on_cpu():
    ref_model, cfg = pair("gqa + window", "sdpa")
    model, _ = pair("gqa + window", "flex")
    tokens, targets, doc_ids = batch(cfg)
    with torch.no_grad():
        got = model(tokens, doc_ids=doc_ids)
        want = ref_model(tokens, doc_ids=doc_ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="FlexAttention has no backward on CPU"):
        model(tokens, targets, doc_ids=doc_ids)


@pytest.mark.parametrize(
    ("backend", "built", "absent"),
    [
        ("sdpa", "mask", "first_key"),
        ("matmul", "mask", "first_key"),
        ("triton", "first_key", "mask"),
        ("flex", "block_mask", "mask"),
    ],
)
def test_a_forward_builds_only_the_mask_form_its_layers_read(backend, built, absent):
    """The dense (B, 1, T, T) mask costs B T^2 bytes: kernels that take documents and windows in
    another form never build it."""
    model, cfg = pair("gqa + window", backend)
    tokens, _, doc_ids = batch(cfg)
    with torch.no_grad():
        _, ctx = model._trunk(tokens, doc_ids, None)
    assert getattr(ctx, built) is not None
    assert getattr(ctx, absent) is None


@pytest.mark.parametrize("variant", ["gqa + window", "mla"])
def test_cached_generation_with_the_triton_backend_equals_full_forwards(variant):
    """The prompt is prefilled through the kernel; tokens after it attend through SDPA over the
    cache (the kernels train; decoding reads the cache)."""
    pytest.importorskip("triton")
    model, cfg = pair(variant, "triton")
    prompt = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    out = generate(model.eval(), prompt, 6, temperature=0)
    with torch.no_grad():
        full = model(out[:, :-1]).argmax(-1)[:, prompt.shape[1] - 1 :]
    assert torch.equal(out[:, prompt.shape[1] :], full)


def test_compiled_model_with_the_triton_kernel_matches_eager():
    """The kernel is a custom op: torch.compile keeps it whole (no graph break into Triton)."""
    pytest.importorskip("triton")
    model, cfg = pair("gqa + window", "triton", n_layers=1)
    tokens, targets, doc_ids = batch(cfg, T=24)
    loss, grads = loss_and_grads(model, tokens, targets, doc_ids)
    compiled = torch.compile(model, fullgraph=True)
    c_loss, c_grads = loss_and_grads(compiled, tokens, targets, doc_ids)
    torch.testing.assert_close(c_loss, loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(c_grads, grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_triton_backend_without_cuda_or_the_interpreter_says_so(monkeypatch):
    model, cfg = pair("gqa + window", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    tokens, targets, _ = batch(cfg)
    with pytest.raises(RuntimeError, match="backend=triton runs on CUDA"):
        model(tokens, targets)


def test_auto_picks_triton_only_on_cuda_while_qk_clip_records(monkeypatch):
    import model.mixers.attention_backend as backends

    monkeypatch.setattr(backends, "triton_installed", lambda: True)
    monkeypatch.setattr(backends, "_bf16_tensor_cores", lambda index: True)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert resolve_backend("auto", cuda, 0, recording=True) == "triton"
    assert resolve_backend("auto", cuda, 0, recording=False) == "sdpa"
    assert resolve_backend("auto", cpu, 0, recording=True) == "sdpa"
    assert resolve_backend("auto", cuda, 5, recording=True) == "sdpa"  # decoding after a cache
    assert resolve_backend("triton", cuda, 5, recording=True) == "sdpa"
    assert resolve_backend("flex", cpu, 0, recording=False) == "flex"
    assert resolve_backend("auto", cuda, 0, recording=True, fits=False) == "sdpa"
    monkeypatch.setattr(backends, "_bf16_tensor_cores", lambda index: False)  # before sm_80
    assert resolve_backend("auto", cuda, 0, recording=True) == "sdpa"
    monkeypatch.setattr(backends, "_bf16_tensor_cores", lambda index: True)
    monkeypatch.setattr(backends, "triton_installed", lambda: False)
    assert resolve_backend("auto", cuda, 0, recording=True) == "sdpa"


def test_context_parallel_layers_take_the_kernel_wherever_it_runs(monkeypatch):
    """Split over cp ranks, `auto` attends through the Triton kernel on a GPU that runs it, QK-clip
    or not (SDPA's (T / cp, T) mask would grow fastest with the context); elsewhere SDPA."""
    import model.mixers.attention_backend as backends
    from model.mixers.attention_backend import context_parallel_kernel

    monkeypatch.setattr(backends, "triton_installed", lambda: True)
    monkeypatch.setattr(backends, "_bf16_tensor_cores", lambda index: True)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert context_parallel_kernel("auto", cuda)
    assert not context_parallel_kernel("auto", cuda, fits=False)
    assert not context_parallel_kernel("auto", cpu)
    assert context_parallel_kernel("triton", cpu) and not context_parallel_kernel("sdpa", cuda)
    monkeypatch.setattr(backends, "triton_installed", lambda: False)
    assert not context_parallel_kernel("auto", cuda)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, {"triton"}),
        ({"position": "alibi"}, {"sdpa"}),  # the kernel adds no bias
        ({"attention.head_dim": 320}, {"sdpa"}),  # beyond the kernel's 256
    ],
)
def test_auto_keeps_sdpa_for_layers_the_kernel_cannot_compute(monkeypatch, overrides, expected):
    """Under QK-clip on CUDA, auto would pick the kernel: not for ALiBi or head dims over 256,
    which `triton` itself refuses at config time (asked for by name)."""
    import model.mixers.attention_backend as backends
    from optim.qk_clip import enable_qk_clip

    monkeypatch.setattr(backends, "triton_installed", lambda: True)
    monkeypatch.setattr(backends, "_bf16_tensor_cores", lambda index: True)
    model = build_model(load_preset("tiny", SMALL | overrides), device="meta")
    enable_qk_clip(model)
    assert model.attention_backends(torch.device("cuda", 0), 0) == expected


@pytest.mark.parametrize(
    ("preset", "overrides", "message"),
    [
        ("tiny", {"attention.backend": "cudnn"}, "model.attention.backend='cudnn'; choose one of"),
        ("tiny", {"attention.backend": "triton", "position": "alibi"}, "ALiBi"),
        ("tiny", {"attention.backend": "flex", "position": "alibi"}, "ALiBi"),
        ("tiny", {"attention.backend": "triton", "attention.head_dim": 320}, "up to 256"),
    ],
)
def test_bad_backend_settings_fail_with_their_keys(preset, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_preset(preset, SMALL | overrides)


@pytest.mark.parametrize(
    ("backend", "kernels", "interpreted", "message"),
    [
        ("flex", {}, "1", "backend=flex trains on CUDA only"),
        ("triton", {}, "0", "backend=triton runs on CUDA, not cpu"),
        ("auto", {"rms_norm": "triton"}, "0", "model.kernels.rms_norm=triton runs on CUDA"),
    ],
)
def test_kernels_the_training_device_cannot_run_are_refused_at_start(
    monkeypatch, backend, kernels, interpreted, message
):
    """One line naming the key before anything is built, not a traceback from the first forward."""
    from model.config import KernelsConfig
    from model.mixers.attention_backend import check_training_device

    monkeypatch.setenv("TRITON_INTERPRET", interpreted)
    with pytest.raises(ConfigError, match=message):
        check_training_device(backend, KernelsConfig(**kernels), "cpu")
    check_training_device(backend, KernelsConfig(**kernels), "cuda")  # what they are for
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the tests' interpreter runs the Triton ones
    if backend != "flex":
        check_training_device(backend, KernelsConfig(**kernels), "cpu")
