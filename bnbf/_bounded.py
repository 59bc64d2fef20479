"""The one kind of table the host keeps what a call established in (plans, launch groups, memos, checked
structures): bounded, and when full it drops the entry put or used longest ago, never the whole table. Clearing
whole had dropped a live loop's entry along with dead ones, so its next call took the full route again."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

_MISSING = object()


class Bounded(collections.OrderedDict):
    """A dict of at most ``size`` entries, oldest first. :meth:`put` adds or replaces an entry as the newest and
    drops the oldest past ``size``, passing each value dropped or replaced to ``evicted`` where given; :meth:`touch`
    is a ``get`` that makes a found entry the newest; :meth:`kept` finds or makes one. ``get``, ``in`` and ``del``
    are the dict's own. ``lock`` (reentrant) guards a caller's compound test-and-change; ``put`` takes it too."""

    def __init__(self, size: int, evicted: Callable[[Any], None] | None = None):
        super().__init__()
        self.size = size
        self.evicted = evicted
        self.lock = threading.RLock()

    def put(self, key: Any, value: Any) -> Any:
        """Store ``value`` at ``key`` as the newest entry; returns ``value``."""
        with self.lock:
            old = self.pop(key, _MISSING)
            self[key] = value
            if old is not _MISSING and old is not value and self.evicted is not None:
                self.evicted(old)
            while len(self) > self.size:
                dropped = self.popitem(last=False)[1]
                if self.evicted is not None:
                    self.evicted(dropped)
        return value

    def touch(self, key: Any, default: Any = None) -> Any:
        """The value at ``key``, now the newest entry; ``default`` where there is none."""
        value = self.get(key, _MISSING)
        if value is _MISSING:
            return default
        try:  # noqa: SIM105 - contextlib.suppress costs a context manager per call
            self.move_to_end(key)
        except KeyError:  # another thread dropped it meanwhile: the value found is still the answer
            pass
        return value

    def kept(self, key: Any, make: Callable[[], Any]) -> Any:
        """The value at ``key`` (now the newest), else ``make()`` stored there."""
        value = self.touch(key, _MISSING)
        return self.put(key, make()) if value is _MISSING else value

    def __reduce__(self):  # a table of a process's objects: a copy starts empty, with the same bounds
        return type(self), (self.size, self.evicted)
