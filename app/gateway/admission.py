"""Admission per request class and member: at most N concurrent per class, then a bounded queue;
within a class, each member at most their quota of its running and waiting places.

Waiting requests are admitted in order of class priority, then weighted fair share among
classes (start-time fair queuing: each admission advances its class's virtual time by
1/weight), then arrival. Within a class a waiter whose member already holds their running
quota stands aside, so the next member's request takes a free place at once: one member
flooding a class never makes another member wait behind the flood. A full class queue, or
a member's full share of it, is refused at once (429); a request waiting past its class's
timeout gives up (503).

A request asks for as many places as the sequences it starts (`n` choices are `n` sequences on the
runner): every count here, running and waiting, class, member and total, is in places, so a member
allowed two places cannot fill a runner's eight slots with one `n: 8` request. A request that needs
more places than its member may ever hold is refused at once (TooManyPlaces), naming the limit.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from app.gateway.members import Quota
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


class MemberQueueFull(AdmissionError):
    """The member holds their whole quota of the class: running and waiting."""

    def __init__(self, policy: ClassPolicy, member: str, quota: Quota, running: int, waiting: int):
        where = "their own limits" if quota.own else "their share of the class (setting member_class_share)"
        super().__init__(
            f"member '{member}' already has {running} requests running and {waiting} waiting "
            f"in class '{policy.name}', {where}: max_concurrent {quota.max_concurrent}, max_queue "
            f"{quota.max_queue}; retry shortly, or the household's admin can raise them on the Members page or with "
            f"`hearth token member '{member}' --max-concurrent N --max-queue N`"
        )
        self.retry_after_s = 1


class TooManyPlaces(AdmissionError):
    """The request needs more places (its `n` choices) than its member, its class or the gateway may ever hold."""

    def __init__(self, policy: ClassPolicy, member: str, quota: Quota, places: int, max_total: int):
        if places > max_total:
            where = f"the gateway runs at most {max_total} sequences at once"
            limit = max_total
        elif quota.max_concurrent < policy.max_concurrent:
            how = "their own limits" if quota.own else "their share of the class (setting member_class_share)"
            where = (f"member '{member}' may hold {quota.max_concurrent} running places in class '{policy.name}', "
                     f"{how}: the household's admin can raise it on the Members page or with "
                     f"`hearth token member '{member}' --max-concurrent N`")
            limit = quota.max_concurrent
        else:
            where = (f"class '{policy.name}' runs at most {policy.max_concurrent} sequences at once "
                     "(its max_concurrent, on the Classes page)")
            limit = quota.max_concurrent
        super().__init__(f"'n': {places} choices take {places} places and {where}; ask for at most {limit} choices")
        self.limit = limit


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
    member: str = ""
    places: int = 1  # sequences it starts: its `n` choices

    @property
    def queue_ms(self) -> float:
        """Time spent waiting for admission."""
        return (self.admitted_s - self.arrival_s) * 1000


# A request admitted with no member quota (class limits only).
UNLIMITED = Quota(max_concurrent=1 << 30, max_queue=1 << 30)


@dataclass(eq=False)
class _Waiter:
    policy: ClassPolicy
    arrival_s: float
    seq: int
    member: str
    quota: Quota
    places: int
    # Set by whoever grants the place: the waiter sleeps on it alone, so a release wakes one
    # request, not the whole queue (under serve's gevent worker a greenlet, never an OS thread).
    granted: threading.Event = field(default_factory=threading.Event)
    admitted_s: float | None = None


@dataclass
class _MemberState:
    in_flight: int = 0  # places, as every count here
    waiting: int = 0


@dataclass
class _ClassState:
    in_flight: int = 0
    waiting: list[_Waiter] = field(default_factory=list)
    waiting_places: int = 0
    vtime: float = 0.0
    admitted_total: int = 0
    rejected_total: int = 0
    timed_out_total: int = 0
    members: dict[str, _MemberState] = field(default_factory=dict)

    def member(self, name: str) -> _MemberState:
        m = self.members.get(name)
        if m is None:
            m = self.members[name] = _MemberState()
        return m

    def forget_idle(self, name: str) -> None:
        # A member with nothing running or waiting keeps no state: persons behind a trusted token
        # come and go, and the table must not grow with every one of them.
        m = self.members.get(name)
        if m is not None and not m.in_flight and not m.waiting:
            del self.members[name]


class Admission:
    """Admission controller shared by every request of the gateway (threads or greenlets).

    Invariant, kept under the lock after every change: no waiter that could run is left waiting.
    So a request is admitted at once when its class, its member's quota and the total have room
    and no waiter of its class that could run arrived before it; otherwise it waits on its own
    event until a release hands it the place (priority, then fair share, then arrival decide which
    waiter that is) or its timeout passes.
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

    def _class_has_room(self, st: _ClassState, policy: ClassPolicy, places: int = 1) -> bool:
        return (st.in_flight + places <= policy.max_concurrent
                and self._total_in_flight + places <= self.max_in_flight_total)

    def _next(self) -> _Waiter | None:
        # Within a class waiters go in arrival order, skipping those whose member holds their whole
        # running quota: the first of the rest is the class's candidate, and candidates compete. A
        # candidate the class has too few free places for holds its class (no smaller request passes
        # it, so many choices are never starved by single ones).
        best, best_key = None, None
        for st in self._classes.values():
            if not st.waiting:
                continue
            w = next((x for x in st.waiting
                      if st.member(x.member).in_flight + x.places <= x.quota.max_concurrent), None)
            if w is None or not self._class_has_room(st, w.policy, w.places):
                continue
            key = (w.policy.priority, st.vtime, w.arrival_s, w.seq)
            if best_key is None or key < best_key:
                best, best_key = w, key
        return best

    def _grant(self, w: _Waiter) -> None:
        st = self._classes[w.policy.name]
        m = st.member(w.member)
        if w in st.waiting:
            st.waiting.remove(w)
            st.waiting_places -= w.places
            m.waiting -= w.places
        # A class returning from idleness starts at the busiest peers' virtual time, not behind
        # it, so it cannot claim a burst of "owed" service (start-time fair queuing).
        active = [s.vtime for s in self._classes.values() if s.in_flight or s.waiting]
        if active and st.in_flight == 0 and not st.waiting:
            st.vtime = max(st.vtime, min(active))
        st.vtime += 1.0 / max(w.policy.weight, 1e-6)
        st.in_flight += w.places
        st.admitted_total += 1
        m.in_flight += w.places
        self._total_in_flight += w.places
        w.admitted_s = self.clock()

    def _dispatch(self) -> None:
        """Hand every place that is free to the waiter that comes next (restores the invariant)."""
        while (w := self._next()) is not None:
            self._grant(w)
            w.granted.set()

    def admit(self, policy: ClassPolicy, member: str = "", quota: Quota | None = None, places: int = 1) -> Ticket:
        """Wait until the request may run; raises TooManyPlaces, QueueFull, MemberQueueFull or QueueTimeout.

        `member` is who asks (the request log's member name) and `quota` their places in this class
        (app.gateway.members.class_quota); without one, only the class limits apply. `places` is how
        many sequences the request starts (its `n` choices).
        """
        quota = quota or UNLIMITED
        places = max(1, places)
        now = self.clock()
        with self._lock:
            st = self._state(policy.name)
            if places > min(quota.max_concurrent, policy.max_concurrent, self.max_in_flight_total):
                st.rejected_total += 1
                raise TooManyPlaces(policy, member, quota, places, self.max_in_flight_total)
            m = st.member(member)
            w = _Waiter(policy, now, next(self._seq), member, quota, places)
            # By the invariant, a waiter whose member has room waits only for class room (for its places):
            # none such may be passed, else one asking for many places would wait behind every single one.
            if m.in_flight + places <= quota.max_concurrent and self._class_has_room(st, policy, places) \
                    and not any(st.member(x.member).in_flight + x.places <= x.quota.max_concurrent
                                for x in st.waiting):
                self._grant(w)
                return Ticket(policy, now, 0, now, member, places)
            member_bound = m.waiting + places > quota.max_queue
            class_bound = st.waiting_places + places > policy.max_queue
            if member_bound or class_bound:
                st.rejected_total += 1
                st.forget_idle(member)
                # Blame the member (and say how to raise their limits) when only their quota holds them:
                # the class has room, or their share of its queue is full and is less than the whole queue.
                if self._class_has_room(st, policy, places) or (
                        member_bound and (not class_bound or quota.max_queue < policy.max_queue)):
                    raise MemberQueueFull(policy, member, quota, m.in_flight, m.waiting)
                raise QueueFull(policy)
            st.waiting.append(w)
            st.waiting_places += places
            m.waiting += places
            position = len(st.waiting)
            self._dispatch()
        w.granted.wait(max(0.0, policy.queue_timeout_s - (self.clock() - now)))
        with self._lock:
            # Granted between the timeout and this lock: the place is ours, take it.
            if w.admitted_s is not None:
                return Ticket(policy, now, position, w.admitted_s, member, places)
            st.waiting.remove(w)
            st.waiting_places -= places
            m.waiting -= places
            st.timed_out_total += 1
            st.forget_idle(member)
            # The one leaving may have been the head that blocked nobody but itself: look again.
            self._dispatch()
        raise QueueTimeout(policy, self.clock() - now)

    def release(self, ticket: Ticket) -> None:
        """Free the ticket's place and hand it to the next waiter."""
        with self._lock:
            st = self._classes[ticket.policy.name]
            st.in_flight -= ticket.places
            st.member(ticket.member).in_flight -= ticket.places
            st.forget_idle(ticket.member)
            self._total_in_flight -= ticket.places
            self._dispatch()

    def snapshot(self) -> dict[str, dict]:
        """Per class: in flight, waiting and totals (for the dashboard and /metrics)."""
        with self._lock:
            return {
                name: {
                    "in_flight": st.in_flight,
                    "waiting": st.waiting_places,
                    "admitted_total": st.admitted_total,
                    "rejected_total": st.rejected_total,
                    "timed_out_total": st.timed_out_total,
                }
                for name, st in self._classes.items()
            }

    def member_snapshot(self) -> dict[str, dict[str, dict[str, int]]]:
        """Per member, per class: running and waiting now (the Members page's live use)."""
        with self._lock:
            out: dict[str, dict[str, dict[str, int]]] = {}
            for name, st in self._classes.items():
                for member, m in st.members.items():
                    if m.in_flight or m.waiting:
                        out.setdefault(member, {})[name] = {"in_flight": m.in_flight, "waiting": m.waiting}
            return out
