"""Request classes as the gateway uses them: read from the store, cached for a few seconds."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from cachetools import TTLCache
from sqlalchemy import select
from sqlalchemy.orm import sessionmaker

from app.policy import ClassPolicy
from app.store.models import RequestClass

_FIELDS = [f for f in ClassPolicy.__dataclass_fields__]
_ALL = "classes"  # the cache's one key


def policy_of(row: RequestClass) -> ClassPolicy:
    """The frozen policy of a stored class."""
    return ClassPolicy(**{f: getattr(row, f) for f in _FIELDS})


class ClassRegistry:
    """Class policies by name; edits on the dashboard apply within ttl_s."""

    def __init__(self, sessions: sessionmaker, ttl_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self._sessions = sessions
        self._lock = threading.Lock()
        # One entry: every class, read in one query.
        self._cache: TTLCache = TTLCache(maxsize=1, ttl=ttl_s, timer=clock)

    def _policies(self) -> dict[str, ClassPolicy]:
        # The lock is held while loading, so a burst of requests after expiry reads the store once.
        with self._lock:
            policies = self._cache.get(_ALL)
            if policies is None:
                with self._sessions() as session:
                    policies = {r.name: policy_of(r) for r in session.scalars(select(RequestClass))}
                self._cache[_ALL] = policies
            return policies

    def get(self, name: str) -> ClassPolicy | None:
        """The policy of a class, or None."""
        return self._policies().get(name)

    def names(self) -> list[str]:
        """Known class names, by priority."""
        return [p.name for p in sorted(self._policies().values(), key=lambda p: (p.priority, p.name))]

    def invalidate(self) -> None:
        """Reload on the next lookup."""
        with self._lock:
            self._cache.clear()
