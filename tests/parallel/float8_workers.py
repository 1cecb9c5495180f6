"""What each rank runs in the float8 tests (tests/parallel/test_float8.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.parallel.workers import small_model, train

TENSORWISE = {"recipe": "tensorwise"}


def run(rank: int, preset: str, layout: dict[str, Any], recipe: str, steps: int) -> dict:
    """`steps` float8 steps of `preset` in `layout`, with what the ranks built: the classes of
    the converted modules and of their weights' local tensors (torchao's float8 all-gather
    wrapper under FSDP2), and the tensor-parallel styles' input hooks."""
    micro = 2 if "pp" in layout else 1  # (a pipeline and its one-process reference)
    cfg = small_model(preset, **({"n_layers": 4} if preset == "tiny_hybrid" else {}))
    return train(rank, cfg, layout, steps, micro, "float8", float8={"recipe": recipe})


def resumes_across_precisions(rank: int, root: str) -> dict:
    """Two tensorwise float8 steps on the ranks (FSDP2 gathering float8 weights), saved, resumed
    in bf16; two bf16 steps saved, resumed in float8."""
    cfg = small_model()
    f8 = train(rank, cfg, {}, 2, 1, "float8", save_to=f"{root}/f8", float8=TENSORWISE)
    bf16 = train(rank, cfg, {}, 1, 1, "bf16", resume_from=_step(root, "f8"))
    plain = train(rank, cfg, {}, 2, 1, "bf16", save_to=f"{root}/bf16")
    back = train(rank, cfg, {}, 1, 1, "float8", resume_from=_step(root, "bf16"), float8=TENSORWISE)
    return {"f8": f8, "bf16": bf16, "plain": plain, "back": back}


def _step(root: str, name: str) -> str:
    (path,) = Path(root, name).glob("step_*")
    return str(path)
