"""Continued pretraining from each Hugging Face family, end to end: a small random transformers
model of the family (with the tokenizer of tests/trainer/test_hf_init.py) -> `init_from=hf:`
-> one training step on 2 torchrun ranks (FSDP2; MoE models with their experts split over both:
ep=2) whose loss equals transformers' loss on the same batch.
Documents are not masked here (`trainer.doc_mask=false`): each packed row is one sequence to
both, as transformers sees it."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from data.config import LoaderConfig
from data.manifest import Manifest
from tests.model import test_hf_deepseek_v3, test_hf_hybrid, test_hf_moe
from tests.trainer.helpers import train_losses
from tests.trainer.test_hf_init import COMMON, checkpoint  # noqa: F401  (the fixture)
from tests.trainer.test_torchrun import torchrun
from trainer.build import build_loader

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.integration
FLA = importlib.util.find_spec("fla") is not None
FAMILIES = {
    "qwen3_moe": lambda: (test_hf_moe.HF_MODELS["qwen3_moe"](), test_hf_moe._hf_random),
    "mixtral": lambda: (test_hf_moe.HF_MODELS["mixtral"](), test_hf_moe._hf_random),
    "deepseek_v3": lambda: (
        (transformers.DeepseekV3ForCausalLM, test_hf_deepseek_v3.small_hf_config(True)),
        lambda cls, config: test_hf_deepseek_v3._hf_random(config),
    ),
    "qwen3_next": lambda: (test_hf_hybrid.HF_MODELS["qwen3_next"](), test_hf_hybrid._hf_random),
    "kimi_linear": lambda: (test_hf_hybrid.HF_MODELS["kimi_linear"](), test_hf_hybrid._hf_random),
    "qwen3_5": lambda: (test_hf_hybrid.HF_MODELS["qwen3_5_text"](), test_hf_hybrid._hf_random),
}
HYBRID = ("qwen3_next", "kimi_linear", "qwen3_5")
DENSE = ("qwen3_5",)  # no experts to split: FSDP2 alone


def family_checkpoint(family: str, tokenizer_dir, out):
    """A random model of `family` over the tokenizer's vocabulary, saved with its tokenizer."""
    (cls, config), randomize = FAMILIES[family]()
    llama = json.loads((tokenizer_dir / "config.json").read_text())
    config.vocab_size, config.eos_token_id = llama["vocab_size"], llama["eos_token_id"]
    if family == "kimi_linear":  # else its config.json says 32 (transformers' default), which
        config.num_key_value_heads = config.num_attention_heads  # its own loader then uses
    randomize(cls, config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)


def row_loss(directory, batch) -> float:
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        logits = theirs(batch.inputs).logits
    return float(F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten()))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_continues_pretraining_at_transformers_loss(checkpoint, family, tmp_path):  # noqa: F811
    if FLA and family in HYBRID:
        pytest.skip("transformers dispatches hybrid layers to fla's Triton kernels")
    hf, data, run = tmp_path / "hf", checkpoint / "data", tmp_path / "run"
    family_checkpoint(family, checkpoint / "hf", hf)
    result = torchrun(
        2, *COMMON, f"data.path={data}", f"init_from=hf:{hf}", "trainer.max_steps=1",
        "trainer.doc_mask=false", "trainer.sample_tokens=0",
        *([] if family in DENSE else ["parallel.ep=2"]),
        f"hydra.run.dir={run}", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    loader_cfg = LoaderConfig(path=str(data), seq_len=32, val_batches=1, num_workers=0)
    batch = next(iter(build_loader(loader_cfg, Manifest.load(data), 4, 0, 1, seed=3)))
    assert train_losses(run)[1] == pytest.approx(row_loss(hf, batch), rel=2e-5)
