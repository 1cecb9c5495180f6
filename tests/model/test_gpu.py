"""CUDA checks (tier `gpu`, skipped without CUDA): the same model on GPU in bf16 and on CPU in fp32."""

from __future__ import annotations

import pytest
import torch

from model import build_model, generate
from model.presets import load_preset

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("preset", ["tiny", "tiny_mla"])
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
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in gpu.parameters())


@pytest.mark.parametrize("preset", ["tiny", "tiny_mla"])
def test_cached_generation_on_cuda_matches_a_full_recompute(preset):
    torch.manual_seed(0)
    model = build_model(load_preset(preset), device="cuda").eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (2, 8), device="cuda")
    out = generate(model, prompt, 8, temperature=0)
    with torch.no_grad():
        full = model(out[:, :-1]).argmax(-1)[:, prompt.shape[1] - 1 :]
    assert torch.equal(out[:, prompt.shape[1] :], full)
