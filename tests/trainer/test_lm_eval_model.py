"""The lm-evaluation-harness model `lmforge` (trainer/lm_eval_model.py) against independent
computations: loglikelihood and loglikelihood_rolling equal the exported model's in transformers
(AutoModelForCausalLM + AutoTokenizer, log_softmax of full logits in fp64; abs 1e-4 on sums of
fp32 log-probabilities), generate_until equals greedy decoding by full forwards (no cache) and
stops at `until`, for a dense model and a hybrid one (recurrent states); and `lm_eval` itself
scores a checkpoint offline on a local JSONL task, as the in-process model scores it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

from lm_eval.api.instance import Instance  # noqa: E402

from model.presets import load_preset  # noqa: E402
from model.transformer import build_model  # noqa: E402
from tests.commands import run_module  # noqa: E402
from tests.trainer.scoring_helpers import train_and_export  # noqa: E402
from trainer.lm_eval_model import LMForgeLM  # noqa: E402
from trainer.scoring_model import ScoringModel  # noqa: E402

WINDOW = 32  # the run's data.seq_len: the window lmforge scores in
ATOL = 1e-4


@pytest.fixture(scope="module")
def trained(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return train_and_export(dataset, tmp_path_factory.mktemp("lm_eval_run"))


@pytest.fixture(scope="module")
def lm(trained) -> LMForgeLM:
    # batches of 3: requests of different lengths share a padded batch
    return LMForgeLM(path=str(trained[0]), device="cpu", batch_size=3)


@pytest.fixture(scope="module")
def hf(trained):
    """The export in transformers: (model, tokenizer)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(trained[1], dtype=torch.float32)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(trained[1])


