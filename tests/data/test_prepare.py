"""Preparation: exact token streams, fixed-size shards, byte-identical resume after a crash,
repair of damaged shards, and the errors for bad input."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import numpy as np
import pytest

from data import writer as writer_module
from data.encode_pool import EncodePool, encode_batch
from data.errors import DataError
from data.manifest import Manifest
from data.prepare import DocumentSplit, prepare
from data.tokenizer import load_tokenizer
from data.writer import ShardWriter
from tests.data.helpers import make_text, prepare_config


def expected_streams(corpus_dir: Path, tokenizer_dir: Path, val_fraction: float = 0.1):
    """Per split: (concatenated tokens, document start offsets), computed without data.prepare."""
    tok, split = load_tokenizer(tokenizer_dir), DocumentSplit(val_fraction, seed=0)
    streams = {"train": ([], []), "val": ([], [])}
    for index, path in enumerate(sorted(corpus_dir.iterdir())):
        tokens, starts = streams[split(index)]
        starts.append(len(tokens))
        tokens.extend(tok.encode_document(path.read_text(encoding="utf-8")))
    return {k: (np.array(t), np.array(s)) for k, (t, s) in streams.items()}


def read_split(manifest: Manifest, split: str):
    tokens, starts, base = [], [], 0
    for rec in manifest.splits[split]:
        shard = np.fromfile(manifest.root / rec.bin, dtype=manifest.dtype)
        tokens.append(shard)
        starts.append(np.fromfile(manifest.root / rec.idx, dtype=np.int64) + base)
        base += len(shard)
    return np.concatenate(tokens), np.concatenate(starts)


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file a reader can see (logs and the settings record aside)."""
    skip = {"prepare.log"}
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name not in skip
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_dir, tokenizer_dir) -> Path:
    out = tmp_path_factory.mktemp("reference")
    prepare(prepare_config(corpus_dir, out, tokenizer_dir))
    return out


def test_shards_hold_exactly_the_encoded_documents(reference, corpus_dir, tokenizer_dir):
    manifest = Manifest.load(reference)
    expected = expected_streams(corpus_dir, tokenizer_dir)
    assert manifest.tokens("val") > 0 and manifest.documents("val") > 0
    for split, (tokens, starts) in expected.items():
        got_tokens, got_starts = read_split(manifest, split)
        np.testing.assert_array_equal(got_tokens, tokens)
        np.testing.assert_array_equal(got_starts, starts)
        assert manifest.tokens(split) == len(tokens)
        assert manifest.documents(split) == len(starts)
    assert manifest.dtype == np.uint16
    assert manifest.tokenizer == load_tokenizer(tokenizer_dir).identity


def test_shards_have_the_fixed_size_except_the_last(reference):
    manifest = Manifest.load(reference)
    sizes = [r.tokens for r in manifest.splits["train"]]
    assert len(sizes) > 3 and set(sizes[:-1]) == {997} and 0 < sizes[-1] <= 997


def test_the_manifest_describes_source_settings_and_tokenizer(reference, corpus_dir):
    raw = json.loads((reference / "manifest.json").read_text())
    assert raw["source"]["kind"] == "text" and raw["source"]["files"] == 40
    assert raw["settings"]["shard_tokens"] == 997
    assert raw["tokenizer"]["vocab_size"] == 512 and raw["tokenizer"]["eot_id"] == 511
    assert load_tokenizer(reference / "tokenizer").identity.hash == raw["tokenizer"]["hash"]


def test_parallel_workers_write_the_same_bytes(reference, corpus_dir, tokenizer_dir, tmp_path):
    prepare(prepare_config(corpus_dir, tmp_path, tokenizer_dir, workers=2))
    assert tree_bytes(tmp_path) == tree_bytes(reference)


