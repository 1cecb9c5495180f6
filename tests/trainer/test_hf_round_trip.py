"""The round trip a user expects: train 2 steps -> `python -m trainer.export` (fp32) ->
`init_from=hf:<the export>` trains 2 more steps on the same prepared data (its tokenizer a BPE
trained by data.prepare). The export holds a Hugging Face tokenizer that reads back with the
run tokenizer's identity, so the data is accepted; and the continued run starts from the
exported weights: its validation loss before its first step equals the first run's final
validation loss (the same weights on the same validation windows, fp32 throughout; rel 1e-5,
the conversion being exact up to fp32 rounding)."""

from __future__ import annotations

import pytest

from data.manifest import Manifest
from data.tokenizer import load_tokenizer
from tests.commands import run_module
from tests.trainer.helpers import SMALL_OVERRIDES, metric_rows, run_trainer, train_losses

pytestmark = pytest.mark.integration
# the settings of both runs; the model's come from SMALL_OVERRIDES, then from the export
RUN = [o for o in SMALL_OVERRIDES if not o.startswith("model.")] + [
    "trainer.precision=fp32", "trainer.eval_every=0", "trainer.max_steps=2", "seed=3",
]  # fmt: skip


def val_losses(run) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in metric_rows(run) if "val_loss" in r}


def test_an_export_continues_training_on_the_same_data(dataset, tmp_path):
    first, export, second = tmp_path / "first", tmp_path / "hf", tmp_path / "second"
    model = [o for o in SMALL_OVERRIDES if o.startswith("model.")]
    result = run_trainer(
        *RUN, *model, f"data.path={dataset}", f"hydra.run.dir={first}", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_module("trainer.export", f"path={first}", f"out={export}", "dtype=fp32",
                        cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    tokenizer = load_tokenizer(f"hf:{export}")
    assert tokenizer.identity.hash == Manifest.load(dataset).tokenizer.hash
    generates_with_transformers_alone(export, tokenizer.eot_id)

    result = run_trainer(
        *RUN, f"data.path={dataset}", f"init_from=hf:{export}", f"hydra.run.dir={second}",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(train_losses(second)) == [1, 2]
    before, after = val_losses(first), val_losses(second)
    assert after[0] == pytest.approx(before[2], rel=1e-5)
    assert after[0] != pytest.approx(before[0], rel=1e-4)  # (trained weights, not initial ones)


def generates_with_transformers_alone(export, eot_id: int) -> None:
    """transformers alone loads the export and generates; its EOS is the end-of-text token (so
    generate() stops at a document's end, as the trainer's sampler does)."""
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    model = transformers.AutoModelForCausalLM.from_pretrained(export)
    assert model.config.eos_token_id == eot_id == tokenizer.eos_token_id
    assert model.generation_config.eos_token_id == eot_id
    prompt = tokenizer("the", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]
    assert tokenizer.decode(out[0]).startswith("the")
