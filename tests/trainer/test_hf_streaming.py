"""Hugging Face interop at scale, without one process holding the whole model:
- `python -m trainer.export` streams a sharded (DCP) checkpoint a layer at a time into
  size-limited safetensors files with model.safetensors.index.json, each tensor written to its
  place as it comes: the same tensors as the whole-model export, and a peak memory far below
  the model's size even when the whole model goes to one file;
- `init_from=hf:<dir>` on 2 gloo ranks loads each rank's FSDP shards part by part: the right
  weights, and loading adds little to the peak memory of building the engine (reading the
  whole checkpoint on every rank would add most of the model); a damaged file is one
  ConfigError on both ranks.
The memory tests use a 105M-parameter Llama (420 MB in fp32) and each process's peak RSS."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model.config import AttentionConfig, FFNConfig, ModelConfig, MTPConfig
from model.hf import read_hf_state_dict, save_hf
from model.transformer import build_model
from parallel.checkpoint_format import CheckpointFormat
from tests.model.hf_helpers import perturbed
from tests.model.test_hf_deepseek_v3 import CASES as DEEPSEEK_CASES
from tests.parallel.ranks import run_ranks
from trainer.checkpoint.save import Checkpointer
from trainer.export import ExportConfig, export

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
BIG = ModelConfig(
    vocab_size=4096,
    d_model=512,
    n_layers=24,
    max_seq_len=256,
    attention=AttentionConfig(n_heads=8),
    ffn=FFNConfig(kind="swiglu", hidden=2048),
)
BIG_BYTES = 105 * 2**20 * 4  # its fp32 weights (104.9M parameters), about 420 MB


class _Weights(CheckpointFormat):
    """What the trainer's engine saves, reduced to the model (export reads only that), in DCP's
    format (parallel.checkpoint_format)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict()}


def save_checkpoint(model: torch.nn.Module, root: Path) -> Path:
    extra = {"model_config": dataclasses.asdict(model.cfg), "step": 5}
    return Checkpointer(root, 0, keep=1).save(5, _Weights(model), extra)


def peak_rss_mib() -> float:
    """This process's peak RSS (VmHWM: ru_maxrss would also count the parent's memory, which a
    forked child keeps through exec)."""
    status = Path("/proc/self/status").read_text()
    return int(next(ln for ln in status.splitlines() if ln.startswith("VmHWM:")).split()[1]) / 1024


def rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    """The 105M model as a DCP checkpoint (checkpoints/) and an fp32 HF directory (hf/)."""
    root = tmp_path_factory.mktemp("hf_streaming")
    model = build_model(BIG, seed=0)
    save_checkpoint(model, root / "checkpoints")
    save_hf(model, root / "hf", dtype=torch.float32, max_shard_bytes=100 * 10**6)
    return root


def test_a_sharded_checkpoint_exports_part_by_part_into_size_limited_files(tmp_path):
    cfg = dataclasses.replace(DEEPSEEK_CASES["moe_interleaved"], mtp=MTPConfig(depth=1))
    model = perturbed(cfg)
    save_checkpoint(model, tmp_path / "checkpoints")
    out = export(ExportConfig(path=str(tmp_path), out=str(tmp_path / "hf"), max_shard_size="40KB"))
    save_hf(model, tmp_path / "whole", dtype=torch.bfloat16)
    whole = load_file(tmp_path / "whole" / "model.safetensors")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    streamed = {}
    for name in files:
        tensors = load_file(out / name)
        assert all(index["weight_map"][t] == name for t in tensors)
        payload = sum(t.numel() * t.element_size() for t in tensors.values())
        assert payload <= 40_000 or len(tensors) == 1, name  # a tensor over the limit: alone
        streamed |= tensors
    assert streamed.keys() == whole.keys() == index["weight_map"].keys()
    for name, tensor in whole.items():
        assert streamed[name].dtype == tensor.dtype and torch.equal(streamed[name], tensor), name
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in whole.values()
    )
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (tmp_path / "whole" / "config.json").read_text()
    )
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf")]  # no leftovers


EXPORT_SCRIPT = """
import json, sys
from tests.trainer.test_hf_streaming import peak_rss_mib, rss_mib
from trainer.export import ExportConfig, export
before = rss_mib()
export(ExportConfig(path=sys.argv[1], out=sys.argv[2], dtype="fp32", max_shard_size=sys.argv[3]))
print(json.dumps({"before": before, "peak": peak_rss_mib()}))
"""


