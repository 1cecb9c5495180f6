"""Name -> implementation registries, so variants are chosen by config keys, not if/else chains."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from model.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """A named table of implementations (`NORMS.get("rms")`), with errors that list the choices."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(entry: T) -> T:
            if name in self._entries:
                raise KeyError(f"{self.what} {name!r} is registered twice")
            self._entries[name] = entry
            return entry

        return add

    def get(self, name: str) -> T:
        if name not in self._entries:
            raise ConfigError(
                f"unknown {self.what} {name!r}; choose one of: {', '.join(self.names())}"
            )
        return self._entries[name]

    def remove(self, name: str) -> None:
        """Unregister `name` (tests that register a temporary implementation)."""
        del self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries


# The model's registries. Implementations register themselves where they are defined; the config
# validates keys against these tables (the `model` package imports every implementation module).
NORMS: Registry = Registry("norm")
RESIDUALS: Registry = Registry("residual style")
POSITIONS: Registry = Registry("position encoding")
ROPE_SCALINGS: Registry = Registry("rope scaling")
ROPE_PAIRINGS: Registry = Registry("rope pairing")
ATTENTIONS: Registry = Registry("attention kind")  # softmax attention: attention.kind
MIXERS: Registry = Registry(
    "token mixer"
)  # every layer kind of model.layer_types (model.mixers.mixer)
FFNS: Registry = Registry("ffn kind")
