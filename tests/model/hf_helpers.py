"""What the Hugging Face family tests share: a model moved off its initial values, transformers'
own model read from a directory, token batches."""

from __future__ import annotations

import torch

from model.config import ModelConfig
from model.transformer import build_model


def perturbed(cfg: ModelConfig, seed: int = 0):
    """A model whose norm gains are off 1 and, where routing is sigmoid (the families that keep a
    score-correction bias), whose balancing biases are trained-looking."""
    model = build_model(cfg, seed=seed).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias") and cfg.moe.score_func == "sigmoid":
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model


def transformers_model(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    ).eval()


def token_batch(vocab: int, seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(seed))


class Unreadable:
    """An expert's matrix that must not be read (its shape and dtype may be): a stand-in in an
    ExpertStack for the experts outside a cut."""

    def __init__(self, like: torch.Tensor) -> None:
        self.shape, self.dtype = like.shape, like.dtype

    @property
    def T(self):
        raise AssertionError("an expert outside the cut was read")
