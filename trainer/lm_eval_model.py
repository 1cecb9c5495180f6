"""`lmforge`: an lm-evaluation-harness model that scores a run directory, a checkpoint or a Hugging
Face directory as it is (trainer/scoring_model.py), without converting it:

    python -m trainer.lm_eval_model --model lmforge --model_args path=<run|checkpoint|HF dir> \\
        --tasks hellaswag --batch_size 16 --device cpu

lm-eval 0.4.x finds models only in its own table or through `register_model`, not through a
package entry point, so this module registers the model and then runs lm-eval's own command
line (every `lm_eval` option works). From Python: `import trainer.lm_eval_model`, then
`lm_eval.simple_evaluate(model="lmforge", model_args={"path": ...}, ...)`.

model_args: path (required), dtype (auto | fp32 | bf16 | fp16), device, batch_size (sequences
per forward; auto = 16), max_length (the window, default the length the model was trained at),
tokenizer (replaces the one found). One process: lm-eval's data parallelism is not supported.

- loglikelihood: the continuation's summed log-probability, each token's from the model's
  per-token scoring (model.loss.target_log_probs over the final hidden states: no (B, T, V)
  logits), and whether each of its tokens is the argmax; requests are batched by length, padded
  on the right (causal: padding changes nothing before it).
- loglikelihood_rolling: lm-eval's disjoint windows of max_length tokens, summed.
- generate_until: greedy (or sampled with do_sample) decoding with the model's generation state
  (KV caches, latent caches, recurrent states: model.new_cache + last_logits), stopping at the
  `until` strings, the end-of-text token or max_gen_toks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import Tensor
from tqdm import tqdm

from model.errors import ConfigError
from model.generate import sample_next
from model.loss import IGNORE_INDEX, target_log_probs
from trainer.scoring_errors import one_line_errors
from trainer.scoring_model import ScoringModel, load_scoring_model

log = logging.getLogger("trainer.lm_eval_model")
DEFAULT_GEN_TOKENS = 256  # lm-eval's default max_gen_toks
AUTO_BATCH = 16  # batch_size=auto: no probing (a CPU has no out-of-memory error to probe with)
MODEL_ARGS = ("path", "device", "dtype", "batch_size", "max_batch_size", "max_length", "tokenizer")
Window = tuple[list[int], list[int]]  # (the model's input tokens, the targets scored at its end)


@register_model("lmforge")
class LMForgeLM(TemplateLM):
    def __init__(
        self,
        path: str = "",
        device: str | None = None,
        dtype: str | None = None,
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,
        max_length: int | None = None,
        tokenizer: str | None = None,
        **unknown: Any,
    ) -> None:
        super().__init__()
        if unknown:
            raise ConfigError(
                f"unknown lmforge model_args {sorted(unknown)}: the known ones are "
                f"{', '.join(MODEL_ARGS)}"
            )
        if not path:
            raise ConfigError("pass --model_args path=<run directory, checkpoint or HF directory>")
        device = torch.device(_usable_device(device))
        scoring = load_scoring_model(path, device, dtype, tokenizer)
        self._use(scoring, device, _batch_size(batch_size, max_batch_size), max_length)

    @classmethod
    def from_scoring_model(
        cls,
        scoring: ScoringModel,
        batch_size: int = AUTO_BATCH,
        max_length: int | None = None,
    ) -> LMForgeLM:
        """An lmforge model around a model already in memory (on its own device)."""
        lm = cls.__new__(cls)
        TemplateLM.__init__(lm)
        lm._use(scoring, scoring.model.head_weight.device, batch_size, max_length)
        return lm

    def _use(
        self, scoring: ScoringModel, device: torch.device, batch_size: int, max_length: int | None
    ) -> None:
        self.scoring, self._device, self.batch_size = scoring, device, batch_size
        self.model, self.tok = scoring.model, scoring.tokenizer
        self._max_length = int(max_length or scoring.max_seq_len)
        log.info(
            "lmforge: %s (step %s) on %s, windows of %d tokens, batches of %d",
            scoring.source, scoring.step, device, self._max_length, batch_size,
        )  # fmt: skip

    @classmethod
    def create_from_arg_obj(
        cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None
    ) -> LMForgeLM:
        """The harness passes --batch_size and --device (its defaults too) beside model_args:
        model_args win instead of colliding."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**(extra | dict(arg_dict)))

    @classmethod
    def create_from_arg_string(
        cls, arg_string: str, additional_config: dict[str, Any] | None = None
    ) -> LMForgeLM:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    # -- what TemplateLM asks ------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tok.eot_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.tok.identity.short()

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **_: Any
    ) -> list[int]:
        return self.tok.encode_ordinary(string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens)

    def get_model_info(self) -> dict[str, Any]:
        """Recorded in the results' config: what was scored."""
        return {"lmforge_source": self.scoring.source, "lmforge_step": self.scoring.step}

    # -- scoring --------------------------------------------------------------------------------
    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **_: Any
    ) -> list[tuple[float, bool]]:
        windows = [self._window(context, continuation) for _, context, continuation in requests]
        results: list[tuple[float, bool]] = [(0.0, True)] * len(requests)
        order = sorted(range(len(windows)), key=lambda i: -len(windows[i][0]))
        bar = tqdm(total=len(order), desc="lmforge loglikelihood", disable=disable_tqdm)
        for batch in _chunks(order, self.batch_size):
            for i, score in zip(batch, self._score([windows[i] for i in batch])):
                results[i] = score
                if requests[i][0] is not None:  # (rolling windows are cached whole, below)
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], score)
            bar.update(len(batch))
        bar.close()
        return results

    def _window(self, context: list[int], continuation: list[int]) -> Window:
        """The last max_length + 1 tokens of context + continuation as (input, targets): the
        continuation's tokens (at most max_length of them) are predicted at the input's end."""
        tokens = (context + continuation)[-(self.max_length + 1) :]
        scored = continuation[len(continuation) - min(len(continuation), len(tokens) - 1) :]
        if len(scored) < len(continuation):
            log.warning(
                "a continuation of %d tokens is longer than the %d-token window: its last %d "
                "are scored", len(continuation), self.max_length, len(scored),
            )  # fmt: skip
        return tokens[:-1], scored

    @torch.no_grad()
    def _score(self, windows: list[Window]) -> list[tuple[float, bool]]:
        """(summed log-probability, every token the argmax) of each window's targets."""
        width = max(len(inputs) for inputs, _ in windows)
        if width == 0:  # nothing is predicted (an empty continuation)
            return [(0.0, True)] * len(windows)
        shape = (len(windows), width)
        inputs = torch.full(shape, self.eot_token_id, dtype=torch.long)
        targets = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
        for row, (tokens, scored) in enumerate(windows):
            inputs[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            if scored:
                targets[row, len(tokens) - len(scored) : len(tokens)] = torch.tensor(scored)
        inputs, targets = inputs.to(self._device), targets.to(self._device)
        h = self.model.hidden_states(inputs)
        chunk = self.model.cfg.loss_chunk_tokens
        log_probs = target_log_probs(h, self.model.head_weight, targets, chunk).sum(dim=1)
        missed = _not_argmax(h, self.model.head_weight, targets, chunk)
        return [(float(lp), not bool(m)) for lp, m in zip(log_probs.cpu(), missed.cpu())]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        per_request = []
        for (text,) in (req.args for req in requests):
            pairs = get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            per_request.append([(None, *make_disjoint_window(pair)) for pair in pairs])
        flat = [window for windows in per_request for window in windows]
        scores = iter(self._loglikelihood_tokens(flat, disable_tqdm=disable_tqdm))
        totals = []
        for req, windows in zip(requests, per_request):
            total = sum(next(scores)[0] for _ in windows)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
            totals.append(total)
        return totals

    # -- generation -----------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        eos = self.tok_decode([self.eot_token_id])
        jobs = []
        for context, gen_kwargs in (req.args for req in requests):
            until, limit, sampling = _gen_settings(dict(gen_kwargs), eos)
            limit = max(1, min(limit, self.max_length - 1))  # prompt + output fit the window
            prompt = self.tok_encode(context)[-(self.max_length - limit) :] or [self.eot_token_id]
            jobs.append(Job(prompt, until, limit, sampling))
        results = [""] * len(jobs)
        # the same prompt length, no padding: the cache holds every row at the same position
        order = sorted(range(len(jobs)), key=lambda i: (-len(jobs[i].prompt), jobs[i].sampling))
        groups = _runs(order, key=lambda i: (len(jobs[i].prompt), jobs[i].sampling))
        bar = tqdm(total=len(jobs), desc="lmforge generate_until", disable=disable_tqdm)
        for group in groups:
            for batch in _chunks(group, self.batch_size):
                texts = self._generate([jobs[i] for i in batch])
                for i, text in zip(batch, texts):
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(batch))
        bar.close()
        return results

    @torch.no_grad()
    def _generate(self, jobs: list[Job]) -> list[str]:
        """Continue prompts of one length together, each until one of its stop strings, the
        end-of-text token or its token limit; the text before the first stop string."""
        prompts = torch.tensor([job.prompt for job in jobs], device=self._device)
        longest = max(job.limit for job in jobs)
        temperature, top_k = jobs[0].sampling
        generator = torch.Generator(self._device).manual_seed(1234) if temperature else None
        cache = self.model.new_cache(len(jobs), prompts.shape[1] + longest)
        logits = self.model.last_logits(prompts, cache=cache)  # prefill
        made: list[list[int]] = [[] for _ in jobs]
        done = [False] * len(jobs)
        for step in range(longest):
            tokens = sample_next(logits.float(), temperature, top_k, generator)
            for row, token in enumerate(tokens.tolist()):
                if done[row]:
                    continue
                if token == self.eot_token_id:
                    done[row] = True
                    continue
                made[row].append(token)
                text = self.tok_decode(made[row])
                stopped = any(stop and stop in text for stop in jobs[row].until)
                done[row] = stopped or len(made[row]) >= jobs[row].limit
            if all(done) or step + 1 == longest:
                break
            logits = self.model.last_logits(tokens[:, None], cache=cache)  # decode
        return [_cut(self.tok_decode(ids), job.until) for ids, job in zip(made, jobs)]


