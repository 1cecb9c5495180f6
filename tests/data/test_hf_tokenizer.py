"""`tokenizer=hf:<dir>`: a Hugging Face byte-level BPE (`tokenizer.json`) as a tiktoken encoding.
Tiny tokenizers are trained here with the `tokenizers` library in both layouts (GPT-2's ByteLevel
regex; Llama 3's Split regex before ByteLevel); the converted encoding gives the library's ids on
varied text, ends documents with the checkpoint's EOS, saves and reloads with the same identity,
and what it cannot represent is refused naming the reason."""

from __future__ import annotations

import json

import pytest

from data.errors import DataError
from data.tokenizer import load_tokenizer

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers  # noqa: E402

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 12345 o'clock, isn't it?",
    "Ünïcödé text: naïve café, 東京 and Москва; emojis 🙂🚀 and tabs\tand\nnewlines\r\n.",
    "def f(x):\n    return x ** 2  # code with    spaces\n\n",
] * 40
SAMPLES = [
    "Hello world! We're testing 1234567 numbers, 3.14159 and symbols #$%&*.",
    "   leading spaces, trailing   \n\n\nmany newlines\r\nand CRLF",
    "Mixed 東京 scripts, 🙂 emoji, and ÀÉÎ accents I'LL SHOUT",
    "",
]


def train_hf_tokenizer(directory, split: bool, eos: str = "<|end_of_text|>"):
    tok = tokenizers.Tokenizer(models.BPE())
    if split:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|begin_of_text|>", eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    return tok


@pytest.mark.parametrize("split", [True, False], ids=["llama3_split", "gpt2_bytelevel"])
def test_the_converted_encoding_gives_the_librarys_ids(tmp_path, split):
    theirs = train_hf_tokenizer(tmp_path / "hf", split)
    ours = load_tokenizer(f"hf:{tmp_path / 'hf'}")
    assert ours.eot == "<|end_of_text|>" and ours.eot_id == theirs.token_to_id("<|end_of_text|>")
    assert ours.vocab_size == theirs.get_vocab_size()
    for text in SAMPLES + CORPUS[:3]:
        expected = theirs.encode(text, add_special_tokens=False).ids
        assert ours.encode_ordinary(text) == expected, text
        assert ours.decode(expected) == text
    assert ours.encode_document("hi")[-1] == ours.eot_id
    again = load_tokenizer(ours.save(tmp_path / "saved"))  # as a dataset keeps it
    assert again.identity == ours.identity and again.eot == ours.eot


def test_a_unicode_normalizer_is_applied_before_encoding(tmp_path):
    """Qwen's tokenizers normalize to NFC first: decomposed accents encode as composed ones,
    as the library does; the normalizer is part of the identity."""
    theirs = train_hf_tokenizer(tmp_path / "hf", split=True)
    plain = load_tokenizer(f"hf:{tmp_path / 'hf'}")
    edit(tmp_path / "hf" / "tokenizer.json", lambda s: s.update(normalizer={"type": "NFC"}))
    theirs = tokenizers.Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    ours = load_tokenizer(f"hf:{tmp_path / 'hf'}")
    decomposed = "cafe\u0301 nai\u0308ve A\u030angstro\u0308m"
    for text in [decomposed, *SAMPLES]:
        assert ours.encode_ordinary(text) == theirs.encode(text, add_special_tokens=False).ids
    assert ours.encode_ordinary(decomposed) != plain.encode_ordinary(decomposed)
    assert ours.identity.hash != plain.identity.hash
    again = load_tokenizer(ours.save(tmp_path / "saved"))
    assert again.normalizer == "NFC" and again.identity == ours.identity


def test_the_eos_can_come_from_the_model_config(tmp_path):
    theirs = train_hf_tokenizer(tmp_path / "hf", split=True)
    (tmp_path / "hf" / "tokenizer_config.json").unlink()
    eos = theirs.token_to_id("<|end_of_text|>")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    assert load_tokenizer(f"hf:{tmp_path / 'hf'}").eot_id == eos
    (tmp_path / "hf" / "config.json").unlink()
    with pytest.raises(DataError, match="no EOS special token found"):
        load_tokenizer(f"hf:{tmp_path / 'hf'}")


def edit(path, change):
    spec = json.loads(path.read_text())
    change(spec)
    path.write_text(json.dumps(spec))


def swap_two_merges(spec):
    merges = spec["model"]["merges"]
    merges[10], merges[11] = merges[11], merges[10]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s.update(normalizer={"type": "Lowercase"}), "Lowercase normalizer has no"),
        (lambda s: s["model"].update(type="WordPiece"), "a WordPiece tokenizer cannot be"),
        (lambda s: s["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True), "add_prefix_space"),
        (swap_two_merges, "merge order is not its id order"),
        (lambda s: s["model"]["vocab"].pop("Ā"), "of the 256 single bytes are not in"),
    ],
)  # fmt: skip
def test_what_tiktoken_cannot_represent_is_refused(tmp_path, change, message):
    train_hf_tokenizer(tmp_path / "hf", split=True)
    edit(tmp_path / "hf" / "tokenizer.json", change)
    with pytest.raises(DataError, match=message):
        load_tokenizer(f"hf:{tmp_path / 'hf'}")
    with pytest.raises(DataError, match="no tokenizer.json"):
        load_tokenizer(f"hf:{tmp_path / 'nowhere'}")
