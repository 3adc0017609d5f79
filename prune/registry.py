"""One registry type for every strategy looked up by name (lm-eval's ``api/registry.py``, PEFT's method table).

Scores, selections, replacement methods, distillation losses, post-surgery steps and ``eval.bench``
subcommands are each one :class:`Registry`. Registering a name twice is a bug in the code that does it
(``ValueError``); asking for an unknown name is the user's mistake (a one-line :class:`LayercutError`
that lists the known names).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from prune.errors import LayercutError

T = TypeVar("T")


class Registry(Generic[T]):
    """Named entries of one kind, in registration order (the order help texts and errors list them in).

    Args:
        kind: what an entry is, as the user calls it (``"score"``, ``"replacement"``): it starts the
            unknown-name error, ``unknown score 'x': choose one of ...``.
        flag: the option that takes the name (``"--score"``), named in that error when given.
    """

    def __init__(self, kind: str, flag: str | None = None):
        self.kind = kind
        self.flag = flag
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T) -> T:
        """Add ``entry`` under ``name``; returns it.

        Raises:
            ValueError: ``name`` is already registered.
        """
        if name in self._entries:
            raise ValueError(f"{self.kind} '{name}' is already registered")
        self._entries[name] = entry
        return entry

    def decorator(self, name: str, wrap: Callable[[Callable], T] | None = None) -> Callable[[Callable], Callable]:
        """A decorator registering the function it decorates (or ``wrap(function)``) as ``name``."""

        def add(fn: Callable) -> Callable:
            self.register(name, wrap(fn) if wrap is not None else fn)
            return fn

        return add

    def unregister(self, name: str) -> None:
        """Remove ``name`` if present (tests that register a toy)."""
        self._entries.pop(name, None)

    def get(self, name: str) -> T:
        """The entry registered as ``name``.

        Raises:
            LayercutError: no such entry; the one-line message lists the known names.
        """
        try:
            return self._entries[name]
        except (KeyError, TypeError):  # TypeError: a recipe's list or mapping where a name goes
            where = f" ({self.flag})" if self.flag else ""
            raise LayercutError(f"unknown {self.kind} '{name}'{where}: choose one of {', '.join(self._entries)}") \
                from None

    def names(self) -> list[str]:
        """The registered names, in registration order."""
        return list(self._entries)

    def items(self):
        """``(name, entry)`` pairs, in registration order."""
        return self._entries.items()

    def values(self):
        """The entries, in registration order."""
        return self._entries.values()

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, name: str) -> T:
        return self._entries[name]