def test_export_memory_stays_far_below_the_model(big, tmp_path):
    result = subprocess.run(  # files of at most 5 GB: the whole model in one file
        [
            sys.executable,
            "-c",
            EXPORT_SCRIPT,
            str(big / "checkpoints"),
            str(tmp_path / "hf"),
            "5GB",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rss = json.loads(result.stdout.strip().splitlines()[-1])
    grew = (rss["peak"] - rss["before"]) * 2**20
    # measured 52-60 MiB (a layer, converted; each tensor goes to its place in the file as it
    # comes); the whole model is 420 MB, and the export through one whole model peaks 450 MiB
    # above its start
    assert grew < 0.25 * BIG_BYTES, rss
    assert [p.name for p in (tmp_path / "hf").glob("*.safetensors")] == ["model.safetensors"]
    exported, whole = read_hf_state_dict(tmp_path / "hf"), read_hf_state_dict(big / "hf")
    assert exported.keys() == whole.keys()
    assert all(torch.equal(exported[name], tensor) for name, tensor in whole.items())


def two_rank_engine(cfg: ModelConfig, directory: str | None):
    """The FSDP2 engine on 2 ranks, from the HF directory's weights (None: seeded)."""
    from optim.config import OptimConfig
    from parallel.config import ParallelConfig
    from parallel.mesh import ParallelDims
    from trainer.build import build_training_engine
    from trainer.config import TrainerConfig
    from trainer.hf_init import hf_weights_reader

    parallel = ParallelConfig()
    return build_training_engine(
        cfg,
        TrainerConfig(precision="fp32", batch_size=2, compile="false"),
        parallel,
        OptimConfig(),
        ParallelDims.resolve(parallel, 2),
        torch.device("cpu"),
        0,
        hf_weights_reader(f"hf:{directory}", cfg) if directory else None,
    )


def load_on_ranks(rank: int, directory: str, with_weights: bool) -> dict:
    """Build the 2-rank engine from the HF directory's weights or seeded: the growth of this
    process's peak RSS, and the weights whose gathered shards differ from the checkpoint's."""
    before = rss_mib()
    engine = two_rank_engine(BIG, directory if with_weights else None)
    grew = peak_rss_mib() - before
    if not with_weights:
        return {"grew": grew}
    from model.hf import from_hf_state_dict

    expected = from_hf_state_dict(read_hf_state_dict(directory), BIG)
    wrong = [  # whole tensors gathered from both ranks' shards
        name
        for name, p in engine.model.named_parameters()
        if not torch.equal(p.full_tensor(), expected[name])
    ]
    return {"grew": grew, "wrong": wrong}


def test_init_from_hf_loads_each_ranks_shards_without_the_whole_model(big):
    seeded = run_ranks(2, load_on_ranks, str(big / "hf"), False)
    loaded = run_ranks(2, load_on_ranks, str(big / "hf"), True)
    for rank in range(2):
        assert loaded[rank]["wrong"] == []
        # loading adds measured 0-7 MiB to the peak of building the engine (its 210 MB shard,
        # one full block at a time for the seeded initialization); reading and converting the
        # whole checkpoint on each rank added 200-320 MiB
        added = (loaded[rank]["grew"] - seeded[rank]["grew"]) * 2**20
        assert added < 0.1 * BIG_BYTES, (rank, loaded[rank]["grew"], seeded[rank]["grew"])


def load_damaged(rank: int, directories: list[str]) -> str:
    """Build the 2-rank engine from directories[rank]; the ConfigError it raises ("" if none)."""
    from model.errors import ConfigError
    from model.hf import config_from_hf

    directory = directories[rank]
    cfg = config_from_hf(json.loads((Path(directory) / "config.json").read_text()))
    try:
        two_rank_engine(cfg, directory)
    except ConfigError as err:
        return str(err)
    return ""


def test_a_file_damaged_for_one_rank_is_an_error_on_both(tmp_path):
    """Rank 1 reads a copy whose last file is cut short (a node's stale copy): it names the
    file, and rank 0, whose copy is whole, stops too (with rank 1's words, which its log
    shows) instead of waiting for it."""
    cfg = dataclasses.replace(BIG, n_layers=4, d_model=64, ffn=FFNConfig(hidden=96))
    save_hf(build_model(cfg, seed=0), tmp_path / "hf", max_shard_bytes=200_000)
    shutil.copytree(tmp_path / "hf", tmp_path / "copy")
    damaged = sorted((tmp_path / "copy").glob("model-*.safetensors"))[-1]
    damaged.write_bytes(damaged.read_bytes()[:1000])
    errors = run_ranks(2, load_damaged, [str(tmp_path / "hf"), str(tmp_path / "copy")])
    assert errors[0] == errors[1]
    assert errors[1].startswith(f"init_from=hf:{tmp_path / 'copy'}: {damaged} cannot be read")
