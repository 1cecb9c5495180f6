"""Whether a Hugging Face directory's weights fit the model its config.json describes, checked
from the safetensors headers alone (each tensor's shape and dtype; no tensor is read).

The check runs the import itself (`from_hf_parts`) over meta-device tensors of the headers'
shapes, so every part converts as the load will convert it, and compares what comes out with
the model's parameters: a config.json whose head count or sizes are not the weights' is refused
naming the file, the tensor and both shapes before any engine is built, instead of failing
inside one (where each rank fails on its own).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from model.config import ConfigError, ModelConfig
from model.hf import HFWeights, from_hf_parts
from model.hf.family import HFFamily
from model.hf.files import _open
from model.hf.safetensors_stream import DTYPES, INDEX
from model.transformer import build_model

Header = tuple[tuple[int, ...], torch.dtype]


def tensor_headers(weights: HFWeights) -> dict[str, Header]:
    """Each tensor's shape and dtype from its file's header. A missing or damaged file (a
    truncated one: its header promises more bytes than it has), or one without a tensor its
    index puts there, is a ValueError naming it."""
    by_file: dict[str, list[str]] = {}
    for name, filename in weights.file_of.items():
        by_file.setdefault(filename, []).append(name)
    dtypes = {name: dtype for dtype, name in DTYPES.items()}
    out = {}
    for filename, names in by_file.items():
        with _open(weights.path / filename) as handle:
            if missing := sorted(set(names) - set(handle.keys())):
                raise ValueError(
                    f"{weights.path / filename} has no tensor {missing[0]}, which {INDEX} puts "
                    "there"
                )
            for name in names:
                piece = handle.get_slice(name)
                out[name] = (tuple(piece.get_shape()), dtypes.get(piece.get_dtype(), torch.uint8))
    return out


class _MetaWeights:
    """`HFWeights` whose tensors are empty meta-device ones of the headers' shapes; it remembers
    the files of the part opened last (for the messages)."""

    def __init__(self, weights: HFWeights) -> None:
        self.weights, self.headers = weights, tensor_headers(weights)
        self.files = ""

    def names(self) -> list[str]:
        return self.weights.names()

    @contextmanager
    def opened(self, names: Iterable[str]) -> Iterator[dict[str, Tensor]]:
        names = list(names)
        files = {str(self.weights.path / self.weights.file_of[n]) for n in names}
        self.files = ", ".join(sorted(files))
        yield {n: torch.empty(self.headers[n][0], dtype=self.headers[n][1], device="meta")
               for n in names}  # fmt: skip


def check_hf_weights(weights: HFWeights, cfg: ModelConfig, family: HFFamily) -> None:
    """A ConfigError naming the file, the tensor and both shapes where the weights do not fit
    the model `cfg` builds (or naming what is missing); a ValueError naming a damaged file."""
    model = build_model(cfg, device="meta")
    persistent = model.state_dict().keys()
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    expected |= {n: tuple(b.shape) for n, b in model.named_buffers() if n in persistent}
    meta, come = _MetaWeights(weights), set()
    parts = from_hf_parts(meta, cfg, family)  # type: ignore[arg-type]  (the same interface)
    while True:
        try:
            part = next(parts)
        except StopIteration:
            break
        except (RuntimeError, IndexError) as err:  # a reshape or split of a size that is not
            raise ConfigError(
                f"{meta.files}: the tensors do not fit the model config.json describes ({err})"
            ) from None
        for name, ours in expected.items():  # in the model's order: q_proj before o_proj
            theirs = tuple(part[name].shape) if name in part else ours
            if ours != theirs:
                raise ConfigError(
                    f"{meta.files}: the weights hold {theirs} for {name}, the model config.json "
                    f"describes {ours}: its sizes (hidden_size, num_attention_heads, "
                    "num_key_value_heads, head_dim, ...) are not the weights'"
                )
        come |= part.keys()
    if missing := sorted(expected.keys() - come):
        raise ConfigError(
            f"{weights.path}: the weights lack {', '.join(missing[:3])} of the model "
            "config.json describes"
        )
