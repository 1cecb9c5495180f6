"""What each rank runs in the float8 tests (tests/parallel/test_float8.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.parallel.workers import small_model, train

TENSORWISE = {"recipe": "tensorwise"}


def run(rank: int, preset: str, layout: dict[str, Any], recipe: str, steps: int) -> dict:
    """`steps` float8 steps of `preset` in `layout`, with what the ranks built: the classes of
    the converted modules and of their weights' local tensors (torchao's float8 all-gather
    wrapper under FSDP2, `train`'s result), the conversion's summary and the tensor-parallel
    styles the float8 linears took (recorded from parallel/compose.py and tensor_parallel.py)."""
    import parallel.compose as compose
    import parallel.tensor_parallel as tensor_parallel

    summaries, styles = [], set()
    convert, style_of = compose.convert_to_float8, tensor_parallel.float8_tp_style

    def recorded_convert(*args, **kwargs):
        plan = convert(*args, **kwargs)
        summaries.append(plan.summary())
        return plan

    def recorded_style(style, module):
        chosen = style_of(style, module)
        styles.add(chosen.__name__)
        return chosen

    compose.convert_to_float8, tensor_parallel.float8_tp_style = recorded_convert, recorded_style
    try:
        micro = 2 if "pp" in layout else 1  # (a pipeline and its one-process reference)
        layers = {"n_layers": 4} if preset == "tiny_hybrid" else {}
        out = train(rank, small_model(preset, **layers), layout, steps, micro, "float8", float8={"recipe": recipe})  # fmt: skip
    finally:
        compose.convert_to_float8, tensor_parallel.float8_tp_style = convert, style_of
    return out | {"summary": "\n".join(summaries), "tp_styles": sorted(styles)}


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
