"""Global gradient-norm clipping (parallel/grad_norm.py) in one process, against torch's."""

from __future__ import annotations

import torch

from parallel.grad_norm import clip_grad_norm


def gradients(scale: float) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """Two identical parameter lists whose gradients have a global norm of about 5 * scale."""
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (5,), (3, 4, 2)]
    grads = [torch.randn(s, generator=g) * scale for s in shapes]
    pairs = []
    for _ in range(2):
        params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        for p, grad in zip(params, grads):
            p.grad = grad.clone()
        pairs.append(params)
    return pairs[0], pairs[1]


def test_clipping_above_the_limit_scales_like_torch():
    ours, theirs = gradients(1.0)
    norm = clip_grad_norm(ours, 1.0)
    want = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert norm > 1.0
    torch.testing.assert_close(norm, want, rtol=1e-6, atol=0)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)


def test_gradients_within_the_limit_are_not_touched():
    """Below max_norm the scale is 1: the gradients keep their values and are not even
    rewritten (their version counters stay), which saves a pass over every gradient."""
    ours, _ = gradients(0.01)
    before = [(p.grad.clone(), p.grad._version) for p in ours]
    norm = clip_grad_norm(ours, 1.0)
    assert norm < 1.0
    for p, (values, version) in zip(ours, before):
        assert torch.equal(p.grad, values) and p.grad._version == version
    measured = clip_grad_norm(ours, float("inf"))  # only measures
    assert torch.equal(measured, norm)
