"""`eval.downstream.*`: which library tasks a run scores in the loop, how often, and how much."""

from __future__ import annotations

from dataclasses import dataclass, field

from model.errors import ConfigError


@dataclass(kw_only=True)
class DownstreamConfig:
    # ai2-olmo-eval task names (e.g. [hellaswag,arc_easy,piqa]); [] = no downstream evaluation
    tasks: list[str] = field(default_factory=list)
    every: int = 0  # steps between downstream evaluations (and at step 0, the end); 0 = eval_every
    limit: int = 0  # questions per task (a fixed sample, the same in every run); 0 = all
    batch_tokens: int = 0  # tokens per scoring forward (rows x length); 0 = a micro-batch's

    def __post_init__(self) -> None:
        for key in ("every", "limit", "batch_tokens"):
            if getattr(self, key) < 0:
                raise ConfigError(f"eval.downstream.{key}={getattr(self, key)} must be >= 0")
        self.tasks = [str(t) for t in self.tasks]
        repeated = sorted({t for t in self.tasks if self.tasks.count(t) > 1})
        if repeated:
            raise ConfigError(f"eval.downstream.tasks names {', '.join(repeated)} twice")


@dataclass(kw_only=True)
class EvalConfig:
    downstream: DownstreamConfig = field(default_factory=DownstreamConfig)
