"""What the test ranks' forkserver imports once (tests/parallel/ranks.py): torch, DeepSpeed and
the test workers. An import that fails here is skipped (a rank then imports the module itself
and reports the failure in the test that needs it), so a broken optional package cannot stop
every distributed test."""

import importlib

for module in (
    "torch",
    "torch.distributed",
    "deepspeed",
    "tests.parallel.workers",
    "tests.parallel.deepspeed_workers",
    "tests.parallel.checkpoint_workers",
    "tests.parallel.tp_workers",
    "tests.parallel.tp_generation_workers",
    "tests.parallel.pp_workers",
    "parallel.pipeline",
    "parallel.tensor_parallel",
    "parallel.tensor_parallel_styles",
    "parallel.sequence_parallel",
):
    try:
        importlib.import_module(module)
    except Exception:
        continue
