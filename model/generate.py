"""Autoregressive sampling with a KV cache: one prefill pass over the prompt, then one token per step.

Shapes: prompt (B, T0) -> (B, T0 + N) with N <= max_new_tokens generated tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.transformer import Transformer


class NonFiniteOutput(ValueError):
    """The model's next-token probabilities hold NaN or inf (its weights or activations
    overflowed): there is nothing to sample from."""


def sample_next(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
) -> Tensor:
    """(B, V) logits -> (B,) token ids: greedy when temperature == 0, else softmax(logits / t) over the top k."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if not bool(torch.isfinite(probs).all()):  # multinomial would fail (a device assert on GPUs)
        raise NonFiniteOutput("the model's next-token probabilities are not finite")
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Continue each prompt row; rows that emit `eos_id` keep emitting it, and the loop stops when all have."""
    if max_new_tokens <= 0:
        return prompt
    B, T0 = prompt.shape
    cache = model.new_cache(B, T0 + max_new_tokens)
    logits = model.last_logits(prompt, cache=cache)  # prefill
    out, done = [prompt], torch.zeros(B, dtype=torch.bool, device=prompt.device)
    for step in range(max_new_tokens):
        token = sample_next(logits, temperature, top_k, generator)
        if eos_id is not None:
            token = torch.where(done, torch.full_like(token, eos_id), token)
            done |= token == eos_id
        out.append(token[:, None])
        if step + 1 == max_new_tokens or (eos_id is not None and bool(done.all())):
            break
        logits = model.last_logits(token[:, None], cache=cache)  # decode
    return torch.cat(out, dim=1)