def hf_log_probs(model, inputs: list[int]) -> torch.Tensor:
    """(T, V) fp64 log-probabilities of the next token after each input position."""
    with torch.no_grad():
        logits = model(torch.tensor([inputs])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def hf_score(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """The continuation's summed log-probability and whether each token is the argmax, in the
    window of the last WINDOW + 1 tokens."""
    tokens = (context + continuation)[-(WINDOW + 1) :]
    lp = hf_log_probs(model, tokens[:-1])
    positions = range(len(tokens) - 1 - len(continuation), len(tokens) - 1)
    total = sum(float(lp[p, t]) for p, t in zip(positions, continuation))
    greedy = all(int(lp[p].argmax()) == t for p, t in zip(positions, continuation))
    return total, greedy


def hf_pair(tokenizer, eot: int, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a request into tokens, with transformers' tokenizer: trailing spaces of
    the context go to the continuation; an empty context is the end-of-text token."""
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    if not context:
        return [eot], encode(continuation)
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, ctx = encode(context + continuation), encode(context)
    return ctx, whole[len(ctx) :]


REQUESTS = [
    ("The cat sat on", " the mat"),
    ("Question: what is it?\nAnswer:", " a story about the river"),
    ("ends with a space ", "and goes on"),
    ("", "a text without context"),
    ("one", " two three four five six"),
    ("a much longer context " * 6, " that is cut to the window"),  # longer than WINDOW tokens
    ("short", "!"),
]


def instances(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def test_loglikelihood_equals_transformers(lm, hf):
    model, tokenizer = hf
    got = lm.loglikelihood(instances("loglikelihood", REQUESTS), disable_tqdm=True)
    long_context = hf_pair(tokenizer, lm.eot_token_id, *REQUESTS[5])[0]
    assert len(long_context) > WINDOW  # (the window is exercised)
    for (context, continuation), (value, greedy) in zip(REQUESTS, got):
        want, want_greedy = hf_score(
            model, *hf_pair(tokenizer, lm.eot_token_id, context, continuation)
        )
        assert value == pytest.approx(want, abs=ATOL), (context, continuation)
        assert greedy == want_greedy


def test_the_greedy_flag_is_whether_every_token_is_the_argmax(lm, hf):
    model, _ = hf
    context = [5, 17, 3, 99, 42]
    chain = []
    for _ in range(3):  # transformers' own greedy continuation
        chain.append(int(hf_log_probs(model, context + chain)[-1].argmax()))
    other = (chain[2] + 1) % 300
    requests = [
        (None, context, chain),
        (None, context, [*chain[:2], other]),
        (None, context, chain[:1]),
    ]
    got = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    assert [greedy for _, greedy in got] == [True, False, True]
    for (_, ctx, cont), (value, _) in zip(requests, got):
        assert value == pytest.approx(hf_score(model, ctx, cont)[0], abs=ATOL)


def rolling_reference(model, ids: list[int], eot: int) -> float:
    """Each block of WINDOW tokens, conditioned on as many tokens before it as fit in the window
    (the first on the end-of-text token): the sum of every token's log-probability."""
    sequence, total, start = [eot, *ids], 0.0, 0
    while start < len(ids):
        end = min(start + WINDOW, len(ids))  # predicts sequence[start + 1 : end + 1]
        inputs = sequence[max(0, end - WINDOW) : end]
        lp = hf_log_probs(model, inputs)
        offset = len(inputs) - (end - start)
        total += sum(float(lp[offset + k, ids[start + k]]) for k in range(end - start))
        start = end
    return total


def test_loglikelihood_rolling_is_the_sum_over_the_documents_tokens(lm, hf):
    model, tokenizer = hf
    documents = ["a short document.", "a long document that goes on and on. " * 8]
    ids = [tokenizer(d, add_special_tokens=False)["input_ids"] for d in documents]
    assert len(ids[1]) > 2 * WINDOW  # three windows, the last one partial
    got = lm.loglikelihood_rolling(
        instances("loglikelihood_rolling", [(d,) for d in documents]), True
    )
    for value, tokens in zip(got, ids):
        assert value == pytest.approx(rolling_reference(model, tokens, lm.eot_token_id), abs=ATOL)


def full_forward_greedy(model, prompt: list[int], limit: int, eot: int) -> list[int]:
    """Greedy decoding the slow, obvious way: the whole sequence through the model each step."""
    tokens = list(prompt)
    for _ in range(limit):
        with torch.no_grad():
            token = int(model(torch.tensor([tokens]))[0, -1].argmax())
        if token == eot:
            break
        tokens.append(token)
    return tokens[len(prompt) :]


def check_generation(lm: LMForgeLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """generate_until against full-forward greedy decoding: without a stop string the output is
    its text; with one (taken from that text) the text before it, and decoding stops there."""
    prompts = ["The cat sat", "The dog ran", "Once upon a time there", "Hi"]
    limit = 12
    free = lm.generate_until(
        instances("generate_until", [(p, {"until": [], "max_gen_toks": limit}) for p in prompts]),
        disable_tqdm=True,
    )
    refs = [
        full_forward_greedy(lm.model, lm.tok_encode(p), limit, lm.eot_token_id) for p in prompts
    ]
    assert free == [lm.tok_decode(ref) for ref in refs]

    ref = refs[2]
    assert len(ref) == limit  # (no end-of-text token early: the stop string is what stops it)
    stop = lm.tok_decode(ref[4:6])
    text = lm.tok_decode(ref)
    calls = []
    original = lm.model.last_logits
    monkeypatch.setattr(
        lm.model, "last_logits", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    got = lm.generate_until(
        instances("generate_until", [(prompts[2], {"until": [stop], "max_gen_toks": limit})]), True
    )
    assert got == [text.split(stop)[0]]
    assert len(calls) <= 6  # prefill + decoding until the stop string's last token, not 12


def test_generate_until_is_greedy_decoding_and_stops_at_until(lm, monkeypatch):
    check_generation(lm, monkeypatch)


def test_generate_until_with_recurrent_states_is_greedy_decoding(lm, monkeypatch):
    """A hybrid model (Gated DeltaNet layers carry recurrent states, the attention layer a KV
    cache) through the same path."""
    cfg = load_preset(
        "tiny_hybrid",
        {"d_model": 64, "n_layers": 4, "attention.n_heads": 4, "attention.n_kv_heads": 2,
         "gdn.n_heads": 2, "gdn.n_v_heads": 4, "gdn.head_dim": 16, "gdn.v_head_dim": 16,
         "gdn.chunk_size": 16, "ffn.hidden": 96, "vocab_size": 320, "max_seq_len": 64},
    )  # fmt: skip
    model = build_model(cfg, seed=0).eval()
    scoring = ScoringModel(
        model=model, tokenizer=lm.tok, max_seq_len=64, source="hybrid", step=None
    )
    check_generation(LMForgeLM.from_scoring_model(scoring, batch_size=3), monkeypatch)


TASK = """task: lmforge_local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {data}
output_type: multiple_choice
validation_split: validation
doc_to_text: "Question: {{{{goal}}}}\\nAnswer:"
doc_to_target: label
doc_to_choice: "{{{{[sol1, sol2, sol3]}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
DOCS = [
    {"goal": "where does the cat sleep", "sol1": "on the mat", "sol2": "in the sky", "sol3": "a", "label": 0},
    {"goal": "what is water", "sol1": "a rock", "sol2": "a liquid", "sol3": "the moon", "label": 1},
    {"goal": "how many legs has a dog", "sol1": "four", "sol2": "two", "sol3": "none at all", "label": 0},
    {"goal": "what color is grass", "sol1": "red", "sol2": "blue", "sol3": "green", "label": 2},
    {"goal": "who writes books", "sol1": "authors", "sol2": "rivers", "sol3": "stones", "label": 0},
    {"goal": "when is it dark", "sol1": "at noon", "sol2": "at night", "sol3": "always", "label": 1},
]  # fmt: skip


def expected_scores(lm: LMForgeLM) -> dict[str, float]:
    """acc and acc_norm as lm-eval defines them (the choice of highest log-likelihood; per
    character of the choice for acc_norm; each follows " " after the prompt), from the
    in-process model."""
    requests = [
        (f"Question: {doc['goal']}\nAnswer:", f" {doc[key]}")
        for doc in DOCS
        for key in ("sol1", "sol2", "sol3")
    ]
    scores = [value for value, _ in lm.loglikelihood(instances("loglikelihood", requests), True)]
    acc = acc_norm = 0
    for i, doc in enumerate(DOCS):
        mine = scores[3 * i : 3 * i + 3]
        lengths = [len(doc[k]) for k in ("sol1", "sol2", "sol3")]
        acc += max(range(3), key=lambda c: mine[c]) == doc["label"]
        acc_norm += max(range(3), key=lambda c: mine[c] / lengths[c]) == doc["label"]
    return {"acc,none": acc / len(DOCS), "acc_norm,none": acc_norm / len(DOCS)}


def write_task(root: Path) -> Path:
    tasks = root / "tasks"
    tasks.mkdir()
    data = tasks / "local_mc.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (tasks / "local_mc.yaml").write_text(TASK.format(data=data))
    return tasks


def lm_eval_command(tasks: Path, model_args: str, out: Path, cwd: Path):
    return run_module(
        "trainer.lm_eval_model",
        "--model", "lmforge", "--model_args", model_args, "--tasks", "lmforge_local_mc",
        "--include_path", str(tasks), "--output_path", str(out), "--batch_size", "4",
        cwd=cwd, timeout=300,
    )  # fmt: skip


@pytest.mark.integration
def test_lm_eval_scores_a_checkpoint_offline_on_a_local_task(trained, lm, tmp_path):
    tasks = write_task(tmp_path)
    run = trained[0]
    result = lm_eval_command(tasks, f"path={run},dtype=fp32", tmp_path / "out", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    [path] = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(path.read_text())
    scores = results["results"]["lmforge_local_mc"]
    want = expected_scores(lm)
    assert scores["acc,none"] == pytest.approx(want["acc,none"])
    assert scores["acc_norm,none"] == pytest.approx(want["acc_norm,none"])
    assert results["config"]["lmforge_step"] == 2
    assert "lmforge_local_mc" in result.stdout  # the table


@pytest.mark.integration
def test_a_bad_path_is_one_line(tmp_path):
    tasks = write_task(tmp_path)
    result = lm_eval_command(tasks, f"path={tmp_path / 'nope'}", tmp_path / "out", tmp_path)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: path=") and "does not exist" in last
    assert "Traceback" not in result.stderr
