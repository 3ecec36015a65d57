"""The one name -> object table of the project: policy losses, token losses, advantage modes, mask
schemes and tasks are all registered and looked up through :class:`Registry`."""

from __future__ import annotations

import difflib
from typing import Any, Callable, Dict, Generic, Optional, Tuple, TypeVar

F = TypeVar("F")
_MISSING = object()


def unknown_name_error(kind: str, name: str, valid: Tuple[str, ...]) -> ValueError:
    """ValueError listing the valid names, closest match to ``name`` first."""
    ranked = difflib.get_close_matches(str(name), valid, n=len(valid), cutoff=0.0)
    ranked += [v for v in valid if v not in ranked]
    return ValueError(f"unknown {kind} {name!r}; valid names (closest first): {', '.join(ranked)}")


class Registry(Generic[F]):
    """Name -> object table with a ``register`` decorator.

    ``unknown`` builds the error of :meth:`get` for a name that is not registered (default:
    :func:`unknown_name_error`, valid names closest first). Registering a taken name raises
    unless ``overwrite=True``, or unless it is the very same object again (a module imported twice).
    """

    def __init__(self, kind: str, *, unknown: Optional[Callable[[str, Tuple[str, ...]], Exception]] = None) -> None:
        self.kind = kind
        self._unknown = unknown or (lambda name, valid: unknown_name_error(kind, name, valid))
        self._table: Dict[str, F] = {}

    def add(self, name: str, obj: F, *, overwrite: bool = False) -> F:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._table and not overwrite and self._table[name] is not obj:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._table[name] = obj
        return obj

    def register(self, name: str, *, overwrite: bool = False) -> Callable[[F], F]:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        return lambda obj: self.add(name, obj, overwrite=overwrite)

    def get(self, name: str, default: Any = _MISSING) -> F:
        """The object registered as ``name``; the ``unknown`` error, or ``default`` when one is given."""
        try:
            return self._table[name]
        except (KeyError, TypeError):
            if default is not _MISSING:
                return default
            raise self._unknown(name, self.names()) from None

    def pop(self, name: str, default: Any = _MISSING) -> F:
        """Unregister ``name`` (tests and plugins that add a temporary entry)."""
        if default is _MISSING:
            self.get(name)
        return self._table.pop(name, default)

    # the mapping protocol, so ``monkeypatch.setitem(registry, name, obj)`` works in tests
    __getitem__ = get

    def __setitem__(self, name: str, obj: F) -> None:
        self.add(name, obj, overwrite=True)

    def __delitem__(self, name: str) -> None:
        self.pop(name)

    def names(self) -> Tuple[str, ...]:
        return tuple(sorted(self._table))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._table
