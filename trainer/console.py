"""The one rich console that the progress bar and the log handler share (so lines interleave)."""

from rich.console import Console

console = Console(stderr=True)
