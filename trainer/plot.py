"""`loss.png`: training and validation loss against tokens seen; `downstream.png`: task scores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from data.atomic import atomic_write_bytes


def plot_losses(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["tokens"], r["loss"]) for r in rows if isinstance(r.get("loss"), float)]
    val = [(r["tokens"], r["val_loss"]) for r in rows if isinstance(r.get("val_loss"), float)]
    sample = [
        (r["tokens"], r["train_eval_loss"])
        for r in rows
        if isinstance(r.get("train_eval_loss"), float)
    ]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", linewidth=1.5)
    if sample:
        ax.plot(*zip(*sample), "s--", label="training sample (evaluated)", linewidth=1.2)
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)


def plot_downstream(rows: list[dict[str, Any]], tasks: list, path: Path) -> None:
    """`downstream.png`: each task's primary metric against tokens, its chance level dashed.
    `tasks`: trainer.downstream.tasks.DownstreamTask (name, metric_type, chance)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for task in tasks:
        key = f"downstream/{task.name}/{task.metric_type}"
        points = [(r["tokens"], r[key]) for r in rows if isinstance(r.get(key), float)]
        if not points:
            continue
        (line,) = ax.plot(*zip(*points), "o-", label=f"{task.name} ({task.metric_type})")
        if task.chance is not None:
            ax.axhline(task.chance, color=line.get_color(), linestyle="--", linewidth=0.8)
    ax.set_xlabel("tokens")
    ax.set_ylabel("score (dashed: chance)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def _save(fig: Any, path: Path) -> None:
    import io

    import matplotlib.pyplot as plt

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
