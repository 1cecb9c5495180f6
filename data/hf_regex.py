"""A tiktoken split pattern in the regex dialect of Hugging Face's `tokenizers` library.

tiktoken matches with fancy-regex, `tokenizers` with Oniguruma (Ruby syntax). They read the
same pattern alike except for one construct the tiktoken encodings use: a possessive bounded
repetition. `\\p{N}{1,3}+` is "one to three digits, possessive" to fancy-regex, and "one to
three digits, repeated one or more times" to Oniguruma, which then takes any run of digits as one
piece. The equivalent that both read alike is an atomic group: `(?>\\p{N}{1,3})`.
"""

from __future__ import annotations

import re

TIKTOKEN_PATTERN_KEY = "tiktoken_pattern"  # tokenizer_config.json: the pattern before translation
_POSSESSIVE_BOUNDED = re.compile(r"\{\d+(?:,\d*)?\}\+")
_ESCAPE_WITH_BRACES = re.compile(r"\\[pPx]\{[^}]*\}")


def onig_pattern(pattern: str) -> str:
    """`pattern` with each possessive bounded repetition (`X{n,m}+`) as an atomic group
    (`(?>X{n,m})`); the same string when it has none."""
    out: list[str] = []  # the translated pieces
    groups: list[int] = []  # where in `out` each open group starts
    atom: int | None = None  # where in `out` the last atom starts (what a quantifier repeats)
    i = 0
    while i < len(pattern):
        quantifier = _POSSESSIVE_BOUNDED.match(pattern, i)
        if quantifier and atom is not None:
            out.insert(atom, "(?>")
            out.append(quantifier.group()[:-1] + ")")
            atom, i = None, quantifier.end()
            continue
        char = pattern[i]
        if char == "(":
            groups.append(len(out))
            end, atom = i + 1, None
        elif char == ")":
            end, atom = i + 1, groups.pop() if groups else None
        elif char == "\\":
            braces = _ESCAPE_WITH_BRACES.match(pattern, i)
            end, atom = braces.end() if braces else i + 2, len(out)
        elif char == "[":
            end, atom = _class_end(pattern, i), len(out)
        elif char in "|*+?{":
            end, atom = i + 1, None if char == "|" else atom
        else:
            end, atom = i + 1, len(out)
        out.append(pattern[i:end])
        i = end
    return "".join(out)


def _class_end(pattern: str, start: int) -> int:
    """The index after the `]` that closes the character class opened at `start` (nested classes
    and escapes inside it skipped; a `]` right after `[` or `[^` is a literal)."""
    i, depth = start + 1, 1
    if pattern[i : i + 1] == "^":
        i += 1
    if pattern[i : i + 1] == "]":
        i += 1
    while i < len(pattern) and depth:
        if pattern[i] == "\\":
            i += 1
        elif pattern[i] == "[":
            depth += 1
        elif pattern[i] == "]":
            depth -= 1
        i += 1
    return i
