"""Admission per request class: at most N concurrent per class, then a bounded queue.

Waiting requests are admitted in order of class priority, then weighted fair share among
classes (start-time fair queuing: each admission advances its class's virtual time by
1/weight), then arrival. A full class queue is refused at once (429); a request waiting past
its class's timeout gives up (503).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from app.policy import ClassPolicy


class AdmissionError(Exception):
    """A request that was not admitted."""


class QueueFull(AdmissionError):
    """The class's queue is at its limit."""

    def __init__(self, policy: ClassPolicy):
        super().__init__(
            f"class '{policy.name}' already has {policy.max_concurrent} requests running and "
            f"{policy.max_queue} waiting; retry shortly"
        )
        self.retry_after_s = 1


class QueueTimeout(AdmissionError):
    """The request waited longer than its class allows."""

    def __init__(self, policy: ClassPolicy, waited_s: float):
        super().__init__(
            f"waited {waited_s:.1f} s for a free place in class '{policy.name}' "
            f"(its queue timeout is {policy.queue_timeout_s:g} s)"
        )


@dataclass
class Ticket:
    """An admitted request's place; release it when the request ends."""

    policy: ClassPolicy
    arrival_s: float
    queue_position: int  # 0 when admitted at once, else 1-based position in its class queue at arrival
    admitted_s: float = 0.0

    @property
    def queue_ms(self) -> float:
        """Time spent waiting for admission."""
        return (self.admitted_s - self.arrival_s) * 1000


@dataclass(eq=False)
class _Waiter:
    policy: ClassPolicy
    arrival_s: float
    seq: int
    # Set by whoever grants the place: the waiter sleeps on it alone, so a release wakes one
    # request, not the whole queue (under serve's gevent worker a greenlet, never an OS thread).
    granted: threading.Event = field(default_factory=threading.Event)
    admitted_s: float | None = None


@dataclass
class _ClassState:
    in_flight: int = 0
    waiting: list[_Waiter] = field(default_factory=list)
    vtime: float = 0.0
    admitted_total: int = 0
    rejected_total: int = 0
    timed_out_total: int = 0


class Admission:
    """Admission controller shared by every request of the gateway (threads or greenlets).

    Invariant, kept under the lock after every change: no waiter that could run is left waiting.
    So a request is admitted at once when its class and the total have room and nobody of its
    class waits; otherwise it waits on its own event until a release hands it the place
    (priority, then fair share, then arrival decide which waiter that is) or its timeout passes.
    """

    def __init__(self, max_in_flight_total: int = 64, clock: Callable[[], float] = time.monotonic):
        self.max_in_flight_total = max_in_flight_total
        self.clock = clock
        self._lock = threading.Lock()
        self._classes: dict[str, _ClassState] = {}
        self._seq = itertools.count()
        self._total_in_flight = 0

    def _state(self, name: str) -> _ClassState:
        st = self._classes.get(name)
        if st is None:
            st = self._classes[name] = _ClassState()
        return st

    def _eligible(self, w: _Waiter) -> bool:
        st = self._classes[w.policy.name]
        return st.in_flight < w.policy.max_concurrent and self._total_in_flight < self.max_in_flight_total

    def _next(self) -> _Waiter | None:
        # Within a class waiters go in arrival order, so only each class's head competes.
        best, best_key = None, None
        for st in self._classes.values():
            if not st.waiting:
                continue
            w = st.waiting[0]
            if not self._eligible(w):
                continue
            key = (w.policy.priority, st.vtime, w.arrival_s, w.seq)
            if best_key is None or key < best_key:
                best, best_key = w, key
        return best

    def _grant(self, w: _Waiter) -> None:
        st = self._classes[w.policy.name]
        if w in st.waiting:
            st.waiting.remove(w)
        # A class returning from idleness starts at the busiest peers' virtual time, not behind
        # it, so it cannot claim a burst of "owed" service (start-time fair queuing).
        active = [s.vtime for s in self._classes.values() if s.in_flight or s.waiting]
        if active and st.in_flight == 0 and not st.waiting:
            st.vtime = max(st.vtime, min(active))
        st.vtime += 1.0 / max(w.policy.weight, 1e-6)
        st.in_flight += 1
        st.admitted_total += 1
        self._total_in_flight += 1
        w.admitted_s = self.clock()

    def _dispatch(self) -> None:
        """Hand every place that is free to the waiter that comes next (restores the invariant)."""
        while (w := self._next()) is not None:
            self._grant(w)
            w.granted.set()

    def admit(self, policy: ClassPolicy) -> Ticket:
        """Wait until the request may run; raises QueueFull or QueueTimeout."""
        now = self.clock()
        with self._lock:
            st = self._state(policy.name)
            w = _Waiter(policy, now, next(self._seq))
            if not st.waiting and self._eligible(w):
                self._grant(w)
                return Ticket(policy, now, 0, now)
            if len(st.waiting) >= policy.max_queue:
                st.rejected_total += 1
                raise QueueFull(policy)
            st.waiting.append(w)
            position = len(st.waiting)
            self._dispatch()
        w.granted.wait(max(0.0, policy.queue_timeout_s - (self.clock() - now)))
        with self._lock:
            # Granted between the timeout and this lock: the place is ours, take it.
            if w.admitted_s is not None:
                return Ticket(policy, now, position, w.admitted_s)
            st.waiting.remove(w)
            st.timed_out_total += 1
            # The one leaving may have been the head that blocked nobody but itself: look again.
            self._dispatch()
        raise QueueTimeout(policy, self.clock() - now)

    def release(self, ticket: Ticket) -> None:
        """Free the ticket's place and hand it to the next waiter."""
        with self._lock:
            st = self._classes[ticket.policy.name]
            st.in_flight -= 1
            self._total_in_flight -= 1
            self._dispatch()

    def snapshot(self) -> dict[str, dict]:
        """Per class: in flight, waiting and totals (for the dashboard and /metrics)."""
        with self._lock:
            return {
                name: {
                    "in_flight": st.in_flight,
                    "waiting": len(st.waiting),
                    "admitted_total": st.admitted_total,
                    "rejected_total": st.rejected_total,
                    "timed_out_total": st.timed_out_total,
                }
                for name, st in self._classes.items()
            }
