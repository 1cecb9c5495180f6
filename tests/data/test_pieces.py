"""One large text file (a first run's `input.txt`) gets a validation split by default: the file is
cut into pieces at paragraph boundaries and an even stride of them is held out (issue 13, item 21)."""

from __future__ import annotations

import itertools
import logging
import random

import numpy as np

from data.manifest import Manifest
from data.pieces import PieceSplit, cut
from data.prepare import prepare
from data.sources import Document
from data.tokenizer import load_tokenizer
from tests.data.helpers import make_text, prepare_config
from tests.data.test_prepare import read_split


def paragraphs(words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "\n\n".join(make_text(rng, rng.randint(20, 120)) for _ in range(words // 70))


def test_pieces_end_at_paragraph_breaks_and_rebuild_the_text():
    text = paragraphs(20_000)
    pieces = list(cut(text, 2000))
    assert "".join(pieces) == text
    assert all(p.endswith("\n\n") for p in pieces[:-1])
    assert all(900 < len(p) < 3100 for p in pieces[:-1])
    assert 1800 < np.mean([len(p) for p in pieces]) < 2200


def test_an_even_stride_of_pieces_is_held_out_and_training_runs_are_joined():
    split = PieceSplit(piece_chars=1000, val_fraction=0.05, seed=0)
    text = paragraphs(30_000)
    docs = list(split.documents(iter([Document(0, text, "input.txt")])))
    val = [d for d in docs if d.split == "val"]
    pieces = split.report.pieces
    assert abs(len(val) - pieces * 0.05) <= 1 and len(val) >= 4
    assert [d.index for d in docs] == list(range(len(docs)))
    assert "".join(d.text for d in docs) == text  # nothing lost, nothing repeated
    assert all(a.split != b.split for a, b in itertools.pairwise(docs))  # training runs joined
    gaps = np.diff([i for i, d in enumerate(docs) if d.split == "val"])
    assert gaps.min() >= 0.5 * gaps.mean()  # spread over the text, not clustered


def test_a_single_text_file_gets_a_validation_split_by_default(tmp_path, tokenizer_dir, caplog):
    caplog.set_level(logging.INFO)
    (tmp_path / "input.txt").write_text(paragraphs(60_000), encoding="utf-8")
    out = tmp_path / "dataset"
    manifest = prepare(
        prepare_config(tmp_path / "input.txt", out, tokenizer_dir, val_fraction=0.01)
    )
    pieces = manifest.raw["source"]["pieces"]
    assert pieces["val_pieces"] >= 3  # about MIN_VAL_PIECES = 4
    assert 0.005 < manifest.tokens("val") / manifest.tokens("train") < 0.02  # about 1%
    assert "has few documents: cut 1 document(s) into" in caplog.text
    tok = load_tokenizer(tokenizer_dir)
    train_tokens, _ = read_split(Manifest.load(out), "train")
    eots = int((train_tokens == tok.eot_id).sum())
    assert eots == pieces["val_pieces"] + 1  # one per hole, one at the end


def test_many_files_keep_the_per_document_split(corpus_dir, tokenizer_dir, tmp_path):
    manifest = prepare(prepare_config(corpus_dir, tmp_path / "d", tokenizer_dir, val_fraction=0.2))
    assert "pieces" not in manifest.raw["source"]  # 40 files x 0.2 = 8 held-out documents


def test_the_trainer_defaults_find_validation_batches_in_a_one_megabyte_input(
    tmp_path, tokenizer_dir
):
    """The default loader (global batch 8 x 256 tokens) no longer needs data.val_batches=0."""
    from data.config import LoaderConfig
    from data.loader import TokenLoader

    (tmp_path / "input.txt").write_text(paragraphs(200_000, seed=1), encoding="utf-8")
    out = tmp_path / "dataset"
    prepare(prepare_config(tmp_path / "input.txt", out, tokenizer_dir, val_fraction=0.01))
    loader = TokenLoader(LoaderConfig(path=str(out), seq_len=256, num_workers=0), global_batch=8)
    assert loader.val_batches >= 1


def test_an_unfinished_preparation_begun_before_pieces_is_finished_without_them(
    tmp_path, tokenizer_dir
):
    """A prepare.json without `piece_chars` (written by an earlier version, which never cut
    documents): finishing it must not switch to pieces halfway through."""
    import json

    from tests.data.test_prepare import tree_bytes

    (tmp_path / "input.txt").write_text(paragraphs(60_000), encoding="utf-8")
    whole, partial = tmp_path / "whole", tmp_path / "partial"
    config = dict(val_fraction=0.01, piece_chars=0)
    prepare(prepare_config(tmp_path / "input.txt", whole, tokenizer_dir, **config))
    prepare(prepare_config(tmp_path / "input.txt", partial, tokenizer_dir, **config))
    (partial / "manifest.json").unlink()  # as if killed after the first shards
    for record in sorted((partial / "train").glob("*.json"))[3:]:
        record.unlink()
    settings = json.loads((partial / "prepare.json").read_text())
    del settings["piece_chars"]
    (partial / "prepare.json").write_text(json.dumps(settings))
    prepare(prepare_config(tmp_path / "input.txt", partial, tokenizer_dir, val_fraction=0.01))
    ignore = {"prepare.json", "manifest.json"}  # they record piece_chars as asked (0 vs -1)
    got = {k: v for k, v in tree_bytes(partial).items() if k not in ignore}
    assert got == {k: v for k, v in tree_bytes(whole).items() if k not in ignore}
    splits = [json.loads((d / "manifest.json").read_text())["splits"] for d in (partial, whole)]
    assert splits[0] == splits[1]
