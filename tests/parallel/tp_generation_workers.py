"""Rank functions of the tensor-parallel generation tests (imported by the forked gloo ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from model.generate import generate
from model.presets import load_preset
from model.transformer import build_model

VOCAB, PROMPT, NEW_TOKENS = 128, (2, 5), 8


def prompt(seed: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, PROMPT, generator=g)


def tp_greedy(rank: int, preset: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """Greedy generation (prefill, then one token per step with the per-layer generation
    state) of a seeded fp32 model split over every rank as one tp group (or whole, without a
    process group): the tokens, the logits of the prefill and of every decode step, and the
    shapes of the generation state's buffers."""
    from parallel.tensor_parallel import split_over_tp, tp_mesh_of

    cfg = load_preset(preset, {"vocab_size": VOCAB, "max_seq_len": 64} | overrides)
    model = build_model(cfg, seed=0)
    if dist.is_initialized():
        world = dist.get_world_size()
        split_over_tp(model, tp_mesh_of(world, world, "cpu"), False)
    steps: list[torch.Tensor] = []
    last_logits = model.last_logits

    def recorded(tokens: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        steps.append(last_logits(tokens, **kwargs))
        return steps[-1]

    caches = []
    new_cache = model.new_cache

    def kept(*args: Any, **kwargs: Any) -> Any:
        caches.append(new_cache(*args, **kwargs))
        return caches[-1]

    model.last_logits, model.new_cache = recorded, kept  # (instance attributes: generate's calls)
    tokens = generate(model, prompt(), NEW_TOKENS, temperature=0)
    shapes = {name: tuple(b.shape) for name, b in caches[0].named_buffers()}
    return {"tokens": tokens, "logits": torch.stack(steps), "state_shapes": shapes}


class DigitTokenizer:
    """What the trainer's sampling (trainer/evaluate.py sample_text) reads of a tokenizer: one
    token per character, the last id ends a document, ids decode to their numbers."""

    vocab_size, eot_id = VOCAB, VOCAB - 1

    def encode_ordinary(self, text: str) -> list[int]:
        return [ord(c) % (VOCAB - 1) for c in text]

    def decode(self, ids: list[int]) -> str:
        return " " + " ".join(map(str, ids))


def tp_engine_sample(rank: int, preset: str, overrides: dict[str, Any], tp: int) -> dict[str, Any]:
    """The trainer's sample (temperature 0.8, top-50, seeded) from the FSDP2 engine as the
    trainer builds it: one process, or tensor parallelism over `tp` ranks under FSDP2 over the
    data ranks (world / tp), whose `full_weights` unshards the weights for generation."""
    from parallel.compose import build_fsdp2
    from parallel.config import ParallelConfig
    from parallel.engine import EngineRequest
    from parallel.mesh import ParallelDims
    from trainer.evaluate import sample_text

    world = dist.get_world_size() if dist.is_initialized() else 1
    cfg = load_preset(preset, {"vocab_size": VOCAB, "max_seq_len": 64} | overrides)
    parallel = ParallelConfig(tp=tp)
    engine = build_fsdp2(
        EngineRequest(
            model_cfg=cfg,
            parallel=parallel,
            precision="fp32",
            compile=False,
            dims=ParallelDims.resolve(parallel, world),
            device=torch.device("cpu"),
            seed=0,
            make_optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=0.1),
        )
    )
    text = sample_text(engine, DigitTokenizer(), "Once upon", NEW_TOKENS, torch.device("cpu"), 11)
    split = any(isinstance(p, DTensor) for p in engine.model.parameters())
    return {"text": text, "sharded": engine.sharded, "split": split}
