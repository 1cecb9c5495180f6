"""The training loop: steps, logging rows, evaluation, checkpoints, stop signals, bad steps.

`Training` holds what `trainer.app.build_training` made; `run()` trains from the current step
to `loop.max_steps` (trainer.max_steps) and returns the process exit code (0 done or stopped by a signal, 1 too
many bad steps).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from data.loader import Batch, TokenLoader
from model.config import ModelConfig
from model.training_hooks import TrainingHook
from optim.schedules import Schedule
from parallel.collective import from_main, worst_over_ranks
from parallel.engine import TrainingEngine
from trainer.checkpoint.record import protect
from trainer.checkpoint.save import Checkpointer
from trainer.config import EVAL_COMPILE_MIN_BATCHES, compiles_evaluation, evaluations_left
from trainer.downstream.evaluator import DownstreamEvaluator
from trainer.evaluate import perplexity, sample_text, validation_loss
from trainer.metrics import MetricsFile, memory_bytes
from trainer.mfu import peak_cache
from trainer.plot import plot_downstream, plot_losses
from trainer.progress import RunClock, progress_bar, summary
from trainer.run_settings import LoopSettings
from trainer.runtime import Ranks, rng_state
from trainer.signals import StopFlag
from trainer.slurm import requeue_slurm_job
from trainer.step import LossTracker, StepSettings, train_step
from trainer.wandb_run import WandbRun

log = logging.getLogger("trainer")


@dataclass
class Training:
    loop: LoopSettings  # the run's settings the loop reads (trainer.run_settings)
    run_dir: Path
    ranks: Ranks
    device: torch.device
    engine: TrainingEngine  # the model, its optimizer and how they step (parallel.engine)
    model_cfg: ModelConfig  # the resolved model config (vocabulary included)
    schedule: Schedule  # lr and Muon momentum per step (optim.schedules)
    settings: StepSettings  # micro-batches, clipping, document masking (every step)
    loader: TokenLoader
    flops_per_token: float
    peak_flops: float
    metrics: MetricsFile
    wandb: WandbRun
    stop: StopFlag
    checkpointer: Checkpointer
    step: int = 0
    tokens: int = 0
    bad_streak: int = 0
    skipped_total: int = 0
    tracker: LossTracker = field(default_factory=lambda: LossTracker(0.0))
    config_yaml: str = ""
    pre_streak: Path | None = None  # the newest checkpoint before the current bad streak
    phase: str = "start-up"  # what the loop is doing (named when a collective times out)
    restored_step: int = -1  # the step of the checkpoint this run resumed from
    eval_coverage: dict[str, int] = field(default_factory=dict)  # val_windows, val_tokens, ...
    compiled_evaluation: bool = False  # validation forwards compiled (a compiled run's choice)
    val_loss: float | None = None  # the last validation loss
    clock: RunClock | None = None  # this process's training time (trainer.progress)
    mfu_warned: bool = False  # an MFU above 100% was reported (once)
    sample_prompt: str = ""  # the evaluation sample's prompt (trainer.sample_prompt or the data's)
    # the features' part in each step (model.training_hooks), assembled once by trainer.hooks
    hooks: list[TrainingHook] = field(default_factory=list)
    downstream: DownstreamEvaluator | None = None  # eval.downstream.tasks (trainer/downstream/)

    @property
    def model(self) -> torch.nn.Module:
        """The model the loop runs (possibly sharded)."""
        return self.engine.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.engine.optimizer

    @property
    def state_model(self) -> torch.nn.Module:
        """What checkpoints hold and the optimizer updates: the fp32 master copy if there is one."""
        return self.engine.state_module

    # -- state ---------------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens": self.tokens,
            "bad_streak": self.bad_streak,
            "skipped_total": self.skipped_total,
            "loss_tracker": self.tracker.state_dict(),
            "loader": self.loader.state_dict(),
            "rng": rng_state(),
            "wandb_id": self.wandb.id,
            "config": self.config_yaml,
            "model_config": dataclasses.asdict(self.model_cfg),
            "tokenizer_dir": str(self.loader.manifest.root / "tokenizer"),
            "tokenizer": self.loader.manifest.tokenizer.to_dict(),
        }

    def save(self, reason: str, final: bool = False) -> bool:
        """Checkpoint now; `final` (end, stop, give-up) also waits for a background write.
        False when the weights hold non-finite values: those are never saved (the newest good
        checkpoint is protected instead)."""
        if self.step == self.restored_step and self.checkpointer.last_committed is not None:
            # nothing happened since the resume (a stop signal right away): that checkpoint
            # is this state, and replacing it would leave a moment with no checkpoint at all
            log.info(
                "checkpoint %s already holds this state (%s)",
                self.checkpointer.last_committed,
                reason,
            )
            return True
        if problem := self._nonfinite_weights():
            good = self._protect_newest(
                f"the last checkpoint before non-finite weights at step {self.step}"
            )
            log.error(
                "not saving a checkpoint at step %d (%s): %s. The newest good checkpoint is %s "
                "(kept whatever checkpoint.keep says); resume=auto continues from it",
                self.step, reason, problem, good or "none (nothing was saved before)",
            )  # fmt: skip
            return False
        path = self.checkpointer.save(self.step, self.engine, self.extra_state())
        if self.checkpointer.async_save and not final:
            log.info("checkpoint %s writing in the background (%s)", path, reason)
            return True
        self.checkpointer.wait()
        log.info("checkpoint %s saved (%s)", path, reason)
        return True

    def _nonfinite_weights(self) -> str:
        """What is non-finite in the weights, agreed by every rank ("" when nothing is)."""
        names = self.engine.nonfinite_weights()
        total = sum(1 for _ in self.engine.state_module.parameters())
        mine = f"{len(names)} of {total} weight tensors hold NaN or inf ({', '.join(names[:3])}"
        mine += ", ...)" if len(names) > 3 else ")"
        return worst_over_ranks(int(bool(names)), mine if names else "")[1]

    def _protect_newest(self, reason: str) -> Path | None:
        """Protect the newest committed checkpoint (the pre-streak one during a bad streak)."""
        self.checkpointer.wait()
        good = self.pre_streak if self.bad_streak else self.checkpointer.last_committed
        good = from_main(good if good is not None and good.is_dir() else None)
        if good is not None and self.ranks.is_main:
            protect(good, reason)
        return good

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> int:
        loop = self.loop
        tokens_per_step = loop.tokens_per_step
        batches = iter(self.loader)
        self._decide_evaluation_compile()
        self.phase = "the evaluation at step 0"
        if self.step == 0 and not self._evaluate():  # the starting validation loss
            return self._stop_now()
        if self._downstream_missing() and not self._evaluate_downstream():
            return self._stop_now()
        window = _Window()  # opened after that evaluation: it is not training time either
        self.clock = RunClock(self.step)
        if loop.compiled and self.step < loop.max_steps:
            log.info("compiling the model (torch.compile): the first steps take longer")
        bar = self.ranks.is_main and loop.progress
        with progress_bar(bar) as progress:
            first = "compiling" if loop.compiled else "training"
            task = progress.add_task(first, total=loop.max_steps, completed=self.step)
            while self.step < loop.max_steps:
                self.phase = f"training step {self.step + 1}"
                if self.stop.requested():
                    return self._stop_now()
                waited = time.perf_counter()
                batch = next(batches).to(self.device, non_blocking=True)
                window.data_wait += time.perf_counter() - waited
                lr = self.schedule.apply(self.engine.optimizer, self.step)
                for hook in self.hooks:  # over the schedule's run length, as the lr is
                    hook.before_step(self.step, self.schedule.total_steps)
                result = train_step(self.engine, batch, self.settings, self.tracker, self.hooks)
                self.step += 1
                self.tokens += tokens_per_step
                window.add(result.loss, result.grad_norm, tokens_per_step, result.skip_kind)
                window.metrics = result.metrics or window.metrics
                progress.update(task, completed=self.step, description=f"loss {result.loss:.3f}")
                if result.skipped and self._bad_step(result.skipped):
                    return 1
                if not result.skipped:
                    self.bad_streak = 0
                last = self.step == loop.max_steps
                if self.step % loop.log_every == 0 or last:
                    self._log_row(window, lr)
                    window = _Window()
                paused = time.perf_counter()  # evaluation and saving are not training time
                evaluate = (loop.eval_every and self.step % loop.eval_every == 0) or last
                self.phase = f"the evaluation at step {self.step}"
                if evaluate:
                    progress.update(task, description="evaluating")
                if evaluate and not self._evaluate():
                    continue  # stopped inside evaluation: the next check saves and exits
                if self._downstream_due(last):
                    progress.update(task, description="downstream evaluation")
                    if not self._evaluate_downstream():
                        continue
                self.phase = f"the checkpoint at step {self.step}"
                if not self._checkpoint_after_step(last):  # the end, on non-finite weights
                    self.wandb.finish()
                    return 1
                window.start += time.perf_counter() - paused
                self._maybe_inject_fault()
        self.phase = "the end of training"
        if self.stop.requested():  # stopped inside the last evaluation: save before leaving
            return self._stop_now()
        self.wandb.finish()
        checkpoint = self.checkpointer.last_committed
        for line in summary(
            self.step, self.clock, self.skipped_total, self.val_loss, self.run_dir, checkpoint
        ):
            log.info("%s", line)
        return 0

    def _checkpoint_after_step(self, last: bool) -> bool:
        """Save at the end or on schedule (postponed while steps are being skipped), else
        commit a finished background write; False when the run must end as failed."""
        every = self.loop.checkpoint_every
        due = bool(every) and self.step % every == 0
        if last:
            return self._end_in_streak() if self.bad_streak else self.save("end of training", True)
        if due and self.bad_streak:
            log.info(
                "checkpoint at step %d postponed: the last %d step(s) were skipped",
                self.step,
                self.bad_streak,
            )
        elif due:
            self.save("scheduled")
        elif committed := self.checkpointer.poll():
            log.info("checkpoint %s saved (background write finished)", committed)
        return True

    def _end_in_streak(self) -> bool:
        """The run ends while its last steps were skipped: the checkpoint from before them is
        protected (the streak's rule), and the weights now, those of before the skipped steps,
        are saved if they are finite (never if not). False when they are not (the run failed)."""
        first_bad = self.step - self.bad_streak + 1
        good = self._protect_newest(
            f"the last good state before the skipped steps from {first_bad}"
        )
        kept = f"{good} is kept whatever checkpoint.keep says" if good else "none was saved before"
        log.warning(
            "training ended with %d skipped step(s) in a row (from step %d); the checkpoint from "
            "before them: %s",
            self.bad_streak, first_bad, kept,
        )  # fmt: skip
        return self.save(f"end of training, after {self.bad_streak} skipped step(s)", final=True)

    def _stop_now(self) -> int:
        self.save(f"{self.stop.name()} received", final=True)
        log.info("stopped by %s at step %d; resume continues here", self.stop.name(), self.step)
        self.wandb.finish()
        if self._requeue() and os.environ.get("SUBMITIT_EXECUTOR"):
            # under Hydra's submitit launcher a returned job counts as done: leave without a
            # result, so that the sweep waits for the requeued run's
            log.info("submitit job requeued: the requeued run reports the result")
            raise SystemExit(0)
        return self.stop.exit_code()

    def _requeue(self) -> bool:
        """Under SLURM, after the pre-timeout signal of an unfinished run: requeue the job."""
        finished = self.step >= self.loop.max_steps
        if not (self.loop.requeue and self.stop.requeue_wanted()) or finished:
            return False
        return requeue_slurm_job(self.ranks)

    def _bad_step(self, reason: str) -> bool:
        """Count a skipped step; True when the run must stop."""
        self.bad_streak += 1
        self.skipped_total += 1
        if self.bad_streak == 1:  # what was saved before this streak is the last good state
            self.checkpointer.wait()
            self.pre_streak = self.checkpointer.last_committed
        log.warning("step %d skipped: %s (%d in a row)", self.step, reason, self.bad_streak)
        limit = self.loop.max_bad_steps
        if self.bad_streak < limit:
            return False
        first_bad = self.step - self.bad_streak + 1
        good = from_main(self.pre_streak if self.pre_streak and self.pre_streak.is_dir() else None)
        # nothing saved yet: the weights now are those before the streak (saved if finite)
        if good is None and self.save("the state before the skipped steps", final=True):
            good = self.checkpointer.last_committed
        if good is not None and self.ranks.is_main:
            protect(good, f"the last good state before the skipped steps from {first_bad}")
        log.error(
            "stopping: %d consecutive steps skipped (trainer.max_bad_steps=%d), the last because "
            "%s. The last good checkpoint is %s, from before the first skipped step %d; it is kept "
            "whatever checkpoint.keep says, and resume=auto continues from it. Lower optim.lr, "
            "check the data around step %d, or raise trainer.max_bad_steps",
            self.bad_streak,
            limit,
            reason,
            good,
            first_bad,
            first_bad,
        )
        self.wandb.finish()
        return True

    def _log_row(self, window: _Window, lr: float) -> None:
        elapsed = max(time.perf_counter() - window.start, 1e-9)
        tokens_per_s = window.tokens / elapsed
        self.clock.add_window(elapsed, window.tokens)
        mem_key, mem = memory_bytes(self.device)
        row = {
            "step": self.step,
            "loss": window.mean_loss(),
            "lr": lr,
            "grad_norm": window.mean_norm(),
            "tokens": self.tokens,
            "tokens_per_s": tokens_per_s,
            "mfu": self.flops_per_token * tokens_per_s / (self.peak_flops * self.ranks.world_size),
            "data_wait_s": window.data_wait,
            "skipped_steps": self.skipped_total,
            **{f"skipped/{kind}": n for kind, n in window.skip_kinds.items()},
            **({"skipped_loss": window.skipped_loss} if window.skip_kinds else {}),
            mem_key: mem,
            **window.metrics,  # the last step's hook metrics (moe/..., mtp/..., qk/..., attnres/...)
        }
        self._emit(row)
        if row["mfu"] > 1 and not self.mfu_warned:  # the achieved rate bounds the peak from below
            self.mfu_warned = True
            log.warning(
                "MFU above 100%% (%.0f%%): the peak of %.3g FLOP/s is too low (measured while "
                "the machine was busy?); set trainer.peak_flops, or delete %s to measure again",
                100 * row["mfu"], self.peak_flops, peak_cache(),
            )  # fmt: skip
        log.info(
            "step %d/%d  loss %.4f  lr %.2e  grad_norm %.3f  %.0f tok/s  mfu %.1f%%  data wait "
            "%.2fs  %s",
            self.step,
            self.loop.max_steps,
            row["loss"],
            lr,
            row["grad_norm"],
            tokens_per_s,
            100 * row["mfu"],
            window.data_wait,
            self.clock.where(self.step, self.loop.max_steps),
        )

    def _emit(self, row: dict[str, Any]) -> None:
        if self.ranks.is_main:
            self.metrics.write(row)
            self.wandb.log(row, self.step)

    def _evaluate(self) -> bool:
        """Validation loss (+ sample, plot); False when a stop signal interrupted it. Skipped,
        in one line, on non-finite weights."""
        if problem := self._nonfinite_weights():
            log.warning("evaluation and sample at step %d skipped: %s", self.step, problem)
            return True
        with self.engine.evaluating():  # evaluation mode inside, training mode after
            with self._eager_stance(validation=True):
                if self.loader.val_batches and not self._validate():
                    return False
            # every rank samples (the same tokens, from the same seed): under FSDP or expert
            # parallelism each forward is collective, so rank 0 cannot run it alone
            if self.loop.sample_tokens:
                with self._eager_stance(validation=False):
                    text = sample_text(
                        self.engine,
                        self.loader.tokenizer,
                        self.sample_prompt,
                        self.loop.sample_tokens,
                        self.device,
                        seed=self.loop.seed + self.step,
                    )
                if text is None:
                    log.warning(
                        "sample at step %d skipped: the model's outputs are not finite", self.step
                    )
                else:
                    log.info("sample at step %d: %r", self.step, text)
        if self.ranks.is_main:
            plot_losses(self.metrics.rows(), self.run_dir / "loss.png")
        return True

    def _downstream_due(self, last: bool) -> bool:
        d = self.downstream
        return d is not None and d.due(self.step, last, self.loop.eval_every)

    def _downstream_missing(self) -> bool:
        """Before the first step: a fresh run's step-0 evaluation, or one due at the resumed
        step that metrics.jsonl lacks (a stop signal interrupted it, and the run saved there)."""
        if not self._downstream_due(last=self.step >= self.loop.max_steps):
            return False
        if self.step == 0:
            return True
        done = self.ranks.is_main and any(
            r.get("step") == self.step and "downstream_s" in r for r in self.metrics.rows()
        )
        return not from_main(done)

    def _evaluate_downstream(self) -> bool:
        """Score the downstream tasks (eval.downstream): one metrics row, a log line with the
        time it took, downstream.png; False when a stop signal interrupted it."""
        assert self.downstream is not None
        self.phase = f"the downstream evaluation at step {self.step}"
        if problem := self._nonfinite_weights():
            log.warning("downstream evaluation at step %d skipped: %s", self.step, problem)
            return True
        started = time.perf_counter()
        # as the validation forwards: eager, or compiled where _decide_evaluation_compile chose
        with self.engine.evaluating(), self._eager_stance(validation=True):
            results = self.downstream.evaluate(
                self.engine.evaluation_log_probs,
                self.device,
                self.stop.requested,
                together=self.engine.scoring_share(),
            )
        if results is None:
            return False
        seconds = time.perf_counter() - started
        share = self.downstream.share(seconds)
        row = {"step": self.step, "tokens": self.tokens, **self.downstream.row(results)}
        self._emit(row | {"downstream_s": seconds})
        cost = f"{seconds:.1f} s" + (
            f", {100 * share:.1f}% of the time since the last" if share else ""
        )
        log.info(
            "downstream at step %d (%s): %s", self.step, cost, self.downstream.summary(results)
        )
        if self.ranks.is_main:
            plot_downstream(
                self.metrics.rows(), self.downstream.tasks, self.run_dir / "downstream.png"
            )
        return True

    def _decide_evaluation_compile(self) -> None:
        """In a compiled run, whether this process's validation forwards run compiled
        (trainer.config.compiles_evaluation, from the batches they will forward); logged."""
        loop = self.loop
        if not loop.compiled:
            return  # compiled_evaluation stays False: nothing is compiled
        per_evaluation = 0
        if self.loader.val_batches:  # no validation split: no evaluation forwards at all
            per_evaluation = self.loader.val_batches + self.loader.train_sample.batches
        batches = evaluations_left(loop.max_steps, loop.eval_every, self.step) * per_evaluation
        # FlexAttention is itself a compiled function: its models keep compiled validation
        flex = self.model_cfg.attention.backend == "flex"
        self.compiled_evaluation = (
            compiles_evaluation(loop.compiled, loop.compile_eval, batches) or flex
        )
        how = "compiled" if self.compiled_evaluation else "eager"
        log.info(
            "evaluation forwards %s (%s: %d evaluation batches left, auto compiles from %d); "
            "samples eager",
            how,
            "FlexAttention" if flex else f"trainer.compile_eval={loop.compile_eval}",
            batches,
            EVAL_COMPILE_MIN_BATCHES,
        )

    def _eager_stance(self, validation: bool) -> contextlib.AbstractContextManager:
        """In a compiled run, samples and (unless _decide_evaluation_compile chose otherwise)
        validation forwards run eagerly: no inference or decoding compile."""
        if not self.loop.compiled or (validation and self.compiled_evaluation):
            return contextlib.nullcontext()
        return torch.compiler.set_stance("force_eager")

    def _validate(self) -> bool:
        """One evaluation row (validation loss, and the loss on the fixed training sample) and
        its log line; False when a stop signal interrupted it."""
        started = time.perf_counter()
        val = self._sample_loss(self.loader.validation())
        if val is None:
            return False
        row = {
            "step": self.step,
            "tokens": self.tokens,
            "val_loss": val,
            "val_ppl": perplexity(val),
        }
        row |= self.eval_coverage
        line = f"step {self.step}  validation loss {val:.4f}  perplexity {row['val_ppl']:.1f}"
        if self.loader.train_sample.batches:
            train = self._sample_loss(self.loader.train_eval())
            if train is None:
                return False
            row["train_eval_loss"] = train
            line += f"  (training sample {train:.4f})"
        row["eval_s"] = time.perf_counter() - started  # both losses, data included
        self.val_loss = val
        self._emit(row)
        log.info("%s", line)
        return True

    def _sample_loss(self, batches: Iterator[Batch]) -> float | None:
        return validation_loss(
            self.engine.evaluation_loss,
            batches,
            self.device,
            self.settings.doc_mask,
            self.stop.requested,
        )

    def _maybe_inject_fault(self) -> None:
        """trainer.fault_step: SIGKILL this process once at that step (tests of exact resume and
        of torchrun's restarts); trainer.fault_rank picks one rank."""
        if self.step != self.loop.fault_step:
            return
        if self.loop.fault_rank not in (-1, self.ranks.rank):
            return
        marker = self.run_dir / f".fault_step_{self.step}_rank{self.ranks.rank}"
        if marker.exists():
            return
        marker.touch()
        log.warning("fault injection: SIGKILL at step %d", self.step)
        os.kill(os.getpid(), signal.SIGKILL)


class _Window:
    """Sums over the steps since the last log row."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.tokens = 0
        self.data_wait = 0.0
        self.metrics: dict[str, float] = {}  # the last step's training-hook metrics
        self.skip_kinds: dict[str, int] = {}  # why steps of this window were skipped
        self.skipped_loss = float("nan")  # the loss of the last skipped step, as measured

    def add(self, loss: float, norm: float, tokens: int, skip_kind: str) -> None:
        self.tokens += tokens
        if skip_kind:
            self.skip_kinds[skip_kind] = self.skip_kinds.get(skip_kind, 0) + 1
            self.skipped_loss = loss
        else:
            self.losses.append(loss)
            self.norms.append(norm)

    def mean_loss(self) -> float:
        return sum(self.losses) / len(self.losses) if self.losses else float("nan")

    def mean_norm(self) -> float:
        return sum(self.norms) / len(self.norms) if self.norms else float("nan")
