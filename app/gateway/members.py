"""Members' own limits beside the class limits: their share of each class, and their request and token rates.

Two kinds of limit, checked at admission (app.gateway.exchange):

- **places** (per class): a member holds at most `max_concurrent` running and `max_queue` waiting
  places of any one class, never more than the class's own. Unset, they are a share of the class
  (setting member_class_share, half by default, at least one place each), so one person or one
  runaway script never takes a whole class: the rest stays free for everyone else.
- **rates** (all classes together): requests started per minute, prompt + generated tokens per
  minute and per 24 hours, in sliding windows. A request is refused (429, Retry-After) once its
  member has reached a limit; the request that crosses a token limit still completes, since its
  tokens are known only at its end.

`Usage` keeps the windows in memory (per-second buckets for the minute, per-minute for the day, so a
busy member costs at most 60 + 60 + 1440 buckets), seeded at start from the request log, so a
restart does not hand out a fresh day.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields

from app.policy import ClassPolicy

MINUTE_S = 60
DAY_S = 24 * 3600
# The member limit fields, in the order the Members page, `hearth token member` and the store list them.
LIMIT_FIELDS = ("max_concurrent", "max_queue", "max_requests_per_min", "max_tokens_per_min", "max_tokens_per_day")
# The settings that give a rate limit its default when the member has none of its own.
RATE_SETTINGS = {"max_requests_per_min": "member_max_requests_per_min",
                 "max_tokens_per_min": "member_max_tokens_per_min",
                 "max_tokens_per_day": "member_max_tokens_per_day"}
LIMIT_LABELS = {"max_concurrent": "running places per class", "max_queue": "waiting places per class",
                "max_requests_per_min": "requests per minute", "max_tokens_per_min": "tokens per minute",
                "max_tokens_per_day": "tokens per day"}
MAX_LIMIT = 1_000_000_000_000  # a bound for typos; larger is "no limit", written as an empty field


@dataclass(frozen=True)
class MemberLimits:
    """A member's own limits as stored; None means the household's default for it."""

    max_concurrent: int | None = None
    max_queue: int | None = None
    max_requests_per_min: int | None = None
    max_tokens_per_min: int | None = None
    max_tokens_per_day: int | None = None

    @classmethod
    def of(cls, row) -> MemberLimits:
        """The limits of a stored member row."""
        return cls(**{f.name: getattr(row, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class Quota:
    """The places one member may hold in one class: running and waiting."""

    max_concurrent: int
    max_queue: int
    own: bool = False  # True when the member's own limits set them, False when the class share did


def share_of(places: int, share: float) -> int:
    """A member's default share of a class's places: at least one, never more than the class has."""
    if places <= 0:
        return 0
    return min(places, max(1, math.floor(places * share)))


def class_quota(limits: MemberLimits, policy: ClassPolicy, share: float) -> Quota:
    """The member's running and waiting places in this class: their own limits, else the class's share."""
    running = (min(policy.max_concurrent, limits.max_concurrent) if limits.max_concurrent is not None
               else share_of(policy.max_concurrent, share))
    waiting = (min(policy.max_queue, limits.max_queue) if limits.max_queue is not None
               else share_of(policy.max_queue, share))
    return Quota(running, waiting, own=limits.max_concurrent is not None or limits.max_queue is not None)


def rate_limits(limits: MemberLimits, setting: Callable[[str], object]) -> dict[str, int]:
    """The member's rate limits in force: their own, else the household's default setting (absent: no limit)."""
    out = {}
    for name, setting_name in RATE_SETTINGS.items():
        value = getattr(limits, name)
        if value is None:
            value = setting(setting_name)
        if value is not None:
            out[name] = int(value)
    return out


class RateLimited(Exception):
    """A member reached one of their rate limits; `retry_after_s` is when the window frees enough."""

    def __init__(self, member: str, limit: str, value: int, used: int, retry_after_s: int):
        self.member = member
        self.limit = limit
        self.value = value
        self.used = used
        self.retry_after_s = retry_after_s
        super().__init__(
            f"member '{member}' has reached their limit of {value} {LIMIT_LABELS[limit]} ({limit}; used {used}); "
            f"retry in {retry_after_s} s, or the household's admin can raise it on the Members page or with "
            f"`hearth token member '{member}' --{limit.replace('_', '-')} N`"
        )


class _Window:
    """Sums in buckets of `width_s` over the last `span_s` seconds (oldest first)."""

    __slots__ = ("width_s", "span_s", "buckets")

    def __init__(self, width_s: int, span_s: int):
        self.width_s = width_s
        self.span_s = span_s
        self.buckets: deque[list[int]] = deque()  # [bucket start, sum]

    def _trim(self, now: float) -> None:
        cutoff = now - self.span_s
        while self.buckets and self.buckets[0][0] + self.width_s <= cutoff:
            self.buckets.popleft()

    def add(self, at: float, amount: int) -> None:
        start = int(at) // self.width_s * self.width_s
        if self.buckets and self.buckets[-1][0] == start:
            self.buckets[-1][1] += amount
        elif not self.buckets or self.buckets[-1][0] < start:
            self.buckets.append([start, amount])
        else:
            # Seeded history arrives in time order; a late one joins the newest bucket.
            self.buckets[-1][1] += amount

    def total(self, now: float) -> int:
        self._trim(now)
        return sum(b[1] for b in self.buckets)

    def retry_after_s(self, now: float, limit: int) -> int:
        """Seconds until the window's sum drops below `limit` (at least 1)."""
        self._trim(now)
        remaining = sum(b[1] for b in self.buckets)
        for start, amount in self.buckets:
            remaining -= amount
            if remaining < limit:
                return max(1, math.ceil(start + self.width_s + self.span_s - now))
        return 1


