"""The machine description every benchmark stores beside its numbers."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
from pathlib import Path

from trainer.mfu import cpu_model


def machine(packages: tuple[str, ...] = ("torch", "numpy"), **extra: object) -> dict:
    versions = {}
    for package in packages:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "cpu": cpu_model(),
        "cores_available": len(os.sched_getaffinity(0)),
        **extra,
        "platform": platform.platform(),
        "python": platform.python_version(),
        **versions,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def save_result(name: str, body: dict) -> Path:
    """bench/results/<name>: the body with the benchmark's name and this machine, as JSON."""
    out = Path(__file__).resolve().parent / "results" / name
    out.write_text(json.dumps({"benchmark": name, "machine": machine()} | body, indent=2) + "\n")
    print(f"wrote {out}")
    return out


def finish_validation_plot(fig, ax, title: str, path: Path) -> None:
    """Labels, legend and grid of a validation-loss-per-step plot of corpus runs; saved to path."""
    ax.set_xlabel("step (8 x 256 tokens each)")
    ax.set_ylabel("validation loss")
    ax.set_ylim(top=min(8.0, ax.get_ylim()[1]))
    ax.set_title(f"{title} (this CPU, 300 steps)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
