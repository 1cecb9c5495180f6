"""A tokenizer of ours (a tiktoken encoding) as a Hugging Face tokenizer: `tokenizer.json` and
`tokenizer_config.json`, so that `transformers.AutoTokenizer` loads an exported model's tokenizer
offline and gives the run's ids.

The conversion is the inverse of data/hf_tokenizer.py's (and what transformers' own tiktoken
converter does): the vocabulary spells each token's bytes through GPT-2's byte-to-unicode table
with its rank as id, and every split of a token into two tokens is a merge, ordered by the merged
token's rank. The library then merges exactly the pairs tiktoken merges, in the same order;
`ignore_merges` takes a whole pre-token that is in the vocabulary as tiktoken does. Text is split
by the encoding's own regex (in the library's dialect: data/hf_regex.py) before the byte-level
step, special tokens keep their ids (cl100k's leave holes), and a Unicode normalizer carries over. Only the `tokenizers` library is needed.
The written files are read back (`tokenizer=hf:<dir>`) and must give the same identity, so a
model exported with them can continue training on the data the run was prepared with.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from data.atomic import atomic_write_bytes, atomic_write_json
from data.errors import DataError
from data.hf_regex import TIKTOKEN_PATTERN_KEY, onig_pattern
from data.hf_tokenizer import load_hf_tokenizer, unicode_to_byte
from data.tokenizer import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"


def write_hf_tokenizer(
    tokenizer: Tokenizer, out: Path, *, model_max_length: int | None = None
) -> None:
    """Write `tokenizer` to `out` as `tokenizer.json` + `tokenizer_config.json` (its end-of-text
    token as the EOS), then check that they read back as the same tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / TOKENIZER_FILE, hf_tokenizer(tokenizer).to_str(pretty=True).encode())
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": tokenizer.eot,
        "clean_up_tokenization_spaces": False,  # decoding gives the bytes back unchanged
    }
    if model_max_length:
        config["model_max_length"] = model_max_length
    if onig_pattern(tokenizer.pattern) != tokenizer.pattern:  # read back as tiktoken's own
        config[TIKTOKEN_PATTERN_KEY] = tokenizer.pattern
    atomic_write_json(out / CONFIG_FILE, config)
    again = load_hf_tokenizer(out).identity
    if again.hash != tokenizer.identity.hash:  # (a bug of the conversion, not of the user)
        raise DataError(
            f"{out / TOKENIZER_FILE} reads back as {again.short()}, not "
            f"{tokenizer.identity.short()}: the Hugging Face tokenizer would give other ids"
        )


def hf_tokenizer(tokenizer: Tokenizer) -> HFTokenizer:
    """The `tokenizers` library's byte-level BPE giving `tokenizer`'s ids."""
    vocab, merges = vocab_and_merges(tokenizer.ranks)
    vocab |= tokenizer.special_tokens  # in the vocabulary too, so they keep their ids
    hf = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    if tokenizer.normalizer:
        hf.normalizer = getattr(normalizers, tokenizer.normalizer)()
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(onig_pattern(tokenizer.pattern)), behavior="isolated", invert=False
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    specials = sorted(tokenizer.special_tokens, key=tokenizer.special_tokens.get)
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return hf


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level vocabulary (token text -> rank) and merges: every split of a token into two
    tokens, ordered by the merged token's rank (ties: by the pieces' ranks)."""
    spell = {b: c for c, b in unicode_to_byte().items()}

    def text(token: bytes) -> str:
        return "".join(spell[b] for b in token)

    vocab, merges = {}, []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        vocab[text(token)] = rank
        splits = [
            (ranks[token[:i]], ranks[token[i:]], token[:i], token[i:])
            for i in range(1, len(token))
            if token[:i] in ranks and token[i:] in ranks
        ]
        merges += [(text(left), text(right)) for _, _, left, right in sorted(splits)]
    return vocab, merges
