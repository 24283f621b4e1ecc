"""gradkit's caches: bounded, least recently used first out, cleared by ``jax.clear_caches()``.

Every per-signature cache of gradkit (an overridden function's programs, its
rule replacements, a named op's or ``custom_gradient`` function's compiled
signatures) is an :class:`LRU`. The bound is the one JAX uses for its own
tracing caches (``weakref_lru_cache``'s 2048 entries), so a long run that keeps
producing new signatures (new static values, new shapes) holds as much as
``jax.jit`` would and no more. Each cache registers with JAX's cache registry,
so ``jax.clear_caches()`` empties it too; where a JAX version has no such hook
(``compat.register_cache`` says), ``Overridden.clear_cache()`` does it by hand.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable
from typing import Generic, NamedTuple, TypeVar

from gradkit._src import compat

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

#: JAX's own bound for its tracing caches (``jax._src.util.weakref_lru_cache``).
MAXSIZE = 2048


class LRUInfo(NamedTuple):
    """``functools.lru_cache``'s counters, the form JAX's cache registry reads."""

    hits: int
    misses: int
    maxsize: int
    currsize: int


class LRU(Generic[K, V]):
    """A thread-safe mapping of at most ``maxsize`` entries; the least recently used goes first.

    Examples:
      >>> from gradkit._src.core.cache import LRU
      >>> c = LRU[str, int]("example", maxsize=2)
      >>> c.get_or_make("a", lambda: 1), c.get_or_make("b", lambda: 2), c.get_or_make("c", lambda: 3)
      (1, 2, 3)
      >>> c.get("a") is None, len(c)
      (True, 2)
    """

    def __init__(self, for_what: str, maxsize: int = MAXSIZE) -> None:
        if maxsize < 1:
            raise ValueError(f"LRU maxsize must be at least 1, got {maxsize}")
        self.maxsize = maxsize
        self._data: collections.OrderedDict[K, V] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        compat.register_cache(self, f"gradkit: {for_what}")

    def get(self, key: K) -> V | None:
        """The value for ``key`` (now the most recently used), or ``None``."""
        with self._lock:
            try:
                value = self._data[key]
            except KeyError:
                self._misses += 1
                return None
            self._data.move_to_end(key)
            self._hits += 1
            return value

    def setdefault(self, key: K, value: V) -> V:
        """The value already stored for ``key``, else ``value``, stored (evicting the oldest if full)."""
        with self._lock:
            old = self._data.get(key)
            if old is not None:
                self._data.move_to_end(key)
                return old
            self._data[key] = value
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)
            return value

    def get_or_make(self, key: K, make: Callable[[], V]) -> V:
        """The value for ``key``; made by ``make()`` (outside the lock) and stored on a miss."""
        value = self.get(key)
        return self.setdefault(key, make()) if value is None else value

    def __len__(self) -> int:
        return len(self._data)

    def values(self) -> list[V]:
        with self._lock:
            return list(self._data.values())

    # JAX's cache registry (jax.clear_caches) calls these three.
    def cache_clear(self) -> None:
        with self._lock:
            self._data.clear()

    def cache_info(self) -> LRUInfo:
        return LRUInfo(self._hits, self._misses, self.maxsize, len(self._data))

    def cache_keys(self) -> list[K]:
        with self._lock:
            return list(self._data)
