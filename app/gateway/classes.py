"""Request classes as the gateway uses them: read from the store, cached for a few seconds."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from sqlalchemy import select
from sqlalchemy.orm import sessionmaker

from app.policy import ClassPolicy
from app.store.models import RequestClass

_FIELDS = [f for f in ClassPolicy.__dataclass_fields__]


def policy_of(row: RequestClass) -> ClassPolicy:
    """The frozen policy of a stored class."""
    return ClassPolicy(**{f: getattr(row, f) for f in _FIELDS})


class ClassRegistry:
    """Class policies by name; edits on the dashboard apply within ttl_s."""

    def __init__(self, sessions: sessionmaker, ttl_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self._sessions = sessions
        self._ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._loaded_s = float("-inf")
        self._policies: dict[str, ClassPolicy] = {}

    def _refresh(self) -> dict[str, ClassPolicy]:
        with self._lock:
            if self._clock() - self._loaded_s >= self._ttl_s:
                with self._sessions() as session:
                    self._policies = {r.name: policy_of(r) for r in session.scalars(select(RequestClass))}
                self._loaded_s = self._clock()
            return self._policies

    def get(self, name: str) -> ClassPolicy | None:
        """The policy of a class, or None."""
        return self._refresh().get(name)

    def names(self) -> list[str]:
        """Known class names, by priority."""
        return [p.name for p in sorted(self._refresh().values(), key=lambda p: (p.priority, p.name))]

    def invalidate(self) -> None:
        """Reload on the next lookup."""
        with self._lock:
            self._loaded_s = float("-inf")
