"""`loss.png`: training and validation loss against tokens seen."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from data.atomic import atomic_write_bytes


def plot_losses(rows: list[dict[str, Any]], path: Path) -> None:
    import io

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
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
