"""`init_from=hf:<dir>` end to end: a tiny Hugging Face Llama (transformers' random weights and a
byte-level BPE trained by the tokenizers library) -> `data.prepare tokenizer=hf:<dir>` -> two
training steps from its weights; the first loss equals transformers' loss on the same batch
(each packed document on its own: positions and attention restart at document starts). A data
set of another tokenizer, a shape-changing override and a missing directory are refused in one
line."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from data.config import LoaderConfig
from data.manifest import Manifest
from data.prepare import prepare
from tests.data.helpers import prepare_config, write_corpus
from tests.data.test_hf_tokenizer import train_hf_tokenizer
from tests.trainer.helpers import run_trainer, train_losses
from trainer.build import build_loader

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.integration

COMMON = [
    "data.seq_len=32", "data.val_batches=1", "data.num_workers=0", "trainer.batch_size=4",
    "trainer.log_every=1", "trainer.precision=fp32", "trainer.threads=1", "trainer.eval_every=0",
    "trainer.sample_tokens=8", "logging.progress=false", "seed=3",
]  # fmt: skip


def hf_llama(directory):
    tokenizer = train_hf_tokenizer(directory, split=True)
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, eos_token_id=tokenizer.token_to_id("<|end_of_text|>"),
        bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)


def transformers_loss(directory, batch) -> float:
    """Mean next-token loss of transformers' model, each document of a packed row run alone."""
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    losses = []
    with torch.no_grad():
        for inputs, targets, docs in zip(*batch, strict=True):
            for doc in docs.unique():
                part = docs == doc
                logits = theirs(inputs[part][None]).logits[0]
                losses.append(F.cross_entropy(logits, targets[part], reduction="none"))
    return float(torch.cat(losses).mean())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_init")
    hf_llama(root / "hf")
    corpus = write_corpus(root / "corpus")[0].parent
    prepare(prepare_config(corpus, root / "data", f"hf:{root / 'hf'}", val_fraction=0.2))
    return root


def test_continued_pretraining_starts_at_transformers_loss(checkpoint, tmp_path):
    hf, data, run = checkpoint / "hf", checkpoint / "data", tmp_path / "run"
    result = run_trainer(
        *COMMON, f"data.path={data}", f"init_from=hf:{hf}", "trainer.max_steps=2",
        "model.max_seq_len=64", f"hydra.run.dir={run}", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "starting from the weights of" in (run / "train.log").read_text()
    loader_cfg = LoaderConfig(path=str(data), seq_len=32, val_batches=1, num_workers=0)
    batch = next(iter(build_loader(loader_cfg, Manifest.load(data), 4, 0, 1, seed=3)))
    losses = train_losses(run)
    assert losses[1] == pytest.approx(transformers_loss(hf, batch), rel=2e-5)
    assert sorted(losses) == [1, 2]  # and it goes on training


def test_what_cannot_continue_is_refused_in_one_line(checkpoint, tmp_path, dataset):
    hf, data = checkpoint / "hf", checkpoint / "data"
    cases = [
        ([f"data.path={dataset}", f"init_from=hf:{hf}"], "prepare it with python -m data.prepare"),
        ([f"data.path={data}", f"init_from=hf:{hf}", "model.d_model=128"], "model.d_model=128"),
        ([f"data.path={data}", f"init_from=hf:{hf}", "model=tiny"], "drop model=tiny"),
        ([f"data.path={data}", f"init_from=hf:{tmp_path}"], "has no config.json"),
    ]
    for overrides, message in cases:
        result = run_trainer(*COMMON, *overrides, "trainer.max_steps=1", cwd=tmp_path)
        assert result.returncode == 2, (overrides, result.stderr[-2000:])
        assert message in result.stderr, (message, result.stderr[-2000:])
        assert "Traceback" not in result.stderr
    assert json.loads((hf / "config.json").read_text())["model_type"] == "llama"