class Job(NamedTuple):
    """One generate_until request: its prompt tokens, stop strings, token limit and sampling."""

    prompt: list[int]
    until: list[str]
    limit: int
    sampling: tuple[float, int]  # (temperature, top_k); (0, 0) is greedy


def _gen_settings(kwargs: dict[str, Any], eos: str) -> tuple[list[str], int, tuple[float, int]]:
    """(stop strings with the end-of-text text, token limit, (temperature, top_k)) of a
    request's generation arguments, read as lm-eval's own models read them (greedy unless
    do_sample; max_gen_toks, else max_new_tokens, else 256)."""
    until = kwargs.get("until") or []
    until = [until] if isinstance(until, str) else list(until)
    if eos not in until:
        until.append(eos)
    limit = kwargs.get("max_gen_toks", kwargs.get("max_new_tokens", DEFAULT_GEN_TOKENS))
    temperature = float(kwargs.get("temperature") or 0.0)
    sampling = (temperature, int(kwargs.get("top_k") or 0))
    if not kwargs.get("do_sample", temperature > 0) or temperature == 0:
        sampling = (0.0, 0)
    return until, int(limit), sampling


def _usable_device(device: str | None) -> str:
    """The device asked for; lm-eval's default cuda:0 becomes the CPU where there is no GPU."""
    if not device:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        log.warning("device=%s: no CUDA device here, scoring on the CPU", device)
        return "cpu"
    return str(device)


