"""Independent trainer commands at once. Each is a subprocess that spends most of its time
importing on one core (one training thread), so on the 2-core CI machine two of them take
little longer than one; results come back in the order the commands were given."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def concurrently(*commands: Callable[[], Any]) -> list[Any]:
    """Runs each command (a function without arguments that starts a subprocess and waits for
    it: `partial(run_trainer, ...)`) in its own thread; their results, in order."""
    with ThreadPoolExecutor(len(commands)) as pool:
        futures = [pool.submit(command) for command in commands]
        return [future.result() for future in futures]
