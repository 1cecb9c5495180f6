"""CUDA checks (tier `gpu`, skipped without CUDA): the same model on GPU in bf16 and on CPU in fp32."""

from __future__ import annotations

import pytest
import torch

from model import build_model, generate
from model.presets import load_preset

pytestmark = pytest.mark.gpu


# the 2026 layers: MoE (grouped GEMMs, the CUDA combine), Gated DeltaNet / KDA (fla's kernels where
# they are correct, else the torch form), Attention Residuals, mHC, Engram
PRESETS_2026 = ["tiny_moe", "tiny_hybrid", "tiny_kda", "tiny_attnres", "tiny_mhc", "tiny_engram"]


@pytest.mark.parametrize("preset", ["tiny", "tiny_mla", *PRESETS_2026])
def test_bf16_cuda_loss_matches_fp32_cpu(preset):
    torch.manual_seed(0)
    cpu = build_model(load_preset(preset))
    gpu = build_model(load_preset(preset), device="cuda")
    gpu.load_state_dict(cpu.state_dict())
    tokens, targets = torch.randint(0, cpu.cfg.vocab_size, (2, 4, 128))
    reference = cpu(tokens, targets)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = gpu(tokens.cuda(), targets.cuda())
    loss.backward()
    assert (
        abs(loss.item() - reference.item()) < 2e-2
    )  # bf16 matmuls: ~1e-3 relative on a loss of ~9
    grads = [p.grad for p in gpu.parameters()]
    assert all(g is not None for g in grads)
    # Engram's tables get sparse gradients (the rows read)
    assert all(torch.isfinite(g.coalesce().values() if g.is_sparse else g).all() for g in grads)


@pytest.mark.parametrize("preset", ["tiny", "tiny_mla"])
def test_cached_generation_on_cuda_matches_a_full_recompute(preset):
    torch.manual_seed(0)
    model = build_model(load_preset(preset), device="cuda").eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (2, 8), device="cuda")
    out = generate(model, prompt, 8, temperature=0)
    with torch.no_grad():
        full = model(out[:, :-1]).argmax(-1)[:, prompt.shape[1] - 1 :]
    assert torch.equal(out[:, prompt.shape[1] :], full)


@pytest.mark.parametrize("preset", PRESETS_2026)
def test_prefill_and_decode_on_cuda_match_the_full_forward(preset):
    """fp32 on CUDA: logits of a 12-token prefill then 6 single-token steps (recurrent states,
    KV caches, Engram's n-grams across the boundary) against one full forward. fla's kernels
    (where installed) compute fp32 dots in TF32, hence 2% of the logits' scale, not 1e-5; a wrong
    state is off by the logits' whole scale."""
    torch.manual_seed(0)
    model = build_model(load_preset(preset), device="cuda", seed=0).eval()
    gen = torch.Generator("cuda").manual_seed(1)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 18), device="cuda", generator=gen)
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(2, 18, dtype=torch.float32)
        steps = [model(tokens[:, :12], cache=cache)]
        steps += [model(tokens[:, t : t + 1], cache=cache) for t in range(12, 18)]
    scale = full.abs().max().item()
    assert (torch.cat(steps, 1) - full).abs().max().item() <= 2e-2 * scale


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])  # dropless; with dropped slots
def test_moe_layer_gradients_on_cuda_match_fp32_cpu(capacity_factor):
    """The CUDA route (grouped GEMMs in bf16, the gather combine whose backward gathers by the
    sorted order) against the same layer in fp32 on CPU: the router runs in fp32 on both, so the
    same experts are chosen; outputs and every gradient within 3% of their scale (bf16 GEMMs)."""
    from model.init import block_init_stds
    from model.moe.layer import MoE

    cfg = load_preset("tiny_moe", {"moe.capacity_factor": capacity_factor})
    torch.manual_seed(0)
    cpu = MoE(cfg, 1)
    cpu.init_weights(block_init_stds(cfg.init, cfg.n_layers, 1))
    gpu = MoE(cfg, 1).cuda()
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randn(2, 64, cfg.d_model, generator=torch.Generator().manual_seed(1))
    cot = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    results = []
    for layer, device in ((cpu, "cpu"), (gpu, "cuda")):
        xi = x.to(device).requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            out = layer(xi)
        (out.float() * cot.to(device)).sum().backward()
        grads = [p.grad for p in layer.parameters()]
        results.append([t.detach().float().cpu() for t in (out, xi.grad, *grads)])
    assert capacity_factor == 0 or gpu.dropped_tokens.item() > 0
    for got, want in zip(results[1], results[0], strict=True):
        assert (got - want).abs().max() <= 3e-2 * want.abs().max()


