"""Our tokenizers written as Hugging Face ones (data/hf_tokenizer_export.py): for both kinds a run
can have (a tiktoken encoding, cl100k_base; a BPE trained by data.bpe) and a normalizer,
`transformers.AutoTokenizer` loads the files offline and gives the same ids as ours on varied
text (code, unicode, whitespace runs, digit runs), decodes them back, has our end-of-text token
as its EOS (special tokens' text in a string is the token to the library, as usual there), and `tokenizer=hf:<dir>` reads them back with our identity (so a model exported
with them continues on the same prepared data). The regex translation for the `tokenizers`
library's dialect is checked on the one construct that needs it."""

from __future__ import annotations

import json
import random

import pytest

from data.bpe import train_bpe
from data.hf_regex import onig_pattern
from data.hf_tokenizer_export import write_hf_tokenizer
from data.tokenizer import Tokenizer, load_tokenizer
from tests.data.helpers import make_text

transformers = pytest.importorskip("transformers")

SAMPLES = [
    "def f(x):\n    return x ** 2  # code with    spaces\n\n\n\tindented\ttabs\r\n",
    "class A:\n\tdef __init__(self) -> None:\n\t\tself.x = {'a': [1, 2, 3]}  # ok?\n",
    "Ünïcödé naïve café, 東京 and Москва; emojis 🙂🚀👩‍👩‍👧 and ZWJ, \u00a0nbsp\u2003em space",
    "   leading spaces, trailing   \n\n\nmany newlines\r\nand CRLF\r\n\r\n   ",
    "digits 1234567890 12 123 1234 3.14159 0x1F 1e-9 ٣٤٥ ① ½",
    "I'LL SHOUT it's 'quoted' they'Re \"double\" don't WE'VE",
    "x" * 300 + " " * 40 + "y",
    "",
]


def _texts() -> list[str]:
    rng = random.Random(5)
    return SAMPLES + [make_text(rng, 200) for _ in range(5)]


def assert_same_ids(ours: Tokenizer, directory) -> None:
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    assert theirs.eos_token == ours.eot and theirs.eos_token_id == ours.eot_id
    for text in _texts():
        ids = ours.encode_ordinary(text)
        assert theirs.encode(text, add_special_tokens=False) == ids, text
        assert theirs.decode(ids) == ours.decode(ids), text
    # the library reads a special token's text as the token (ours, in documents, as plain text)
    assert theirs.encode(f"a{ours.eot}", add_special_tokens=False)[-1] == ours.eot_id


@pytest.fixture(scope="module")
def cl100k() -> Tokenizer:
    return load_tokenizer("cl100k_base")


def test_a_tiktoken_encoding_gives_the_same_ids_through_autotokenizer(cl100k, tmp_path):
    write_hf_tokenizer(cl100k, tmp_path, model_max_length=64)
    assert_same_ids(cl100k, tmp_path)
    assert load_tokenizer(f"hf:{tmp_path}").identity.hash == cl100k.identity.hash
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == 64


@pytest.mark.parametrize("normalizer", ["", "NFC"])
def test_a_trained_bpe_gives_the_same_ids_through_autotokenizer(tmp_path, normalizer):
    rng = random.Random(0)
    trained = train_bpe((make_text(rng, 300) for _ in range(50)), 600, name="mine")
    if normalizer:  # a tokenizer read from a Qwen checkpoint has one
        trained = Tokenizer("mine", trained.pattern, trained.ranks, trained.special_tokens,
                            trained.eot, normalizer)  # fmt: skip
    write_hf_tokenizer(trained, tmp_path)
    assert_same_ids(trained, tmp_path)
    again = load_tokenizer(f"hf:{tmp_path}")
    assert again.identity.hash == trained.identity.hash and again.eot == trained.eot


def test_a_possessive_bounded_repetition_becomes_an_atomic_group(cl100k):
    """Oniguruma reads `\\p{N}{1,3}+` as a repetition of the repetition: a run of ten digits
    would be one piece to the library and four to tiktoken."""
    translated = onig_pattern(cl100k.pattern)
    assert r"(?>\p{N}{1,3})" in translated and r"\p{N}{1,3}+" not in translated
    assert onig_pattern("[a-z]{2,3}+(ab){1,}+c{2}") == "(?>[a-z]{2,3})(?>(ab){1,})c{2}"
    assert onig_pattern(r"[]{]{1}+\p{L}++") == r"(?>[]{]{1})\p{L}++"
