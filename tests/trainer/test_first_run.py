"""What a new user sees in a run's log: where the run is (step/total, elapsed, ETA), what it
achieved at the end and where its results are, a warning when the warmup outlasts the run, the
active parameters of a MoE model, and a sample prompted by the data itself (the start of a
validation document, or of a validation window where none starts in the sample)."""

from __future__ import annotations

import re

from model.presets import load_preset
from tests.trainer.helpers import SMALL_MODEL, small_config
from trainer.app import build_training
from trainer.evaluate import data_prompt
from trainer.progress import RunClock, clock
from trainer.runtime import Ranks

ONE = Ranks(rank=0, world_size=1, local_rank=0)


def test_the_log_says_where_the_run_is_and_ends_with_what_it_achieved(dataset, tmp_path, caplog):
    caplog.set_level("INFO")
    cfg = small_config(dataset, max_steps=3, eval_every=0)
    cfg.checkpoint.every = 3
    training = build_training(cfg, tmp_path, ONE)
    assert training.run() == 0
    rows = re.findall(r"step (\d+)/3  loss .* elapsed (\d+:\d\d:\d\d)  ETA (\S+)", caplog.text)
    assert [r[0] for r in rows] == ["1", "2", "3"]
    assert rows[-1][2] == "0:00:00"  # nothing left at the last step
    assert re.search(r"done: 3 steps in \d+:\d\d:\d\d \([\d,]+ tokens/s of training\)", caplog.text)
    assert f"final validation loss {training.val_loss:.4f}" in caplog.text
    assert f"run directory {tmp_path}: train.log, metrics.jsonl, loss.png" in caplog.text
    assert "last checkpoint" in caplog.text and "step_00000003" in caplog.text


def test_a_warmup_longer_than_the_run_is_said_at_the_start(dataset, tmp_path, caplog):
    cfg = small_config(dataset, max_steps=4)
    cfg.optim.warmup_steps, cfg.optim.lr = 10, 1e-3
    build_training(cfg, tmp_path, ONE)
    assert (
        "optim.warmup_steps=10 > trainer.max_steps=4: the learning rate never reaches "
        "optim.lr=0.001 (it peaks at 0.0004 on the last step)" in caplog.text
    )
    caplog.clear()
    cfg.optim.warmup_steps = 4
    build_training(cfg, tmp_path / "exact", ONE)
    assert "never reaches" not in caplog.text


def test_a_moe_model_names_its_active_parameters(dataset, tmp_path, caplog):
    caplog.set_level("INFO")
    cfg = small_config(dataset, max_steps=1)
    cfg.model = load_preset("tiny_moe", SMALL_MODEL | {"moe.expert_hidden": 32})
    build_training(cfg, tmp_path, ONE)
    total, active = re.search(
        r"model: ([\d,]+) parameters \(([\d,]+) active per token\)", caplog.text
    ).groups()
    assert int(active.replace(",", "")) < int(total.replace(",", ""))


def test_the_sample_is_prompted_by_the_validation_data(dataset, tmp_path):
    training = build_training(small_config(dataset, max_steps=1), tmp_path, ONE)
    prompt = data_prompt(training.loader)
    assert training.sample_prompt == prompt and prompt.strip()
    ids = training.loader.tokenizer.encode_ordinary(prompt)
    assert 0 < len(ids) <= 14  # 12 tokens, give or take the re-encoding of their text
    documents = [p.read_text() for p in (dataset.parent / "corpus").glob("*.txt")]
    assert any(prompt in doc for doc in documents)  # words of the data, not "def "


def test_clock_and_eta():
    assert clock(4321.5) == "1:12:02" and clock(-1) == "0:00:00"
    run_clock = RunClock(first_step=10)
    assert run_clock.eta(10, 100) is None
    run_clock.add_window(seconds=20.0, tokens=2000)
    assert run_clock.eta(20, 100) == 160.0  # 2 s a step, 80 steps left
    assert run_clock.tokens_per_s() == 100.0


def test_the_prompt_is_a_document_start_where_one_is_in_the_sample(tmp_path):
    from data.prepare import prepare
    from tests.data.helpers import prepare_config

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(60):  # short documents: every window holds a document start
        (corpus / f"doc_{i:03d}.txt").write_text(f"Document {i} says hello to the world. " * 2)
    dataset = tmp_path / "dataset"
    prepare(prepare_config(corpus, dataset, "train", vocab_size=300, val_fraction=0.2))
    training = build_training(small_config(dataset, max_steps=1), tmp_path / "run", ONE)
    assert re.fullmatch(
        r"Document \d+ says hello to the world\. [\w ]*", data_prompt(training.loader)
    )


def test_an_mfu_above_100_percent_says_the_peak_is_too_low_once(dataset, tmp_path, caplog):
    cfg = small_config(dataset, max_steps=3, eval_every=0, peak_flops=1.0)
    assert build_training(cfg, tmp_path, ONE).run() == 0
    assert caplog.text.count("MFU above 100%") == 1
    assert "the peak of 1 FLOP/s is too low" in caplog.text and "mfu_peaks.json" in caplog.text
