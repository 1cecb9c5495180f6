"""Hugging Face model directories: `config.json` plus safetensors weights (one `model.safetensors`,
or shards with a `model.safetensors.index.json`), written atomically."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

MAX_SHARD_BYTES = 5 * 2**30
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def write_hf_dir(
    state: dict[str, Tensor],
    config: Callable[[torch.dtype], dict[str, Any]],
    out_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    overwrite: bool = False,
    keep_fp32: tuple[str, ...] = (),
) -> Path:
    """Write config(dtype) + `state` (HF names) to `out_dir` atomically (a temporary sibling,
    then rename). Tensors whose names end with one of `keep_fp32` stay fp32 (a router's
    selection bias rounded to bf16 would change which experts win near ties)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} exists; pass overwrite=True or choose another directory")
    dtype = dtype or next(iter(state.values())).dtype
    state = {
        k: v.detach().to("cpu", torch.float32 if k.endswith(keep_fp32) else dtype).contiguous()
        for k, v in state.items()
    }
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config(dtype), indent=2) + "\n")
        _write_shards(state, tmp, max_shard_bytes)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _write_shards(state: dict[str, Tensor], directory: Path, max_shard_bytes: int) -> None:
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], directory / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / filename, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, filename))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def read_hf_state_dict(path: str | os.PathLike) -> dict[str, Tensor]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(
            f"{path} has neither model.safetensors nor model.safetensors.index.json"
        )
    state: dict[str, Tensor] = {}
    for filename in files:
        state.update(load_file(path / filename))
    return state
