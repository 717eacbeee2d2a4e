"""A tiny name -> factory registry, used instead of if/elif chains on policy names.

Callers: `radix_sync.policy.routers` registers router policies; `radix_sync.sim.policies` registers the simulator's
named policy bundles; `radix_sync.coordinator.policies` registers the coordinator's live policies.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps a name to a factory returning a fresh object."""

    def __init__(self, kind: str) -> None:
        self._kind = kind
        self._factories: dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Decorator registering `factory` under `name`.

        Args:
            name: the public name (e.g. a `--policies` entry).
        Returns:
            the decorator, which returns the factory unchanged.
        """

        def deco(factory: Callable[..., T]) -> Callable[..., T]:
            if name in self._factories:
                raise ValueError(f"{self._kind} {name!r} is registered twice")
            self._factories[name] = factory
            return factory

        return deco

    def create(self, name: str, *args, **kwargs) -> T:
        """Builds a fresh object registered under `name`.

        Args:
            name: a registered name.
        Returns:
            what the factory returns.
        """
        try:
            factory = self._factories[name]
        except KeyError:
            raise ValueError(f"unknown {self._kind} {name!r}; known: {', '.join(self.names())}") from None
        return factory(*args, **kwargs)

    def names(self) -> list[str]:
        """Returns: the registered names, in registration order."""
        return list(self._factories)
