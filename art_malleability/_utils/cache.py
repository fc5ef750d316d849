"""A cache of values by key, bounded by their total size in bytes (the oldest go first)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

#: Bytes of query factors or features an influence estimator keeps between the passes of an audit, which asks for
#: the same blocks of queries after every refit.
QUERY_CACHE_BYTES = 2**30


class BoundedCache:
    """
    Values by key up to ``max_bytes`` in all; a value larger than that is computed and not kept.

    :param max_bytes: The bound.
    :param size: The bytes of a value.
    """

    def __init__(self, max_bytes: int, size: Callable[[Any], int]) -> None:
        self.max_bytes, self.size = max_bytes, size
        self._items: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()

    def get(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """:return: The value of ``key``, computed (and kept when it fits) the first time."""
        if key in self._items:
            return self._items[key][0]
        value = compute()
        nbytes = self.size(value)
        while self._items and sum(n for _, n in self._items.values()) + nbytes > self.max_bytes:
            self._items.popitem(last=False)
        if nbytes <= self.max_bytes:
            self._items[key] = (value, nbytes)
        return value

    def clear(self) -> None:
        self._items.clear()
