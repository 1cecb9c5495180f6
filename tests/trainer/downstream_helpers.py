"""Helpers of the downstream-evaluation tests: task text tokenized with cl100k_base (offline) and
folded into a small model's vocabulary, a small model, and the obvious scoring."""

from __future__ import annotations

import torch

from data.tokenizer import load_tokenizer
from model.presets import load_preset
from model.transformer import Transformer, build_model

VOCAB = 512
CONTEXT = 256  # the tasks' model_ctx_len (the library pads its batches to multiples of 128)


class FoldedTokenizer:
    """cl100k_base's ids modulo VOCAB (the last id is end-of-text): real task texts, token ids a
    tiny model accepts. What scoring needs of data.tokenizer.Tokenizer."""

    vocab_size = VOCAB
    eot_id = VOCAB - 1

    def __init__(self) -> None:
        self.inner = load_tokenizer("cl100k_base")

    def encode_ordinary(self, text: str) -> list[int]:
        return [t % (VOCAB - 1) for t in self.inner.encode_ordinary(text)]

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


def small_model(preset: str = "tiny", **overrides) -> Transformer:
    cfg = load_preset(
        preset,
        {
            "vocab_size": VOCAB,
            "d_model": 64,
            "n_layers": 2,
            "max_seq_len": 2 * CONTEXT,
            **overrides,
        },
    )
    return build_model(cfg, seed=0).eval()


def per_token(model: Transformer):
    """The bare model as scoring's LogProbs."""
    return lambda inputs, targets, doc_ids: model(inputs, targets, doc_ids=doc_ids, per_token=True)


@torch.no_grad()
def obvious_sums(model: Transformer, requests) -> torch.Tensor:
    """Each request alone, unpadded: log_softmax of the full logits in fp64, summed over the
    continuation's positions."""
    sums = []
    for r in requests:
        logits = model(torch.tensor([r.tokens]))[0].double()
        positions = torch.arange(r.start, r.start + len(r.continuation))
        picked = torch.log_softmax(logits[positions], -1)[
            torch.arange(len(positions)), torch.tensor(r.continuation)
        ]
        sums.append(picked.sum())
    return torch.stack(sums)