@dataclass
class _MemberUse:
    requests_min: _Window
    tokens_min: _Window
    tokens_day: _Window

    @classmethod
    def new(cls) -> _MemberUse:
        return cls(_Window(1, MINUTE_S), _Window(1, MINUTE_S), _Window(MINUTE_S, DAY_S))


class Usage:
    """Every member's requests and tokens in their sliding windows; thread-safe, in memory."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self._lock = threading.Lock()
        self._members: dict[str, _MemberUse] = {}

    def _use(self, member: str) -> _MemberUse:
        use = self._members.get(member)
        if use is None:
            use = self._members[member] = _MemberUse.new()
        return use

    def seed(self, rows: Iterable[tuple[str, float, int, int]]) -> None:
        """Earlier use from the request log: (member, Unix seconds, requests, tokens), in time order."""
        with self._lock:
            for member, at, requests, tokens in rows:
                use = self._use(member)
                use.requests_min.add(at, requests)
                use.tokens_min.add(at, tokens)
                use.tokens_day.add(at, tokens)

    def check_and_count(self, member: str, limits: dict[str, int]) -> None:
        """Count one request started by `member`, or raise RateLimited if a limit in force is reached."""
        now = self.clock()
        with self._lock:
            use = self._use(member)
            for name, window in (("max_requests_per_min", use.requests_min), ("max_tokens_per_min", use.tokens_min),
                                 ("max_tokens_per_day", use.tokens_day)):
                limit = limits.get(name)
                if limit is None:
                    continue
                used = window.total(now)
                if used >= limit:
                    raise RateLimited(member, name, limit, used, window.retry_after_s(now, limit))
            use.requests_min.add(now, 1)

    def uncount(self, member: str) -> None:
        """Take back the request check_and_count counted last for `member` (it was refused after all)."""
        with self._lock:
            use = self._members.get(member)
            if use is None:
                return
            for bucket in reversed(use.requests_min.buckets):
                if bucket[1] > 0:
                    bucket[1] -= 1
                    return

    def add_tokens(self, member: str, tokens: int) -> None:
        """Count the prompt and generated tokens of a request of `member` that has ended."""
        if tokens <= 0:
            return
        now = self.clock()
        with self._lock:
            use = self._use(member)
            use.tokens_min.add(now, tokens)
            use.tokens_day.add(now, tokens)

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Per member: requests and tokens in the last minute, tokens in the last 24 hours."""
        now = self.clock()
        with self._lock:
            out = {}
            for member, use in list(self._members.items()):
                row = {"requests_per_min": use.requests_min.total(now), "tokens_per_min": use.tokens_min.total(now),
                       "tokens_per_day": use.tokens_day.total(now)}
                if not any(row.values()):
                    # Idle a whole day: forgotten, so the table holds only members with recent use.
                    del self._members[member]
                    continue
                out[member] = row
            return out
