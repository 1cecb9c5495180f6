"""What the training loop and `python -m trainer.eval` call: score the tasks, report them."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from data.tokenizer import Tokenizer
from trainer.downstream.batches import PackedBatch, pack
from trainer.downstream.config import DownstreamConfig
from trainer.downstream.metrics import task_metrics
from trainer.downstream.scoring import LogProbs, log_likelihoods
from trainer.downstream.tasks import DownstreamTask, build_tasks

Results = dict[str, dict[str, float]]  # task -> metric -> value


class DownstreamEvaluator:
    """The run's downstream tasks, tokenized once; `evaluate` scores them all."""

    def __init__(
        self, tasks: list[DownstreamTask], batch_tokens: int, pad_id: int, every: int = 0
    ) -> None:
        self.tasks, self.batch_tokens, self.pad_id, self.every = tasks, batch_tokens, pad_id, every
        self.requests = [r for task in tasks for r in task.all_requests()]
        self.packed: list[PackedBatch] = []
        self.fixed_shapes(False)
        self.last_end: float | None = None  # when the previous evaluation ended (its share)

    def fixed_shapes(self, on: bool) -> None:
        """Pack for forwards compiled per shape (FlexAttention's): widths rounded up to
        multiples of 128 and one row count per width (trainer/downstream/batches.py)."""
        self.packed = pack(self.requests, self.batch_tokens, 128 if on else 1)

    @property
    def batches(self) -> int:
        return len(self.packed)

    @classmethod
    def build(
        cls, cfg: DownstreamConfig, tokenizer: Tokenizer, seq_len: int, micro_batch_tokens: int
    ) -> DownstreamEvaluator | None:
        """None without tasks; contexts are cut to `seq_len` (the length the model trains at)."""
        if not cfg.tasks:
            return None
        tasks = build_tasks(cfg.tasks, tokenizer, seq_len, cfg.limit)
        return cls(tasks, cfg.batch_tokens or micro_batch_tokens, tokenizer.eot_id, cfg.every)

    def due(self, step: int, last: bool, eval_every: int) -> bool:
        """At step 0 of a fresh run, every `every` steps (trainer.eval_every when 0) and at the end."""
        every = self.every or eval_every
        return last or step == 0 or bool(every and step % every == 0)

    def describe(self) -> str:
        parts = []
        for task in self.tasks:
            chance = f"chance {task.chance:.3f}" if task.chance is not None else "no chance level"
            if task.cut:
                chance += f"; {task.cut:,} continuations longer than the context, their ends scored"
            parts.append(
                f"{task.name} ({task.metric_type}; {task.questions:,} of {task.available:,} "
                f"questions, {len(task.all_requests()):,} requests; {chance})"
            )
        largest = max((b.tokens for b in self.packed), default=0)  # over budget: one request
        return (
            f"downstream evaluation: {'; '.join(parts)}; {len(self.requests):,} requests in "
            f"{self.batches:,} batches of <= {largest:,} tokens"
        )

    def evaluate(
        self,
        log_probs_of: LogProbs,
        device: torch.device,
        stop: Callable[[], bool] = lambda: False,
        progress: Callable[[int], None] | None = None,
        together: int | tuple[int, int, bool] = 1,
    ) -> Results | None:
        """Every task's metrics (the same on every rank); None when `stop` interrupted it.
        `together`: ranks that run one forward together (scoring.log_likelihoods)."""
        sums = self.log_likelihoods(log_probs_of, device, stop, progress, together)
        if sums is None:
            return None
        results: Results = {}
        offset = 0
        for task in self.tasks:
            n = len(task.requests)
            own, offset = sums[offset : offset + n], offset + n
            dc = None
            if task.dc_requests:
                dc, offset = sums[offset : offset + n], offset + n
            results[task.name] = task_metrics(task, own, dc)
        return results

    def log_likelihoods(
        self,
        log_probs_of: LogProbs,
        device: torch.device,
        stop: Callable[[], bool] = lambda: False,
        progress: Callable[[int], None] | None = None,
        together: int | tuple[int, int, bool] = 1,
    ) -> torch.Tensor | None:
        """Every request's summed continuation log-probability (trainer.downstream.scoring)."""
        return log_likelihoods(
            log_probs_of, self.requests, self.packed, self.pad_id, device, stop, progress, together
        )

    def share(self, seconds: float) -> float | None:
        """This evaluation's share of the time since the previous one ended (None the first
        time); marks the end of this one."""
        now = time.perf_counter()
        share = seconds / max(now - self.last_end, 1e-9) if self.last_end is not None else None
        self.last_end = now
        return share

    def row(self, results: Results) -> dict[str, float]:
        """metrics.jsonl / wandb keys: downstream/<task>/<metric>."""
        return {
            f"downstream/{task}/{metric}": value
            for task, values in results.items()
            for metric, value in values.items()
        }

    def summary(self, results: Results) -> str:
        """Each task's primary metric against chance, for the log."""
        parts = []
        for task in self.tasks:
            value = results[task.name][task.metric_type]
            chance = f" (chance {task.chance:.3f})" if task.chance is not None else ""
            parts.append(f"{task.name} {task.metric_type} {value:.4f}{chance}")
        return ", ".join(parts)
