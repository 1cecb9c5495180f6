"""Sources: file order, decode-error policies, structured files and HF datasets offline, stdlib."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from data.errors import DataError
from data.sources import Source, SourceOptions, stdlib_files


def docs(spec, **kw) -> list:
    return list(Source(str(spec), SourceOptions(**kw)).documents())


def test_a_directory_is_read_recursively_in_path_order_without_hidden_files(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x.txt").write_text("bx")
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "c.md").write_text("c")
    (tmp_path / ".hidden").write_text("h")
    (tmp_path / "b" / "empty.txt").write_text("")
    source = Source(str(tmp_path), SourceOptions())
    got = list(source.documents())
    assert [d.text for d in got] == ["a", "bx", "c"]
    assert [d.index for d in got] == [0, 2, 3]  # the empty file keeps its index
    assert source.report.empty == 1
    assert [d.text for d in docs(tmp_path, include="*.txt")] == ["a", "bx"]


def test_a_glob_and_a_single_file(tmp_path):
    for name in ("one.txt", "two.txt", "three.log"):
        (tmp_path / name).write_text(name)
    assert [d.text for d in docs(tmp_path / "*.txt")] == ["one.txt", "two.txt"]
    assert [d.text for d in docs(tmp_path / "three.log")] == ["three.log"]


@pytest.fixture
def undecodable(tmp_path) -> Path:
    (tmp_path / "good.txt").write_text("fine")
    (tmp_path / "bad.txt").write_bytes(b"ok \xff\xfe then more")
    return tmp_path


def test_decode_errors_strict_names_the_file_and_offset(undecodable):
    with pytest.raises(DataError, match=r"bad.txt: undecodable bytes at byte 3.*decode_errors"):
        docs(undecodable, decode_errors="strict")


def test_decode_errors_skip_drops_and_reports_the_file(undecodable):
    source = Source(str(undecodable), SourceOptions(decode_errors="skip"))
    assert [d.text for d in source.documents()] == ["fine"]
    described = source.describe()
    assert described["skipped_count"] == 1 and described["skipped"][0]["origin"].endswith("bad.txt")


def test_decode_errors_replace_keeps_the_file_with_replacement_characters(undecodable):
    source = Source(str(undecodable), SourceOptions(decode_errors="replace"))
    texts = [d.text for d in source.documents()]
    assert texts == ["ok \ufffd\ufffd then more", "fine"]
    assert source.describe()["replaced_count"] == 1


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("{tmp}/missing", "does not exist"),
        ("{tmp}/*.nothing", "matches no files"),
        ("", "source is empty"),
    ],
)
def test_bad_source_specs_are_named(tmp_path, spec, message):
    with pytest.raises(DataError, match=message):
        Source(spec.format(tmp=tmp_path), SourceOptions())


def test_an_empty_directory_and_a_mixed_directory_are_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no files matching"):
        Source(str(tmp_path / "empty"), SourceOptions())
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text("a")
    (tmp_path / "mixed" / "b.jsonl").write_text('{"text": "b"}\n')
    with pytest.raises(DataError, match="mixes text files with json"):
        Source(str(tmp_path / "mixed"), SourceOptions())


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_parquet_and_csv_files_through_datasets(tmp_path):
    pd = pytest.importorskip("pandas")
    rows = [{"text": "first", "id": 1}, {"text": "", "id": 2}, {"text": "third", "id": 3}]
    write_jsonl(tmp_path / "a.jsonl", rows)
    pd.DataFrame(rows).to_parquet(tmp_path / "b.parquet")
    pd.DataFrame(rows).to_csv(tmp_path / "c.csv", index=False)
    for name in ("a.jsonl", "b.parquet", "c.csv"):
        got = docs(tmp_path / name)
        assert [(d.index, d.text) for d in got] == [(0, "first"), (2, "third")], name
    both = docs(tmp_path / "*.*")  # three files, indices keep running across them
    assert [d.index for d in both] == [0, 2, 3, 5, 6, 8]


def test_a_missing_text_column_lists_the_columns(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"content": "x", "id": 1}])
    with pytest.raises(DataError, match=r"no column 'text' \(columns: \['content', 'id'\]\)"):
        docs(tmp_path / "a.jsonl")
    assert [d.text for d in docs(tmp_path / "a.jsonl", text_column="content")] == ["x"]


def test_a_broken_structured_file_is_skipped_or_fatal_as_configured(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "good"}])
    (tmp_path / "b.jsonl").write_text('{"text": "unterminated\n')
    source = Source(str(tmp_path), SourceOptions(decode_errors="skip"))
    assert [d.text for d in source.documents()] == ["good"]
    assert source.report.skipped_count == 1
    with pytest.raises(DataError, match=r"b.jsonl:1: malformed JSON"):
        docs(tmp_path, decode_errors="strict")


def test_hf_sources_offline_from_a_local_directory_and_a_saved_dataset(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    raw = tmp_path / "raw"
    raw.mkdir()
    write_jsonl(raw / "train.jsonl", [{"body": f"row {i}"} for i in range(5)])
    got = docs(f"hf:{raw}", text_column="body")
    assert [d.text for d in got] == [f"row {i}" for i in range(5)]

    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": ["a", "b"]}),
            "test": datasets.Dataset.from_dict({"text": ["c"]}),
        }
    ).save_to_disk(str(saved))
    assert [d.text for d in docs(f"hf:{saved}", hf_split="test")] == ["c"]
    with pytest.raises(DataError, match="not hf_split=validation"):
        docs(f"hf:{saved}", hf_split="validation")


def test_the_default_corpus_is_the_standard_library_in_a_fixed_order():
    files = stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = [f.relative_to(root).as_posix() for f in files]
    assert len(files) > 500 and rel == sorted(rel)
    assert "os.py" in rel and "json/__init__.py" in rel
    assert not any("site-packages" in r or "dist-packages" in r for r in rel)
    assert all(f.suffix == ".py" for f in files)


@pytest.mark.parametrize(
    ("separator", "expected"),
    [
        ("blank_line", ["a b\nc", "d", "e\n"]),
        ("line", ["a b", "c", "d", "e"]),
        ("eot", ["a b\nc\n\nd\n\n", "e\n"]),
    ],
)
def test_text_files_split_into_documents_on_a_separator(tmp_path, separator, expected):
    (tmp_path / "one.txt").write_text(
        "a b\nc\n\nd\n\n<|endoftext|>e\n" if separator == "eot" else "a b\nc\n\nd\n\ne\n"
    )
    got = docs(tmp_path / "one.txt", doc_separator=separator)
    assert [d.text for d in got] == expected
    assert [d.index for d in got] == sorted(d.index for d in got)


def test_separated_files_are_streamed_in_blocks_and_keep_byte_offsets(tmp_path, monkeypatch):
    from data import sources

    monkeypatch.setattr(sources, "READ_BYTES", 7)  # separators straddle the read blocks
    pieces = [f"document number {i} ✓" for i in range(20)]
    (tmp_path / "a.txt").write_text("\n\n".join(pieces))
    got = docs(tmp_path / "a.txt", doc_separator="blank_line")
    assert [d.text for d in got] == pieces
    raw = (tmp_path / "a.txt").read_bytes()
    for d in got:
        at = int(d.origin.rsplit("@", 1)[1])
        assert raw[at:].startswith(d.text.encode())


def test_a_bad_piece_is_skipped_alone(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"good one\n\nbad \xff here\n\ngood two")
    source = Source(str(tmp_path / "a.txt"), SourceOptions(doc_separator="blank_line"))
    assert [d.text for d in source.documents()] == ["good one", "good two"]
    assert source.report.skipped[0]["reason"] == "undecodable bytes at byte 14"


@pytest.mark.parametrize("good_rows", [3, 60_000])
def test_a_malformed_json_line_is_skipped_alone(tmp_path, good_rows):
    """JSON Lines are read line by line: the rows before and after a bad line are all kept
    (datasets' block parser used to drop the rest of the file), and the report names the line."""
    text = "word " * 40
    rows = [json.dumps({"text": f"{i} {text}"}) + "\n" for i in range(good_rows)]
    (tmp_path / "a.jsonl").write_text("".join(rows) + '{"text": broken\n' + "".join(rows))
    source = Source(str(tmp_path / "a.jsonl"), SourceOptions())
    got = list(source.documents())
    assert len(got) == 2 * good_rows and source.report.skipped_count == 1
    assert source.report.skipped[0]["origin"].endswith(f"a.jsonl:{good_rows + 1}")
    assert source.report.skipped[0]["reason"].startswith("malformed JSON")
    assert [d.index for d in got][good_rows] == good_rows + 1  # the bad line keeps its index


def test_rows_without_the_text_column_are_counted_and_warned_about(tmp_path):
    write_jsonl(
        tmp_path / "a.jsonl", [{"text": "one"}, {"other": "x"}, {"text": None}, {"text": ""}]
    )
    source = Source(str(tmp_path / "a.jsonl"), SourceOptions())
    assert [d.text for d in source.documents()] == ["one"]
    assert source.report.missing_text == 2 and source.report.empty == 1


def test_a_file_that_grows_while_it_is_read_is_an_error(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("first version")
    source = Source(str(tmp_path / "a.txt"), SourceOptions())
    (tmp_path / "a.txt").write_text("first version, and more written since")
    with pytest.raises(DataError, match=r"a.txt changed while it was being prepared \(13 -> 37"):
        list(source.documents())


def test_a_truncated_compressed_json_lines_file_keeps_the_rows_before_the_damage(tmp_path):
    import gzip

    rows = "".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(2000)).encode()
    packed = gzip.compress(rows)
    (tmp_path / "a.jsonl.gz").write_bytes(packed[: len(packed) // 2])
    source = Source(str(tmp_path / "a.jsonl.gz"), SourceOptions())
    got = list(source.documents())
    assert 0 < len(got) < 2000 and got[-1].text == f"row {len(got) - 1}"
    assert source.report.skipped[0]["reason"].startswith("cannot be read on (EOFError")
    with pytest.raises(DataError, match="a.jsonl.gz: cannot be read"):
        list(
            Source(str(tmp_path / "a.jsonl.gz"), SourceOptions(decode_errors="strict")).documents()
        )
