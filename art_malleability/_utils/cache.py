"""A cache of values by key, bounded by their total size in bytes (the first ones stay)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

#: Bytes of query factors or features an influence estimator keeps between the passes of an audit, which asks for
#: the same blocks of queries after every refit.
QUERY_CACHE_BYTES = 2**30


class BoundedCache:
    """
    Values by key, kept in the order they come while their total stays within ``max_bytes``; a value that does not
    fit is computed and not kept, and nothing is evicted. An audit asks for the same blocks of queries in the same
    order after every refit: keeping the first ones gives a hit on each of them in every later pass, where evicting
    the oldest would miss on every block as soon as they do not all fit.

    :param max_bytes: The bound.
    :param size: The bytes of a value.
    """

    def __init__(self, max_bytes: int, size: Callable[[Any], int]) -> None:
        self.max_bytes, self.size = max_bytes, size
        self._items: dict[Hashable, Any] = {}
        self.nbytes = 0

    def get(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """:return: The value of ``key``, computed (and kept when it fits) the first time."""
        if key in self._items:
            return self._items[key]
        value = compute()
        self.put(key, value)
        return value

    def lookup(self, key: Hashable) -> Any:
        """:return: The value kept for ``key``, or ``None``."""
        return self._items.get(key)

    def put(self, key: Hashable, value: Any) -> None:
        """Keep ``value`` for ``key`` if it fits (a key already kept keeps its value)."""
        nbytes = self.size(value)
        if key not in self._items and self.nbytes + nbytes <= self.max_bytes:
            self._items[key] = value
            self.nbytes += nbytes

    def clear(self) -> None:
        self._items.clear()
        self.nbytes = 0