def _attention_inputs(B=2, Hq=8, Hkv=4, T=1024, D=128, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((B, Hq, T, D), (B, Hkv, T, D), (B, Hkv, T, D))
    return [torch.randn(s, device="cuda", generator=gen, dtype=torch.bfloat16) for s in shapes]


@pytest.mark.parametrize("documents", [False, True])
def test_triton_attention_on_cuda_matches_fp32_sdpa_and_its_max_logits(documents):
    """bf16 on tensor cores: outputs and gradients within 2% of an fp32 SDPA on the same inputs
    (SDPA's own bf16 kernels are within about 1%), max logits equal to the fp32 recomputation."""
    pytest.importorskip("triton")
    import torch.nn.functional as F

    from model.kernels.flash_attention import flash_attention, key_bounds
    from model.mixers.masks import build_mask, document_starts
    from model.mixers.qk_logits import max_logits_per_head

    q, k, v = _attention_inputs()
    T = q.shape[2]
    mask, first_key = None, None
    if documents:
        doc_ids = (torch.arange(T, device="cuda") >= T // 3).long().expand(2, T).contiguous()
        doc_ids[1, T // 2 :] += 1
        mask, _ = build_mask(T, 0, window=T // 4, doc_ids=doc_ids, device="cuda")
        first_key = key_bounds(document_starts(doc_ids), T // 4, T, torch.device("cuda"))
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out, max_logits = flash_attention(*leaves, first_key=first_key, return_max_logits=True)
    ref_leaves = [
        x.detach().float().repeat_interleave(2 if i else 1, 1).requires_grad_()
        for i, x in enumerate((q, k, v))
    ]
    ref = F.scaled_dot_product_attention(*ref_leaves, attn_mask=mask, is_causal=mask is None)
    cot = torch.randn_like(ref)
    grads = torch.autograd.grad(out, leaves, cot.bfloat16())
    ref_grads = torch.autograd.grad(ref, ref_leaves, cot)
    ref_grads = [ref_grads[0]] + [g.view(2, 4, 2, T, 128).sum(2) for g in ref_grads[1:]]
    for got, want in zip((out, *grads), (ref, *ref_grads), strict=True):
        assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max()
    recomputed = max_logits_per_head(q, k, 128**-0.5, mask, mask is None, 0)
    torch.testing.assert_close(max_logits, recomputed, rtol=1e-4, atol=1e-4)


def test_fused_kernels_on_cuda_match_the_torch_ops():
    pytest.importorskip("triton")
    import torch.nn.functional as F

    from model.kernels.fused import rms_norm, rope, swiglu
    from model.mixers.rope import apply_rope_interleaved, base_inv_freq, rope_rotations

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 2048, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.rand(2048, device="cuda", generator=gen) + 0.5
    want = (F.rms_norm(x.float(), (2048,), eps=1e-5) * w).bfloat16()
    torch.testing.assert_close(rms_norm(x, w, 1e-5), want, rtol=2e-2, atol=2e-2)
    q = torch.randn(2, 512, 16, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    rot = rope_rotations(
        torch.arange(512, device="cuda").expand(2, -1), base_inv_freq(1e4, 128).cuda(), 1.0
    )
    torch.testing.assert_close(
        rope(q, rot, True), apply_rope_interleaved(q, rot), rtol=2e-2, atol=2e-2
    )
    g, u = x[:, :1024], x[:, 1024:]
    torch.testing.assert_close(
        swiglu(g.contiguous(), u.contiguous()), F.silu(g) * u, rtol=2e-2, atol=2e-2
    )


def test_the_auto_backend_trains_on_the_kernel_under_qk_clip_like_sdpa():
    pytest.importorskip("triton")
    from optim.qk_clip import enable_qk_clip, pop_max_logits

    losses, logits, used = [], [], []
    for backend in ("auto", "sdpa"):
        torch.manual_seed(0)
        model = build_model(
            load_preset("tiny", {"attention.backend": backend}), device="cuda", seed=0
        )
        enable_qk_clip(model)
        used.append(model.layers["0"].attn.attention_backend(torch.device("cuda"), 0))
        tokens = torch.randint(
            0,
            model.cfg.vocab_size,
            (2, 257),
            device="cuda",
            generator=torch.Generator("cuda").manual_seed(1),
        )
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses.append(loss.item())
        logits.append(pop_max_logits(model))
    assert used == ["triton", "sdpa"]
    assert abs(losses[0] - losses[1]) < 2e-2
    torch.testing.assert_close(logits[0], logits[1], rtol=2e-2, atol=2e-2)
