"""Tokenizers: BPE training, exact round trips, identity hashes, the offline named encodings."""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest

from data.bpe import train_bpe
from data.errors import DataError
from data.tokenizer import EOT, GPT4_SPLIT_PATTERN, Tokenizer, load_tokenizer

# sha256 of cl100k_base's pattern, special tokens and ranks: a change means shards tokenized
# before it would silently disagree with ones tokenized after.
CL100K_HASH = "fb3ac69d1f1708088835a7018356d1360ec0f12d70bc8c4194976f9ac756824a"


def random_unicode(rng: random.Random, n: int) -> str:
    """Code points from every plane but the surrogates (which UTF-8 cannot carry)."""
    chars = []
    while len(chars) < n:
        cp = rng.choice([rng.randint(0, 0x7F), rng.randint(0x80, 0xFFFF), rng.randint(0, 0x10FFFF)])
        if not 0xD800 <= cp <= 0xDFFF:
            chars.append(chr(cp))
    return "".join(chars)


def test_trained_bpe_has_the_requested_vocabulary_and_eot_last(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    assert tok.vocab_size == 512
    assert tok.eot_id == 511 and tok.special_tokens == {EOT: 511}
    assert tok.pattern == GPT4_SPLIT_PATTERN


@pytest.mark.parametrize("seed", range(5))
def test_round_trip_of_arbitrary_unicode(tokenizer_dir, seed):
    tok = load_tokenizer(tokenizer_dir)
    text = random_unicode(random.Random(seed), 2000)
    ids = tok.encode_document(text)
    assert ids[-1] == tok.eot_id and tok.eot_id not in ids[:-1]
    assert tok.encoding.decode_bytes(ids[:-1]) == text.encode("utf-8")
    assert tok.decode(ids[:-1]) == text


def test_every_byte_is_a_token_so_any_byte_string_is_representable(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    single = {tok.encoding.decode_single_token_bytes(r) for r in range(tok.eot_id)}
    assert {bytes([b]) for b in range(256)} <= single
    raw = bytes(random.Random(0).randrange(256) for _ in range(3000))
    text = raw.decode("utf-8", errors="replace")  # what the sources hand over for bad bytes
    assert tok.decode(tok.encode_document(text)[:-1]) == text


def test_special_token_text_is_encoded_as_plain_text(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    ids = tok.encode_document(f"a {EOT} b")
    assert ids.count(tok.eot_id) == 1 and tok.decode(ids[:-1]) == f"a {EOT} b"


@pytest.mark.parametrize("normalizer", ["", "NFC"])
def test_the_array_encoding_equals_the_list_encoding(tokenizer_dir, normalizer):
    """encode_ordinary_array (tiktoken's buffer) = encode_ordinary (its list), special-token
    strings, lone surrogates and normalization included."""
    tok = load_tokenizer(tokenizer_dir)
    tok = Tokenizer(tok.name, tok.pattern, tok.ranks, tok.special_tokens, normalizer=normalizer)
    texts = ["", f"a {EOT} b {EOT}", "lone \ud800 surrogate", "cafe\u0301 ﬁ 😀"]
    texts += [random_unicode(random.Random(seed), 500) for seed in range(3)]
    for text in texts:
        array = tok.encode_ordinary_array(text)
        assert array.dtype == np.uint32 and array.tolist() == tok.encode_ordinary(text)


def test_save_and_load_keep_the_identity_and_the_encoding(tokenizer_dir, tmp_path):
    tok = load_tokenizer(tokenizer_dir)
    again = load_tokenizer(tok.save(tmp_path / "copy"))
    assert again.identity == tok.identity
    text = random_unicode(random.Random(1), 500)
    assert again.encode_document(text) == tok.encode_document(text)


def test_identity_is_the_same_in_another_process(tokenizer_dir):
    code = f"from data.tokenizer import load_tokenizer; print(load_tokenizer({str(tokenizer_dir)!r}).identity.hash)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == load_tokenizer(tokenizer_dir).identity.hash


def test_identity_changes_with_ranks_pattern_or_special_tokens(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    swapped = dict(tok.ranks)
    a, b = (t for t, r in swapped.items() if r in (300, 301))
    swapped[a], swapped[b] = swapped[b], swapped[a]
    variants = [
        Tokenizer("x", tok.pattern, swapped, tok.special_tokens),
        Tokenizer("x", r"\S+|\s+", tok.ranks, tok.special_tokens),
        Tokenizer("x", tok.pattern, tok.ranks, {EOT: 511, "<|pad|>": 512}),
    ]
    hashes = {v.identity.hash for v in variants} | {tok.identity.hash}
    assert len(hashes) == 4
    assert Tokenizer("renamed", tok.pattern, tok.ranks, tok.special_tokens).identity.hash == (
        tok.identity.hash
    )


def test_cl100k_base_loads_offline():
    tok = load_tokenizer("cl100k_base")
    assert tok.identity.name == "cl100k_base" and tok.identity.hash == CL100K_HASH
    assert tok.encode_document("hello world") == [15339, 1917, 100257]
    assert tok.vocab_size == 100277


def test_a_named_encoding_missing_from_the_cache_is_an_error_not_a_download(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    with pytest.raises(DataError, match="TIKTOKEN_CACHE_DIR") as refused:
        load_tokenizer("r50k_base")
    # a bare .tiktoken file is no substitute: it would split with GPT-4's pattern (below)
    assert "GPT-4's pattern, not r50k_base's" in str(refused.value)


def test_a_bare_tiktoken_file_gets_gpt4_splitting_and_eot_after_the_ranks(tokenizer_dir, tmp_path):
    bare = tmp_path / "mine.tiktoken"
    bare.write_bytes((tokenizer_dir / "tokenizer.tiktoken").read_bytes())
    tok = load_tokenizer(bare)
    assert tok.name == "mine" and tok.eot_id == 511
    assert tok.identity.hash == load_tokenizer(tokenizer_dir).identity.hash


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_encoding", "is not a directory, a .tiktoken file or a tiktoken encoding"),
        ("missing/file.tiktoken", "does not exist"),
    ],
)
def test_bad_tokenizer_specs_name_the_problem(spec, message):
    with pytest.raises(DataError, match=message):
        load_tokenizer(spec)


def test_a_malformed_tiktoken_file_names_the_line(tmp_path):
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("IQ== 0\nnot-base64!! 1\n")
    with pytest.raises(DataError, match=r"bad.tiktoken:2"):
        load_tokenizer(bad)


def test_bpe_training_rejects_a_tiny_vocabulary_and_an_empty_corpus():
    with pytest.raises(DataError, match="vocab_size=200 leaves no room"):
        train_bpe(["some text"], 200)
    with pytest.raises(DataError, match="empty"):
        train_bpe([], 300)


def test_bpe_training_is_deterministic(corpus_dir):
    texts = [p.read_text(encoding="utf-8") for p in sorted(corpus_dir.iterdir())][:10]
    assert train_bpe(texts, 400).identity == train_bpe(texts, 400).identity
