"""Safetensors files written tensor by tensor (model/hf/safetensors_stream.py): the safetensors
library reads them back exactly, in any arrival order, split into size-limited files with an
index; what was not planned, or never comes, is refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from model.hf.safetensors_stream import INDEX, StreamedFiles, TensorSpec

TENSORS = {
    "a.weight": torch.randn(7, 5),
    "b.bias": torch.randn(3).to(torch.bfloat16),
    "c.scalar": torch.tensor(2.5),
    "d.ids": torch.arange(11),
    "e.empty": torch.zeros(0, 4),
    "f.mask": torch.tensor([True, False, True]),
}


def _specs():
    return [TensorSpec.of(name, t) for name, t in TENSORS.items()]


@pytest.mark.parametrize("max_bytes", [10**9, 64])
@pytest.mark.parametrize("order", ["planned", "reversed"])
def test_streamed_files_read_back_exactly(tmp_path, max_bytes, order):
    writer = StreamedFiles(tmp_path, _specs(), max_bytes)
    names = list(TENSORS) if order == "planned" else list(reversed(TENSORS))
    for name in names:
        writer.add(name, TENSORS[name])
    writer.close()
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    read = {}
    for name in files:
        read |= load_file(tmp_path / name)
        with safe_open(tmp_path / name, "pt") as f:
            assert f.metadata() == {"format": "pt"}
    assert read.keys() == TENSORS.keys()
    for name, tensor in TENSORS.items():
        assert read[name].dtype == tensor.dtype and torch.equal(read[name], tensor), name
    if max_bytes == 64:  # 140, 6 + 4, 88, 0 + 3 bytes: a file is closed before it would pass 64
        index = json.loads((tmp_path / INDEX).read_text())
        assert files == [f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)]
        in_file = [files.index(index["weight_map"][name]) for name in TENSORS]
        assert in_file == [0, 1, 1, 2, 3, 3]
        assert index["metadata"]["total_size"] == sum(s.nbytes for s in _specs())
    else:
        assert files == ["model.safetensors"] and not (tmp_path / INDEX).exists()


def test_what_was_not_planned_or_never_came_is_refused(tmp_path):
    writer = StreamedFiles(tmp_path, _specs(), 10**9)
    with pytest.raises(ValueError, match="expected"):
        writer.add("a.weight", torch.randn(5, 7))
    with pytest.raises(ValueError, match="not planned"):
        writer.add("z.other", torch.randn(2))
    writer.add("a.weight", TENSORS["a.weight"])
    with pytest.raises(ValueError, match="written twice"):
        writer.add("a.weight", TENSORS["a.weight"])
    with pytest.raises(ValueError, match="never came: .*b.bias"):
        writer.close()


def test_every_tensor_starts_aligned_to_its_element_size(tmp_path):
    """A 3-element bf16 tensor planned before fp32 ones must not leave them at odd offsets:
    in each file the wider dtypes come first."""
    writer = StreamedFiles(tmp_path, _specs(), 10**9)
    for name, tensor in TENSORS.items():
        writer.add(name, tensor)
    writer.close()
    raw = (tmp_path / "model.safetensors").read_bytes()
    length = int.from_bytes(raw[:8], "little")
    assert (8 + length) % 8 == 0
    header = json.loads(raw[8 : 8 + length])
    for name, tensor in TENSORS.items():
        begin, end = header[name]["data_offsets"]
        assert begin % tensor.element_size() == 0, name
        assert end - begin == tensor.numel() * tensor.element_size()
