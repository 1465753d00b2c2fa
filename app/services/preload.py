"""Evidence before automation: which model the household wants when, a preload schedule, and the job that keeps it.

The request log's time-of-day profile (read_profile): per model, per 15-minute slot of the box's local day,
on how many of the last N days (14 by default) it was requested in that slot, split into weekdays and weekends
when both have enough days of data. The recommendation (recommend): for each model with a local runner that
is not pinned (a pinned one is always resident), the slots where it was wanted on at least half of the days
with data (and at least MIN_DAYS_OF_DATA of them), merged into windows; each window's preload time is its start
less the model's median measured cold start, rounded down to a slot; windows whose models would not fit the
memory budget together are kept out, the strongest evidence first. Every line carries its evidence in words.

Nothing acts until the admin applies the recommendation (apply_schedule, all or nothing); the serve job
(Preloader.run, every minute) then asks the residency manager to load each scheduled model at its minute if it
is not resident, through the manager's normal load path: it evicts only idle unpinned models, never one serving
requests, and when the manager refuses, the refusal is logged and shown, not forced.
"""

from __future__ import annotations

import logging
import statistics
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta, tzinfo

from sqlalchemy import Integer, cast, func, select
from sqlalchemy.orm import Session, sessionmaker

from app.residency.manager import RESIDENT_STATES, ModelSpec, ResidencyError
from app.store.models import PRELOAD_DAYS, PreloadEntry, RequestRecord, ResidencyEvent

log = logging.getLogger("hearth.preload")

SLOT_MIN = 15
SLOTS_PER_DAY = 24 * 60 // SLOT_MIN
DEFAULT_LOOKBACK_DAYS = 14
MIN_LOOKBACK_DAYS, MAX_LOOKBACK_DAYS = 3, 90
# A slot is part of a window when the model was wanted in it on at least this share of the days with data...
MIN_SHARE = 0.5
# ...and there are at least this many days of data of that kind.
MIN_DAYS_OF_DATA = 3
# The loads whose cold starts the preload time is taken from (the median of the latest ones).
COLD_START_LOADS = 10
# After a missed run (a long load held the job), due minutes up to this far back are still served.
MAX_CATCH_UP_MIN = 10
DAYS_WORDS = {"daily": "days", "weekdays": "weekdays", "weekends": "weekend days"}
assert tuple(DAYS_WORDS) == PRELOAD_DAYS, "a day kind without its words"


class PreloadError(ValueError):
    """A schedule entry or request that cannot be applied; the message says what to fix."""


def hhmm(minute: int) -> str:
    """A minute of the day as HH:MM (1440 is the day's end, 24:00)."""
    return f"{minute // 60:02d}:{minute % 60:02d}"


def parse_hhmm(text: str) -> int:
    """HH:MM as a minute of the day; PreloadError when it is not a time of day."""
    hours, sep, minutes = text.strip().partition(":")
    if not sep or not hours.isdigit() or not minutes.isdigit() or len(minutes) != 2:
        raise PreloadError(f"{text!r} is not a time of day: write it as HH:MM, e.g. 06:15")
    h, m = int(hours), int(minutes)
    if h > 23 or m > 59:
        raise PreloadError(f"{text!r} is not a time of day: hours 00–23, minutes 00–59")
    return h * 60 + m


def day_kind(d: date) -> str:
    """'weekends' for Saturday and Sunday, else 'weekdays'."""
    return "weekends" if d.weekday() >= 5 else "weekdays"


def applies_on(days: str, d: date) -> bool:
    """Whether an entry for `days` acts on the date `d`."""
    return days == "daily" or days == day_kind(d)


def local_zone_name(tz: tzinfo | None, at: datetime) -> str:
    """The zone's name as the page shows it (the box's own when tz is None)."""
    return at.astimezone(tz).tzname() or "local time"


# --- the profile -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Strip:
    """One model's time-of-day profile over one kind of day: per slot, the dates it was wanted and its requests."""

    model: str
    days: str
    days_with_data: int
    dates: tuple[frozenset[date], ...]
    requests: tuple[int, ...]

    def share(self, slot: int) -> float:
        """Share of the days with data on which the model was requested in `slot`."""
        return len(self.dates[slot]) / self.days_with_data if self.days_with_data else 0.0

    @property
    def total_requests(self) -> int:
        """Requests over the whole period."""
        return sum(self.requests)

    def cells(self) -> list[dict]:
        """The heat strip's cells: slot, start time, days wanted, share, requests."""
        return [{"slot": i, "start": hhmm(i * SLOT_MIN), "end": hhmm((i + 1) * SLOT_MIN), "days": len(self.dates[i]),
                 "share": self.share(i), "requests": self.requests[i]} for i in range(SLOTS_PER_DAY)]


