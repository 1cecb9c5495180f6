"""Engram's tokenizer compression: case, accents, Unicode forms and surrounding whitespace fold
to one canonical id; the map is deterministic, covers the model's padding ids, gives byte pieces
ids of their own, and a changed map is refused against the one a run recorded."""

from __future__ import annotations

import json

import pytest

from data.errors import DataError
from data.token_compression import canonical_ids, normalize, save_or_check
from data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def cl100k():
    return load_tokenizer("cl100k_base")


def test_the_normalizer_is_the_demos_chain():
    assert normalize("  Héllo\t\n") == "hello"
    assert normalize("\uff28\uff45\uff4c\uff4c\uff4f") == "hello"  # fullwidth: NFKC
    assert normalize(" ") == " " and normalize("\n\n") == " " and normalize("  ") == " "
    assert normalize("A  b") == "a b"


def test_spelling_variants_share_a_canonical_id(cl100k):
    ids = canonical_ids(cl100k, cl100k.vocab_size)
    variants = ["Hello", " hello", "hello", " Hello"]
    tokens = [cl100k.encoding.encode_ordinary(w) for w in variants]
    assert all(len(t) == 1 for t in tokens)
    assert len({ids[t[0]] for t in tokens}) == 1
    (e,), (e_acute,) = cl100k.encoding.encode_ordinary("e"), cl100k.encoding.encode_ordinary("é")
    assert ids[e] == ids[e_acute]
    # surjective onto 0..n-1, in order of first appearance, about 38% fewer ids than cl100k's
    n = max(ids) + 1
    assert set(ids) == set(range(n)) and ids[0] == 0
    assert 0.55 < n / cl100k.vocab_size < 0.7


def test_byte_pieces_and_padding_ids_get_ids_of_their_own(cl100k):
    ids = canonical_ids(cl100k, cl100k.vocab_size + 3)
    partial = [i for i in cl100k.ranks.values() if _is_partial(cl100k, i)]
    assert partial and len({ids[i] for i in partial}) == len(partial)
    assert ids[-3:] == [max(ids[:-3]) + 1, max(ids[:-3]) + 2, max(ids[:-3]) + 3]
    assert canonical_ids(cl100k, cl100k.vocab_size + 3) == ids  # deterministic
    with pytest.raises(DataError, match="does not cover"):
        canonical_ids(cl100k, 1000)


def _is_partial(tokenizer, token_id: int) -> bool:
    try:
        tokenizer.encoding.decode_single_token_bytes(token_id).decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_a_recorded_map_is_checked(cl100k, tmp_path):
    ids = canonical_ids(cl100k, cl100k.vocab_size)
    save_or_check(tmp_path, cl100k, ids, write=True)
    saved = json.loads((tmp_path / "token_compression.json").read_text())
    assert saved["canonical_vocab"] == max(ids) + 1
    save_or_check(tmp_path, cl100k, ids, write=True)  # the same: accepted
    with pytest.raises(DataError, match="another token compression"):
        save_or_check(tmp_path, cl100k, [*ids[:-1], 0], write=True)
