"""Safetensors files written tensor by tensor, so a process never holds a whole file.

The safetensors library writes a file from a dict of tensors held in memory. A file is an
8-byte little-endian header length, a JSON header (each tensor's dtype, shape and byte range,
padded with spaces to a multiple of 8) and then the tensors' bytes in that order
(https://github.com/huggingface/safetensors#format). When every tensor's name, dtype and shape
are known in advance (`TensorSpec`s: model/hf derives them by converting a meta-device model),
the headers can be written first and each tensor's bytes put in place as it arrives: memory is
one tensor, whatever the file size. The files are read by the safetensors library (tested).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

INDEX = "model.safetensors.index.json"
DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.element_size

    @classmethod
    def of(cls, name: str, tensor: Tensor) -> TensorSpec:
        return cls(name, tensor.dtype, tuple(tensor.shape))


def plan_files(specs: list[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    """Tensors in order into files of at most `max_bytes` (a larger tensor alone in its file);
    in each file the wider dtypes first, as the library lays them out, so every tensor starts
    aligned to its element size."""
    files: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if files[-1] and size + spec.nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(spec)
        size += spec.nbytes
    return [sorted(file, key=lambda spec: -spec.element_size) for file in files]


def file_names(count: int) -> list[str]:
    """transformers' names: model.safetensors alone, else model-0000i-of-0000N.safetensors."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


class StreamedFiles:
    """The planned files in `directory`, each tensor written at its planned place as it
    arrives (in any order: a file is created with its header when its first tensor comes);
    `close()` checks that every planned tensor came and writes the index (several files)."""

    def __init__(self, directory: Path, specs: list[TensorSpec], max_bytes: int) -> None:
        self.directory = directory
        self.files = plan_files(specs, max_bytes)
        self.names = file_names(len(self.files))
        self.headers = [_header(file) for file in self.files]
        self.place: dict[str, tuple[int, int, TensorSpec]] = {}  # name -> (file, offset, spec)
        for index, (file, header) in enumerate(zip(self.files, self.headers, strict=True)):
            offset = len(header)
            for spec in file:
                self.place[spec.name] = (index, offset, spec)
                offset += spec.nbytes
        self.written: set[str] = set()

    def add(self, name: str, tensor: Tensor) -> None:
        if name not in self.place or name in self.written:
            raise ValueError(f"{name}: not planned, or written twice")
        index, offset, spec = self.place[name]
        if TensorSpec.of(name, tensor) != spec:
            raise ValueError(f"expected {spec}, got {TensorSpec.of(name, tensor)}")
        path = self.directory / self.names[index]
        new = not path.exists()
        with open(path, "wb" if new else "r+b") as f:
            if new:
                f.write(self.headers[index])
            f.seek(offset)
            data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            f.write(memoryview(data.numpy()))
        self.written.add(name)

    def close(self) -> None:
        missing = [name for name in self.place if name not in self.written]
        if missing:
            raise ValueError(f"planned tensors never came: {', '.join(missing[:5])}")
        for name, header in zip(self.names, self.headers, strict=True):
            if not (self.directory / name).exists():  # a file of no tensor (an empty model)
                (self.directory / name).write_bytes(header)
        if len(self.files) > 1:
            weight_map = {s.name: n for n, f in zip(self.names, self.files, strict=True) for s in f}
            total = sum(spec.nbytes for file in self.files for spec in file)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (self.directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _header(specs: list[TensorSpec]) -> bytes:
    """The length prefix and JSON header of a file holding `specs` in order."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        if spec.dtype not in DTYPES:
            raise ValueError(f"{spec.name}: safetensors has no dtype for {spec.dtype}")
        header[spec.name] = {
            "dtype": DTYPES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text