@dataclass(frozen=True)
class Profile:
    """The request log's time-of-day profile over the last `lookback_days` (local time of the box)."""

    until: datetime
    lookback_days: int
    zone: str
    split: bool
    days_with_data: dict[str, int]
    strips: tuple[Strip, ...]
    note: str

    @property
    def kinds(self) -> tuple[str, ...]:
        """The day kinds the strips are over."""
        return ("weekdays", "weekends") if self.split else ("daily",)

    def strip(self, model: str, days: str) -> Strip | None:
        """The strip of one model and day kind."""
        return next((s for s in self.strips if s.model == model and s.days == days), None)


def check_lookback(days: int) -> int:
    """The lookback in days, or PreloadError saying the bounds."""
    if not MIN_LOOKBACK_DAYS <= days <= MAX_LOOKBACK_DAYS:
        raise PreloadError(f"the profile looks back {MIN_LOOKBACK_DAYS} to {MAX_LOOKBACK_DAYS} days (got {days})")
    return days


def read_profile(session: Session, now: datetime, lookback_days: int = DEFAULT_LOOKBACK_DAYS,
                 tz: tzinfo | None = None) -> Profile:
    """Count the requests of the last `lookback_days` per model and local 15-minute slot (tz None: the box's zone)."""
    check_lookback(lookback_days)
    since = now - timedelta(days=lookback_days)
    # Grouped in SQL by 15-minute bucket of UTC time, placed in local slots here: every zone's offset from UTC
    # today is a whole number of quarter hours (Nepal's +5:45 and Chatham's +12:45 too), so a UTC bucket is
    # exactly one local slot.
    bucket = cast(func.strftime("%s", RequestRecord.arrival_at), Integer) // (SLOT_MIN * 60)
    rows = session.execute(
        select(RequestRecord.model, bucket, func.count())
        .where(RequestRecord.arrival_at >= since, RequestRecord.arrival_at < now)
        .group_by(RequestRecord.model, bucket)).all()
    logged: dict[str, set[date]] = {"weekdays": set(), "weekends": set()}
    by_model: dict[str, list[tuple[date, int, int]]] = {}
    for model, b, n in rows:
        local = datetime.fromtimestamp(int(b) * SLOT_MIN * 60, UTC).astimezone(tz)
        d = local.date()
        logged[day_kind(d)].add(d)
        if model:
            by_model.setdefault(model, []).append((d, (local.hour * 60 + local.minute) // SLOT_MIN, int(n)))
    counts = {k: len(v) for k, v in logged.items()}
    split = all(n >= MIN_DAYS_OF_DATA for n in counts.values())
    if split:
        note = f"weekdays and weekends apart: {counts['weekdays']} weekdays and {counts['weekends']} weekend days of data"
        days_with_data = dict(counts)
    else:
        total = counts["weekdays"] + counts["weekends"]
        note = (f"every day together: {counts['weekdays']} weekdays and {counts['weekends']} weekend days of data "
                f"(apart each needs {MIN_DAYS_OF_DATA})")
        days_with_data = {"daily": total}
    strips = []
    for model in sorted(by_model):
        for kind in (("weekdays", "weekends") if split else ("daily",)):
            dates: list[set[date]] = [set() for _ in range(SLOTS_PER_DAY)]
            requests = [0] * SLOTS_PER_DAY
            for d, slot, n in by_model[model]:
                if applies_on(kind, d):
                    dates[slot].add(d)
                    requests[slot] += n
            if any(requests):
                strips.append(Strip(model, kind, days_with_data[kind], tuple(frozenset(s) for s in dates), tuple(requests)))
    return Profile(until=now, lookback_days=lookback_days, zone=local_zone_name(tz, now), split=split,
                   days_with_data=days_with_data, strips=tuple(strips), note=note)


# --- the recommendation ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Line:
    """One recommended preload: load `model` at `preload_at` on `days` for the window it is wanted in."""

    model: str
    days: str
    window_start: int
    window_end: int
    preload_at: int
    days_wanted: int
    days_with_data: int
    requests: int
    cold_start_ms: float | None
    cold_start_loads: int
    estimate_bytes: int
    fits: bool = True
    memory_note: str = ""

    @property
    def key(self) -> str:
        """What the page's Apply form sends back for this line: model, days and preload time."""
        return f"{self.model}|{self.days}|{hhmm(self.preload_at)}"

    @property
    def evidence(self) -> str:
        """The line's evidence in words."""
        kinds = DAYS_WORDS[self.days]
        text = (f"wanted on {self.days_wanted} of {self.days_with_data} {kinds} between {hhmm(self.window_start)} "
                f"and {hhmm(self.window_end)} ({self.requests} requests)")
        if self.cold_start_ms is None:
            cold = "no load measured yet, so one slot ahead"
        else:
            cold = (f"cold start {self.cold_start_ms / 1000:.1f} s (median of {self.cold_start_loads} "
                    f"load{'s' if self.cold_start_loads != 1 else ''})")
        return f"{text}; {cold} → load at {hhmm(self.preload_at)}"


@dataclass(frozen=True)
class Recommendation:
    """The recommended schedule, with the profile it came from and why some models have no line."""

    profile: Profile
    lines: tuple[Line, ...]
    notes: tuple[str, ...]
    budget_bytes: int

    @property
    def applicable(self) -> tuple[Line, ...]:
        """The lines Apply stores: those that fit the memory budget."""
        return tuple(line for line in self.lines if line.fits)


def cold_starts(session: Session, model: str) -> list[float]:
    """The model's latest measured cold starts (ms), newest first."""
    return [ms for ms in session.scalars(
        select(ResidencyEvent.cold_start_ms)
        .where(ResidencyEvent.model_name == model, ResidencyEvent.event == "load", ResidencyEvent.cold_start_ms.is_not(None))
        .order_by(ResidencyEvent.at.desc(), ResidencyEvent.id.desc()).limit(COLD_START_LOADS))]


def windows(strip: Strip) -> list[tuple[int, int]]:
    """Runs of slots (start, end exclusive) wanted on at least MIN_SHARE of the days with data."""
    wanted = [strip.share(i) >= MIN_SHARE for i in range(SLOTS_PER_DAY)]
    runs, start = [], None
    for i, w in enumerate([*wanted, False]):
        if w and start is None:
            start = i
        elif not w and start is not None:
            runs.append((start, i))
            start = None
    return runs


def preload_minute(window_start: int, cold_start_ms: float | None) -> int:
    """The window's start less the cold start, rounded down to a slot (no measure: one slot ahead); 00:00 at the earliest."""
    lead_min = SLOT_MIN if cold_start_ms is None else cold_start_ms / 60000
    return max(0, int((window_start - lead_min) // SLOT_MIN) * SLOT_MIN)


def _overlaps(a: Line, b: Line) -> bool:
    same_days = a.days == b.days or "daily" in (a.days, b.days)
    return same_days and a.preload_at < b.window_end and b.preload_at < a.window_end


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def recommend(session: Session, specs: dict[str, ModelSpec], budget_bytes: int, now: datetime,
              lookback_days: int = DEFAULT_LOOKBACK_DAYS, tz: tzinfo | None = None) -> Recommendation:
    """The preload schedule the profile supports, each line with its evidence and memory check."""
    profile = read_profile(session, now, lookback_days, tz)
    notes: list[str] = []
    kinds = [(k, n) for k, n in profile.days_with_data.items()]
    if all(n < MIN_DAYS_OF_DATA for _, n in kinds):
        total = sum(n for _, n in kinds)
        notes.append(f"Too little data for a recommendation: requests on {total} day{'s' if total != 1 else ''} of the "
                     f"last {lookback_days}; a schedule needs requests on at least {MIN_DAYS_OF_DATA} days.")
        return Recommendation(profile, (), tuple(notes), budget_bytes)
    pinned = {name: s for name, s in specs.items() if s.policy == "pinned" and s.runner is not None}
    candidates: list[Line] = []
    for model in sorted({s.model for s in profile.strips}):
        spec = specs.get(model)
        if spec is None:
            notes.append(f"{model} was requested but is not in the catalog now: no preload.")
            continue
        if spec.runner is None:
            notes.append(f"{model} is served by remote nodes only: nothing to load here.")
            continue
        if spec.policy == "pinned":
            notes.append(f"{model} is pinned: always resident, so it needs no preload.")
            continue
        starts = cold_starts(session, model)
        cold = statistics.median(starts) if starts else None
        found = False
        for kind in profile.kinds:
            strip = profile.strip(model, kind)
            if strip is None:
                continue
            for a, b in windows(strip):
                found = True
                dates = frozenset().union(*strip.dates[a:b])
                start = a * SLOT_MIN
                candidates.append(Line(
                    model=model, days=kind, window_start=start, window_end=b * SLOT_MIN,
                    preload_at=preload_minute(start, cold), days_wanted=len(dates), days_with_data=strip.days_with_data,
                    requests=sum(strip.requests[a:b]), cold_start_ms=cold, cold_start_loads=len(starts),
                    estimate_bytes=spec.estimate_bytes))
        if not found:
            best = max((s for s in profile.strips if s.model == model),
                       key=lambda s: max(len(d) for d in s.dates))
            top = max(range(SLOTS_PER_DAY), key=lambda i: len(best.dates[i]))
            notes.append(f"{model}: no time of day it was wanted on most days (at most {len(best.dates[top])} of "
                         f"{best.days_with_data} {DAYS_WORDS[best.days]}, at {hhmm(top * SLOT_MIN)}; a window needs "
                         f"{MIN_SHARE:.0%}).")
    # The strongest evidence claims the memory first; a line that cannot fit beside those before it is kept out.
    pinned_bytes = sum(s.estimate_bytes for s in pinned.values())
    accepted: list[Line] = []
    lines: list[Line] = []
    for line in sorted(candidates, key=lambda x: (-x.days_wanted / x.days_with_data, -x.requests, x.model, x.window_start)):
        beside = [x for x in accepted if x.model != line.model and _overlaps(x, line)]
        together = pinned_bytes + line.estimate_bytes + sum(x.estimate_bytes for x in {x.model: x for x in beside}.values())
        names = sorted({x.model for x in beside} | set(pinned))
        beside_text = f" with {', '.join(names)}" if names else ""
        if together <= budget_bytes:
            accepted.append(line)
            lines.append(_with(line, True, f"{_mib(together)}{beside_text} of the {_mib(budget_bytes)} budget"))
        else:
            lines.append(_with(line, False, f"{_mib(together)}{beside_text}: over the {_mib(budget_bytes)} budget"))
    lines.sort(key=lambda x: (PRELOAD_DAYS.index(x.days), x.preload_at, x.model))
    if not candidates and not notes:
        notes.append("No model was wanted at the same time on most days.")
    return Recommendation(profile, tuple(lines), tuple(notes), budget_bytes)


def _with(line: Line, fits: bool, note: str) -> Line:
    return Line(**{**line.__dict__, "fits": fits, "memory_note": note})


# --- the applied schedule --------------------------------------------------------------------------


def schedule(session: Session) -> list[PreloadEntry]:
    """The applied schedule, by day kind and time."""
    rows = list(session.scalars(select(PreloadEntry)))
    return sorted(rows, key=lambda e: (PRELOAD_DAYS.index(e.days), e.at_minute, e.model_name))


def apply_schedule(session: Session, lines: Sequence[Line], known_models: Iterable[str], applied_by: str) -> list[PreloadEntry]:
    """Replace the schedule with `lines`, all or nothing: every line is checked before any is written (uncommitted)."""
    known = set(known_models)
    if not lines:
        raise PreloadError("nothing to apply: the recommendation has no line that fits the memory budget")
    seen = set()
    for line in lines:
        if line.model not in known:
            raise PreloadError(f"{line.model!r} is not in the catalog: rescan the models folder or leave it out")
        if line.days not in PRELOAD_DAYS:
            raise PreloadError(f"{line.days!r} is not a day kind; choose one of {', '.join(PRELOAD_DAYS)}")
        for minute in (line.preload_at, line.window_start):
            if not 0 <= minute < 24 * 60:
                raise PreloadError(f"{minute} is not a minute of the day (0 to 1439) in {line.key}")
        if not line.window_start < line.window_end <= 24 * 60:
            raise PreloadError(f"the window {hhmm(line.window_start)}–{hhmm(line.window_end)} of {line.key} is empty")
        if not line.fits:
            raise PreloadError(f"{line.key} does not fit the memory budget ({line.memory_note})")
        if line.key in seen:
            raise PreloadError(f"{line.key} is in the schedule twice")
        seen.add(line.key)
    for old in session.scalars(select(PreloadEntry)):
        session.delete(old)
    session.flush()
    rows = [PreloadEntry(model_name=line.model, days=line.days, at_minute=line.preload_at,
                         window_start_minute=line.window_start, window_end_minute=line.window_end,
                         evidence=line.evidence, applied_by=applied_by) for line in lines]
    session.add_all(rows)
    session.flush()
    return rows


def remove_entry(session: Session, entry_id: int) -> PreloadEntry:
    """Delete one schedule entry (uncommitted); PreloadError when there is none of that id."""
    row = session.get(PreloadEntry, entry_id)
    if row is None:
        raise PreloadError(f"no preload schedule entry {entry_id}: it may have been removed already")
    session.delete(row)
    session.flush()
    return row


# --- the job -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What one due entry led to: loaded, already resident, or the manager's refusal."""

    at: datetime  # the due minute, UTC
    model: str
    scheduled: str
    result: str
    detail: str = ""


@dataclass
class Preloader:
    """The serve job (every minute) that loads each scheduled model at its local minute if it is not resident.

    `residency` needs status(), load(name, reason) and set_client_keep_alive(name, s) (the ResidencyManager).
    Minutes are walked in UTC and read in local time, so each scheduled minute is acted on once per day it
    occurs; a minute that does not occur (a daylight-saving jump forward) is skipped, one that occurs twice
    finds the model resident the second time.
    """

    sessions: sessionmaker
    residency: object
    clock: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))
    tz: tzinfo | None = None
    outcomes: deque = field(default_factory=lambda: deque(maxlen=20))
    _last: datetime | None = field(default=None, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def due(self, now: datetime) -> list[tuple[PreloadEntry, datetime]]:
        """The entries whose minute came since the last run (at most MAX_CATCH_UP_MIN back), with that minute."""
        now = now.astimezone(UTC).replace(second=0, microsecond=0)
        if self._last is not None and now <= self._last:
            return []
        first = now if self._last is None else max(self._last + timedelta(minutes=1), now - timedelta(minutes=MAX_CATCH_UP_MIN))
        self._last = now
        with self.sessions() as s:
            entries = schedule(s)
            s.expunge_all()
        out = []
        t = first
        while t <= now:
            local = t.astimezone(self.tz)
            minute = local.hour * 60 + local.minute
            out.extend((e, t) for e in entries if e.at_minute == minute and applies_on(e.days, local.date()))
            t += timedelta(minutes=1)
        return out

    def run(self) -> list[Outcome]:
        """Load what is due now; returns what each due entry led to."""
        with self._lock:
            due = self.due(self.clock())
            return [self._preload(entry, at) for entry, at in due]

    def _preload(self, entry: PreloadEntry, at: datetime) -> Outcome:
        name, when = entry.model_name, hhmm(entry.at_minute)
        state = next((m for m in self.residency.status() if m["name"] == name), None)
        if state is None:
            outcome = Outcome(at, name, when, "skipped", "not in the catalog now")
        elif state["state"] in RESIDENT_STATES:
            outcome = Outcome(at, name, when, "resident", "already resident")
        else:
            # Held until the window starts, then as long as its own idle TTL: a keep-alive of a few minutes (or
            # on demand's none) would otherwise unload the model before anyone asks for it.
            local = at.astimezone(self.tz)
            to_window_s = max(0, entry.window_start_minute - (local.hour * 60 + local.minute)) * 60
            own_s = state["keep_alive_s"] if state["policy"] == "keep_alive" else SLOT_MIN * 60
            self.residency.set_client_keep_alive(name, float(to_window_s + own_s))
            try:
                self.residency.load(name, reason=f"preload schedule {when}")
                outcome = Outcome(at, name, when, "loaded", f"held until {hhmm(entry.window_start_minute)} "
                                                            f"plus {own_s / 60:g} min idle")
            except ResidencyError as exc:
                self.residency.set_client_keep_alive(name, None)
                log.warning("preload of %s at %s refused: %s", name, when, exc)
                outcome = Outcome(at, name, when, "refused", str(exc))
        self.outcomes.appendleft(outcome)
        return outcome