def _batch_size(batch_size: int | str | None, max_batch_size: int | None) -> int:
    text = str(batch_size if batch_size is not None else "auto").strip().lower()
    if text.startswith("auto"):
        size = min(AUTO_BATCH, max_batch_size or AUTO_BATCH)
    elif text.isdigit() and int(text) > 0:
        size = int(text)
    else:
        raise ConfigError(f"batch_size={batch_size} is not a positive number or auto")
    return size


def _not_argmax(h: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int) -> Tensor:
    """(B,) how many of each row's targets are not the argmax of their logits, computed only at
    the target rows, chunk by chunk (no (B, T, V) logits)."""
    flat_h, flat_t = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    misses = torch.zeros(flat_t.shape, dtype=torch.long, device=h.device)
    rows = (flat_t != IGNORE_INDEX).nonzero().squeeze(1)
    w = weight.to(h.dtype)
    step = chunk_tokens if chunk_tokens > 0 else max(len(rows), 1)
    for start in range(0, len(rows), step):
        part = rows[start : start + step]
        misses[part] = ((flat_h[part] @ w.T).argmax(dim=-1) != flat_t[part]).long()
    return misses.view(targets.shape).sum(dim=1)


def _cut(text: str, until: list[str]) -> str:
    """The text before the first occurrence of any stop string."""
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text


def _chunks(items: list[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _runs(order: list[int], key: Any) -> list[list[int]]:
    """`order` cut into runs of equal key."""
    runs: list[list[int]] = []
    for i in order:
        if runs and key(runs[-1][0]) == key(i):
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def main() -> None:
    """lm-eval's command line with `lmforge` registered; user errors are one line (exit 2)."""
    from lm_eval.__main__ import cli_evaluate

    with one_line_errors():
        cli_evaluate()


if __name__ == "__main__":
    main()