def test_the_encoding_threads_return_batches_in_submission_order(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    rng = random.Random(0)
    batches = [(i, [make_text(rng, rng.randint(0, 300)) for _ in range(3)]) for i in range(40)]
    with EncodePool(3) as pool:
        pool.start(tok, np.dtype(np.uint16))
        threaded = list(pool.map(iter(batches)))
    assert [tag for tag, _ in threaded] == list(range(40))
    for (_, texts), (_, enc) in zip(batches, threaded):
        alone = encode_batch(tok, texts, np.dtype(np.uint16))
        assert enc.tokens.dtype == np.uint16 and np.array_equal(enc.tokens, alone.tokens)
        assert enc.lengths.tolist() == [len(tok.encode_document(t)) for t in texts]


class Crash(Exception):
    pass


@pytest.mark.parametrize("crash_after", [5, 23, 37])
def test_a_rerun_after_a_crash_mid_shard_is_byte_identical(
    reference, corpus_dir, tokenizer_dir, tmp_path, monkeypatch, crash_after
):
    calls = {"n": 0}
    original = ShardWriter.append

    def crashing(self, doc_index, tokens):
        calls["n"] += 1
        if calls["n"] == crash_after:
            original(self, doc_index, tokens[: len(tokens) // 2])  # half a document written
            raise Crash
        original(self, doc_index, tokens)

    cfg = prepare_config(corpus_dir, tmp_path, tokenizer_dir)
    with monkeypatch.context() as m:
        m.setattr(ShardWriter, "append", crashing)
        m.setattr(writer_module, "FLUSH_BYTES", 1)  # every append reaches the file on disk
        with pytest.raises(Crash):
            prepare(cfg)
    assert not (tmp_path / "manifest.json").exists()
    with pytest.raises(DataError, match="preparation has not finished"):
        Manifest.load(tmp_path)
    assert not list(tmp_path.rglob(".*.tmp-*"))  # no temporary left behind
    prepare(cfg)
    assert tree_bytes(tmp_path) == tree_bytes(reference)


def test_a_shard_written_but_not_committed_is_redone(
    reference, corpus_dir, tokenizer_dir, tmp_path
):
    cfg = prepare_config(corpus_dir, tmp_path, tokenizer_dir)
    prepare(cfg)
    (tmp_path / "manifest.json").unlink()
    (tmp_path / "train" / "00002.json").unlink()  # .bin and .idx exist, the record does not
    (tmp_path / "train" / "00003.bin").write_bytes(b"garbage")
    prepare(cfg)
    assert tree_bytes(tmp_path) == tree_bytes(reference)


def test_a_rerun_repairs_damaged_or_missing_shards(
    reference, corpus_dir, tokenizer_dir, tmp_path, caplog
):
    cfg = prepare_config(corpus_dir, tmp_path, tokenizer_dir)
    prepare(cfg)
    damaged = tmp_path / "train" / "00001.bin"
    data = bytearray(damaged.read_bytes())
    data[10] ^= 0xFF
    damaged.write_bytes(bytes(data))
    (tmp_path / "val" / "00000.idx").unlink()
    prepare(cfg)
    assert "00001.bin does not match its checksum" in caplog.text
    assert tree_bytes(tmp_path) == tree_bytes(reference)


def test_a_finished_dataset_is_reused(reference, corpus_dir, tokenizer_dir, caplog):
    caplog.set_level(logging.INFO)
    before = tree_bytes(reference)
    prepare(prepare_config(corpus_dir, reference, tokenizer_dir))
    assert "already prepared" in caplog.text and tree_bytes(reference) == before


def test_other_settings_into_the_same_directory_are_refused(reference, corpus_dir, tokenizer_dir):
    with pytest.raises(DataError, match=r"other settings \(shard_tokens: 997 -> 500\)"):
        prepare(prepare_config(corpus_dir, reference, tokenizer_dir, shard_tokens=500))


def test_training_a_tokenizer_on_the_training_split(corpus_dir, tmp_path):
    manifest = prepare(prepare_config(corpus_dir, tmp_path, "train", vocab_size=400))
    tok = load_tokenizer(tmp_path / "tokenizer")
    assert tok.vocab_size == 400 and manifest.tokenizer == tok.identity
    assert tok.name == tmp_path.name
    assert manifest.tokens("train") == len(read_split(manifest, "train")[0])


def test_uint32_shards_for_a_large_vocabulary_and_refusing_uint16(corpus_dir, tmp_path):
    manifest = prepare(
        prepare_config(corpus_dir / "doc_000.txt", tmp_path / "a", "cl100k_base", val_fraction=0)
    )
    assert manifest.dtype == np.uint32
    assert read_split(manifest, "train")[0].max() == 100257  # EOT survives the cast
    with pytest.raises(DataError, match="token_dtype=uint16 holds ids below 65536.*100277"):
        prepare(prepare_config(corpus_dir, tmp_path / "b", "cl100k_base", token_dtype="uint16"))


def test_a_source_without_documents_is_an_error(tmp_path, tokenizer_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    (empty / "b.txt").write_bytes(b"\xff\xff")
    with pytest.raises(DataError, match=r"has no documents \(2 files, 1 skipped, 1 empty\)"):
        prepare(prepare_config(empty, tmp_path / "out", tokenizer_dir))


def test_max_documents_limits_the_source(corpus_dir, tokenizer_dir, tmp_path):
    manifest = prepare(
        prepare_config(corpus_dir, tmp_path, tokenizer_dir, max_documents=7, val_fraction=0)
    )
    assert manifest.documents("train") == 7


def test_document_split_is_seeded_and_near_the_fraction():
    split = DocumentSplit(0.1, seed=0)
    names = [split(i) for i in range(20000)]
    assert 0.09 < names.count("val") / len(names) < 0.11
    assert names == [DocumentSplit(0.1, seed=0)(i) for i in range(20000)]
    assert names != [DocumentSplit(0.1, seed=1)(i) for i in range(20000)]
    assert all(DocumentSplit(0.0, seed=0)(i) == "train" for i in range(1000))


def test_a_damaged_shard_record_is_treated_as_uncommitted(
    reference, corpus_dir, tokenizer_dir, tmp_path
):
    cfg = prepare_config(corpus_dir, tmp_path, tokenizer_dir)
    prepare(cfg)
    (tmp_path / "manifest.json").unlink()
    (tmp_path / "train" / "00003.json").write_text('{"index": 3')
    prepare(cfg)
    assert tree_bytes(tmp_path) == tree_bytes(reference)


@pytest.mark.parametrize("point", ["bin", "idx", "record", "manifest"])
def test_a_crash_at_each_commit_step_resumes_byte_identical(
    reference, corpus_dir, tokenizer_dir, tmp_path, monkeypatch, point
):
    """Crash right after the .bin rename, the .idx write, the record write, or before the
    manifest (the second time each happens), then run again."""
    import data.atomic
    import data.prepare as prepare_module

    seen = {"n": 0}

    def crash_on_second(name: str) -> None:
        seen["n"] += name == point
        if seen["n"] == 2:
            raise Crash

    original_replace, original_atomic = writer_module.os.replace, writer_module.atomic_write_bytes
    original_json = writer_module.atomic_write_json

    def replace(src, dst):
        original_replace(src, dst)
        crash_on_second("bin")

    def atomic_bytes(path, data):
        original_atomic(path, data)
        crash_on_second("idx")

    def atomic_json(path, obj):
        original_json(path, obj)
        crash_on_second("record")

    def manifest_json(path, obj):
        if path.name == "manifest.json":
            seen["n"] = 1
            crash_on_second("manifest")
        data.atomic.atomic_write_json(path, obj)

    cfg = prepare_config(corpus_dir, tmp_path, tokenizer_dir)
    with monkeypatch.context() as m:
        m.setattr(writer_module.os, "replace", replace)
        m.setattr(writer_module, "atomic_write_bytes", atomic_bytes)
        m.setattr(writer_module, "atomic_write_json", atomic_json)
        m.setattr(prepare_module, "atomic_write_json", manifest_json)
        with pytest.raises(Crash):
            prepare(cfg)
    prepare(cfg)
    assert tree_bytes(tmp_path) == tree_bytes(reference)


def test_a_second_preparation_into_the_same_directory_is_refused(
    corpus_dir, tokenizer_dir, tmp_path
):
    import fcntl

    tmp_path.mkdir(exist_ok=True)
    with open(tmp_path / ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(DataError, match="another `python -m data.prepare` is writing"):
            prepare(prepare_config(corpus_dir, tmp_path, tokenizer_dir))


def test_fixing_a_bad_setting_before_any_shard_starts_over(tmp_path, tokenizer_dir):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text(
        "".join(json.dumps({"body": f"row {i} " * 20}) + "\n" for i in range(30))
    )
    out = tmp_path / "out"
    with pytest.raises(DataError, match="no column 'text'"):
        prepare(prepare_config(src, out, "train", vocab_size=300))
    manifest = prepare(prepare_config(src, out, "train", vocab_size=300, text_column="body"))
    assert manifest.documents("train") + manifest.documents("val") == 30


def test_changed_source_files_after_the_first_shards_are_refused(
    corpus_dir, tokenizer_dir, tmp_path
):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(corpus_dir, src)
    cfg = prepare_config(src, tmp_path / "out", tokenizer_dir)
    with pytest.MonkeyPatch.context() as m:
        calls = {"n": 0}
        original = ShardWriter.append

        def crashing(self, doc_index, tokens):
            calls["n"] += 1
            if calls["n"] == 30:
                raise Crash
            original(self, doc_index, tokens)

        m.setattr(ShardWriter, "append", crashing)
        with pytest.raises(Crash):
            prepare(cfg)
    (src / "doc_001.txt").write_text("edited")
    with pytest.raises(DataError, match="files of source=.* changed since"):
        prepare(cfg)


def test_an_empty_validation_split_is_warned_about(corpus_dir, tokenizer_dir, tmp_path, caplog):
    prepare(prepare_config(corpus_dir, tmp_path, tokenizer_dir, val_fraction=1e-9))
    assert "no document went to validation" in caplog.text
