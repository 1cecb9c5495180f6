"""What the scoring commands (`trainer.eval`, `trainer.lm_eval_model`) do with a user's mistake:
one line on stderr, no traceback; exit 2 for the input's fault (a setting, a path, a tokenizer),
a checkpoint's own exit code for a checkpoint that cannot be read."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from data.errors import DataError
from model.errors import ConfigError
from trainer.checkpoint.errors import CheckpointError


@contextmanager
def one_line_errors() -> Iterator[None]:
    try:
        yield
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
