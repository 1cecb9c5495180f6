"""A Hugging Face checkpoint's tokenizer (`tokenizer.json`) as a tiktoken encoding (`tokenizer=hf:<dir>`).

Byte-level BPE tokenizers (GPT-2's scheme, used by Llama 3, Mistral's Tekken, DeepSeek-V3, OLMo)
are tiktoken encodings in another file format: each vocabulary string spells bytes through
GPT-2's byte-to-unicode table, and the id of a merged token is its merge priority. The conversion
reads the ranks from the vocabulary, the split pattern from the pre-tokenizer, the special tokens
from `added_tokens`, and the token that ends a document from the checkpoint's EOS. It refuses,
naming the reason, what tiktoken cannot reproduce: other models (WordPiece, Unigram), a
normalizer other than a Unicode form (NFC, as Qwen's, is applied before encoding), a prefix space, merges whose priority is not their result's id, missing single bytes.
Our own export (data/hf_tokenizer_export.py) writes the split regex in the `tokenizers`
library's dialect and records tiktoken's pattern beside it; that pattern is used when it
translates to the regex (data/hf_regex.py), so the tokenizer reads back with its identity. A
file that is not JSON (truncated) is a DataError naming it.
The tests encode text both ways and compare the ids.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from data.errors import DataError
from data.hf_regex import TIKTOKEN_PATTERN_KEY, onig_pattern
from data.tokenizer import NORMALIZERS, Tokenizer

# GPT-2's split (the ByteLevel pre-tokenizer's own regex, use_regex=true)
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@lru_cache(maxsize=1)
def unicode_to_byte() -> dict[str, int]:
    """GPT-2's table, inverted: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return {c: b for b, c in chars.items()}


def load_hf_tokenizer(directory: Path) -> Tokenizer:
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"tokenizer=hf:{directory}: no tokenizer.json there")
    spec = _json(path)
    model = spec.get("model") if isinstance(spec.get("model"), dict) else {}
    where = f"tokenizer=hf:{directory}"
    if model.get("type") != "BPE":
        raise DataError(
            f"{where}: a {model.get('type')} tokenizer cannot be represented (tiktoken encodings "
            "are byte-level BPE)"
        )
    if not isinstance(model.get("vocab"), dict) or not isinstance(model.get("merges", []), list):
        raise DataError(f"{where}: {path} has no BPE vocabulary and merges (model.vocab, .merges)")
    normalizer = (spec.get("normalizer") or {}).get("type", "")
    if normalizer not in NORMALIZERS:
        raise DataError(
            f"{where}: its {normalizer} normalizer has no equivalent here (Unicode forms only: "
            f"{', '.join(n for n in NORMALIZERS if n)})"
        )
    pattern = _tiktoken_pattern(_split_pattern(spec.get("pre_tokenizer"), where), directory)
    special = _added_tokens(spec, path)
    ranks = _ranks(model, special, where)
    eos = _eos(directory, special)
    return Tokenizer(f"hf:{directory.name}", pattern, ranks, special, eos, normalizer)


def _split_pattern(pre: dict[str, Any] | None, where: str) -> str:
    """The regex that splits text before BPE: a Split(regex, isolated) before a ByteLevel
    without its own regex, or a ByteLevel with it (GPT-2's)."""
    steps = (pre or {}).get("pretokenizers") if (pre or {}).get("type") == "Sequence" else [pre]
    steps = [s for s in steps or [] if s]
    kinds = [s.get("type") for s in steps]
    if not kinds or kinds[-1] != "ByteLevel":
        raise DataError(f"{where}: pre-tokenizer {kinds} is not byte-level (ByteLevel last)")
    byte_level = steps[-1]
    if byte_level.get("add_prefix_space"):
        raise DataError(f"{where}: ByteLevel add_prefix_space=true has no tiktoken equivalent")
    if kinds == ["ByteLevel"] and byte_level.get("use_regex", True):
        return GPT2_PATTERN
    if kinds == ["Split", "ByteLevel"] and not byte_level.get("use_regex", True):
        split = steps[0]
        regex = (split.get("pattern") or {}).get("Regex")
        if regex and split.get("behavior") == "Isolated" and not split.get("invert"):
            return regex
    raise DataError(f"{where}: pre-tokenizer {kinds} is not a single regex split (tiktoken's)")


def _tiktoken_pattern(regex: str, directory: Path) -> str:
    """The pattern tiktoken matches as `tokenizers` matches `regex`: the one our export records
    beside it (data/hf_regex.py) when that translates to `regex`, else `regex` itself."""
    recorded = _json(directory / "tokenizer_config.json").get(TIKTOKEN_PATTERN_KEY)
    return recorded if isinstance(recorded, str) and onig_pattern(recorded) == regex else regex


def _ranks(model: dict[str, Any], special: dict[str, int], where: str) -> dict[bytes, int]:
    """Token bytes -> id; checked to be a valid tiktoken rank table (all 256 bytes, and the
    merges in the order of their results' ids)."""
    table = unicode_to_byte()
    ranks: dict[bytes, int] = {}
    for text, index in model["vocab"].items():
        if text in special:
            continue
        try:
            ranks[bytes(table[c] for c in text)] = int(index)
        except KeyError:
            raise DataError(f"{where}: vocabulary entry {text!r} is not byte-level") from None
    missing = 256 - sum(1 for token in ranks if len(token) == 1)
    if missing:
        raise DataError(f"{where}: {missing} of the 256 single bytes are not in the vocabulary")
    last = -1
    for merge in model.get("merges", []):
        try:
            left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
            merged = ranks.get(bytes(table[c] for c in left + right))
        except (KeyError, TypeError, ValueError):
            raise DataError(f"{where}: the merge {merge!r} is not a byte-level pair") from None
        # not smaller: a token that several splits make has several merges of one id
        if merged is None or merged < last:
            raise DataError(
                f"{where}: the merge {left!r} + {right!r} does not have the next larger id: its "
                "merge order is not its id order, which tiktoken's ranks need"
            )
        last = merged
    return ranks


def _eos(directory: Path, special: dict[str, int]) -> str:
    """The checkpoint's end-of-sequence token: tokenizer_config.json's eos_token, else the
    eos_token_id of config.json or generation_config.json."""
    config = _json(directory / "tokenizer_config.json")
    eos = config.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if eos in special:
        return eos
    by_id = {index: text for text, index in special.items()}
    for name in ("config.json", "generation_config.json"):
        ids = _json(directory / name).get("eos_token_id")
        for index in ids if isinstance(ids, list) else [ids]:
            if index in by_id:
                return by_id[index]
    raise DataError(
        f"tokenizer=hf:{directory}: no EOS special token found (tokenizer_config.json eos_token, "
        "config.json eos_token_id); documents need one to end with"
    )


def _added_tokens(spec: dict[str, Any], path: Path) -> dict[str, int]:
    try:
        return {str(t["content"]): int(t["id"]) for t in spec.get("added_tokens") or []}
    except (KeyError, TypeError, ValueError):
        raise DataError(f"{path}: added_tokens is not a list of {{content, id}}") from None


def _json(path: Path) -> dict[str, Any]:
    """A JSON object from `path` ({} when there is no file); one that is not JSON (a truncated
    download, say) is a DataError naming it."""
    if not path.is_file():
        return {}
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path} is not valid JSON (truncated or damaged?): {err}") from None
    if not isinstance(spec, dict):
        raise DataError(f"{path} is not a JSON object")
    return spec
