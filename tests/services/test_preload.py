"""The time-of-day profile, the preload recommendation, Apply and the preload job, on a real SQLite store."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta, timezone

import pytest
from sqlalchemy import select

from app.residency.manager import ModelSpec, ModelState, NotEnoughMemory
from app.residency.runner_spec import RunnerSpec
from app.services.preload import (
    Line,
    Preloader,
    PreloadError,
    apply_schedule,
    parse_hhmm,
    preload_minute,
    read_profile,
    recommend,
    remove_entry,
    schedule,
)
from app.store.models import PreloadEntry, RequestRecord, ResidencyEvent

MiB = 2**20
# The box's zone in these tests: two hours east of UTC, no daylight saving.
TZ = timezone(timedelta(hours=2))
NOW = datetime(2026, 11, 30, 12, 0, tzinfo=TZ)  # a Monday noon; 14 days back is Monday 16 November noon
# 17–30 November: ten weekdays (17–20, 23–27, 30) and four weekend days (21, 22, 28, 29).
DAYS = [date(2026, 11, d) for d in range(17, 31)]
WEEKDAYS = [d for d in DAYS if d.weekday() < 5]
WEEKENDS = [d for d in DAYS if d.weekday() >= 5]


def spec(name: str, mib: int = 300, policy: str = "keep_alive", local: bool = True) -> ModelSpec:
    """A catalog entry with a local runner (never started here)."""
    runner = RunnerSpec(model_name=name, model_path=f"/models/{name}.gguf", threads=2) if local else None
    return ModelSpec(name=name, path=f"/models/{name}.gguf", estimate_bytes=mib * MiB, policy=policy, runner=runner)


def at(d: date, hh: int, mm: int) -> datetime:
    """A local time of the test zone on day d."""
    return datetime(d.year, d.month, d.day, hh, mm, tzinfo=TZ)


def add_requests(sessions, model: str | None, times: list[datetime]) -> None:
    """Request rows as the gateway logs them (only what the profile reads matters)."""
    with sessions() as s:
        s.add_all(RequestRecord(arrival_at=t.astimezone(UTC), model=model, class_name="voice", status="ok") for t in times)
        s.commit()


def add_loads(sessions, model: str, cold_starts_ms: list[float]) -> None:
    """Load events with measured cold starts, oldest first."""
    with sessions() as s:
        for i, ms in enumerate(cold_starts_ms):
            s.add(ResidencyEvent(at=NOW.astimezone(UTC) - timedelta(days=20 - i), model_name=model, event="load",
                                 reason="first request", cold_start_ms=ms))
        s.commit()


@pytest.fixture
def household(sessions):
    """Voice every weekday morning but one, chat every day at 09:00, a story model on half the weekend evenings."""
    voice_days = [d for d in WEEKDAYS if d != date(2026, 11, 25)]
    add_requests(sessions, "voice", [at(d, 6, m) for d in voice_days for m in (35, 50)])
    add_requests(sessions, "chat", [at(d, 9, 5) for d in DAYS])
    add_requests(sessions, "story", [at(d, 19, 10) for d in WEEKENDS[:2]] + [at(WEEKENDS[3], 19, 20)])
    # Outside the 14 days: never counted.
    add_requests(sessions, "voice", [at(date(2026, 11, 10), 3, 0), at(date(2026, 12, 1), 3, 0)])
    add_loads(sessions, "voice", [1000.0, 2000.0, 3000.0])
    return sessions


SPECS = {"voice": spec("voice", 300), "chat": spec("chat", 500), "story": spec("story", 400)}


def test_profile_counts_days_and_requests_per_local_slot_weekdays_apart(household):
    with household() as s:
        p = read_profile(s, NOW, 14, TZ)
    assert p.split and p.kinds == ("weekdays", "weekends")
    assert p.days_with_data == {"weekdays": 10, "weekends": 4}
    assert p.zone == "UTC+02:00" and "10 weekdays and 4 weekend days" in p.note
    voice = p.strip("voice", "weekdays")
    # 06:35 local is 04:35 UTC: the slot is the local one (06:30 is slot 26).
    assert len(voice.dates[26]) == 9 and voice.requests[26] == 9 and voice.requests[27] == 9
    assert voice.share(26) == pytest.approx(0.9) and voice.total_requests == 18
    assert p.strip("voice", "weekends") is None
    assert p.strip("chat", "weekends").requests[36] == 4
    assert {(s.model, s.days) for s in p.strips} == {("voice", "weekdays"), ("chat", "weekdays"), ("chat", "weekends"),
                                                     ("story", "weekends")}


def test_recommendation_windows_preload_times_and_evidence(household):
    with household() as s:
        rec = recommend(s, SPECS, 4096 * MiB, NOW, 14, TZ)
    got = {(x.model, x.days, x.window_start, x.window_end, x.preload_at) for x in rec.lines}
    assert got == {
        # 06:30 less the median cold start of 2 s, rounded down to a slot: 06:15.
        ("voice", "weekdays", 390, 420, 375),
        # Never measured: one slot ahead.
        ("chat", "weekdays", 540, 555, 525), ("chat", "weekends", 540, 555, 525),
        # Wanted on 2 of 4 weekend days at 19:00 (half is enough), on 1 of 4 at 19:15 (not).
        ("story", "weekends", 1140, 1155, 1125),
    }
    voice = next(x for x in rec.lines if x.model == "voice")
    assert voice.evidence == ("wanted on 9 of 10 weekdays between 06:30 and 07:00 (18 requests); cold start 2.0 s "
                              "(median of 3 loads) → load at 06:15")
    assert all(x.fits for x in rec.lines) and rec.applicable == rec.lines
    assert "no load measured yet" in next(x for x in rec.lines if x.model == "chat").evidence


def test_too_little_data_gives_no_recommendation_and_says_why(sessions):
    add_requests(sessions, "voice", [at(date(2026, 11, 29), 6, 35), at(date(2026, 11, 30), 6, 35)])
    with sessions() as s:
        rec = recommend(s, SPECS, 4096 * MiB, NOW, 14, TZ)
    assert rec.lines == ()
    assert rec.notes == ("Too little data for a recommendation: requests on 2 days of the last 14; a schedule needs "
                         "requests on at least 3 days.",)
    with sessions() as s:
        assert recommend(s, SPECS, 4096 * MiB, NOW, 14, TZ).profile.strips[0].total_requests == 2


def test_weekends_too_few_to_split_every_day_is_counted_together(sessions):
    # Monday to Friday only: no weekend day to compare with.
    add_requests(sessions, "voice", [at(d, 6, 35) for d in WEEKDAYS[-5:]])
    with sessions() as s:
        rec = recommend(s, SPECS, 4096 * MiB, NOW, 14, TZ)
    assert not rec.profile.split and rec.profile.days_with_data == {"daily": 5}
    assert "apart each needs 3" in rec.profile.note
    assert [(x.model, x.days, x.days_wanted, x.days_with_data) for x in rec.lines] == [("voice", "daily", 5, 5)]


def test_pinned_remote_unknown_and_scattered_models_get_a_reason_instead_of_a_line(household, sessions):
    add_requests(sessions, "gone", [at(d, 8, 0) for d in DAYS])
    add_requests(sessions, "odd", [at(d, (5 * i) % 24, 0) for i, d in enumerate(DAYS)])
    specs = {**SPECS, "voice": spec("voice", policy="pinned"), "chat": spec("chat", local=False), "odd": spec("odd")}
    with household() as s:
        rec = recommend(s, specs, 4096 * MiB, NOW, 14, TZ)
    assert {x.model for x in rec.lines} == {"story"}
    assert "voice is pinned: always resident, so it needs no preload." in rec.notes
    assert "chat is served by remote nodes only: nothing to load here." in rec.notes
    assert "gone was requested but is not in the catalog now: no preload." in rec.notes
    odd = next(n for n in rec.notes if n.startswith("odd:"))
    assert "no time of day it was wanted on most days (at most 1 of 10 weekdays" in odd


def test_windows_that_do_not_fit_the_budget_together_are_kept_out_strongest_first(household):
    # A chat model big enough that it cannot sit beside the voice model: chat (14 of 14 days) claims its
    # window first; voice's window does not overlap it, so both fit. Make them overlap: chat at 06:30 too.
    specs = {**SPECS, "chat": spec("chat", 3000)}
    with household() as s:
        s.add_all(RequestRecord(arrival_at=at(d, 6, 40).astimezone(UTC), model="chat", status="ok") for d in WEEKDAYS)
        s.commit()
        rec = recommend(s, specs, 3200 * MiB, NOW, 14, TZ)
    by = {(x.model, x.days, x.window_start): x for x in rec.lines}
    chat = by[("chat", "weekdays", 390)]
    voice = by[("voice", "weekdays", 390)]
    assert chat.fits and chat.memory_note == "3,000 MiB of the 3,200 MiB budget"
    assert not voice.fits and voice.memory_note == "3,300 MiB with chat: over the 3,200 MiB budget"
    assert voice not in rec.applicable and chat in rec.applicable
    # Pinned models count against every window.
    with household() as s:
        rec = recommend(s, {**SPECS, "big": spec("big", 3900, policy="pinned")}, 4096 * MiB, NOW, 14, TZ)
    assert not any(x.fits for x in rec.lines if x.estimate_bytes > 196 * MiB)
    assert "with big" in rec.lines[0].memory_note
    # A model bigger than the whole budget fits nowhere, alone or not.
    with household() as s:
        rec = recommend(s, {**SPECS, "story": spec("story", 5000)}, 4096 * MiB, NOW, 14, TZ)
    assert next(x for x in rec.lines if x.model == "story").memory_note == "5,000 MiB: over the 4,096 MiB budget"


def test_preload_minute_rounds_the_lead_down_to_a_slot():
    assert preload_minute(390, 2000.0) == 375
    assert preload_minute(390, 20 * 60000.0) == 360  # 06:10 → 06:00
    assert preload_minute(390, 0.0) == 390
    assert preload_minute(390, None) == 375
    assert preload_minute(0, 5000.0) == 0  # no earlier than midnight
    assert parse_hhmm("06:15") == 375
    for bad in ("6", "24:00", "06:60", "6:5", "x:15"):
        with pytest.raises(PreloadError, match="is not a time of day"):
            parse_hhmm(bad)


def test_lookback_is_bounded(sessions):
    with sessions() as s:
        for days in (2, 91):
            with pytest.raises(PreloadError, match="looks back 3 to 90 days"):
                read_profile(s, NOW, days, TZ)


def test_apply_replaces_the_schedule_and_is_all_or_nothing(household):
    with household() as s:
        rec = recommend(s, SPECS, 4096 * MiB, NOW, 14, TZ)
        rows = apply_schedule(s, rec.applicable, SPECS, "admin")
        s.commit()
        assert len(rows) == 4
    with household() as s:
        stored = [(e.model_name, e.days, e.at_minute, e.window_start_minute, e.window_end_minute) for e in schedule(s)]
        assert stored[0] == ("voice", "weekdays", 375, 390, 420)
        assert schedule(s)[0].evidence.startswith("wanted on 9 of 10 weekdays between 06:30 and 07:00")
    good = rec.applicable[0]
    bad_lines = [
        (Line(**{**good.__dict__, "model": "nobody"}), "'nobody' is not in the catalog"),
        (Line(**{**good.__dict__, "days": "mondays"}), "'mondays' is not a day kind"),
        (Line(**{**good.__dict__, "preload_at": 1440}), "1440 is not a minute of the day"),
        (Line(**{**good.__dict__, "window_end": good.window_start}), "is empty"),
        (Line(**{**good.__dict__, "fits": False, "memory_note": "does not fit: x"}), "does not fit the memory budget"),
        (good, "is in the schedule twice"),
    ]
    for bad, message in bad_lines:
        with household() as s:
            # The good line first: it must not be written when a later one is refused.
            with pytest.raises(PreloadError, match=message):
                apply_schedule(s, [good, bad], SPECS, "admin")
            s.commit()
        with household() as s:
            assert len(schedule(s)) == 4, message
    with household() as s, pytest.raises(PreloadError, match="nothing to apply"):
        apply_schedule(s, [], SPECS, "admin")


def test_remove_entry(household):
    with household() as s:
        apply_schedule(s, recommend(s, SPECS, 4096 * MiB, NOW, 14, TZ).applicable, SPECS, "admin")
        s.commit()
        first = schedule(s)[0].id
    with household() as s:
        assert remove_entry(s, first).model_name == "voice"
        s.commit()
    with household() as s:
        assert first not in {e.id for e in s.scalars(select(PreloadEntry))}
        with pytest.raises(PreloadError, match=f"no preload schedule entry {first}"):
            remove_entry(s, first)


# --- the job, with a fake manager and an injected clock ---------------------------------------------


class FakeResidency:
    """status / load / set_client_keep_alive as the ResidencyManager has them; loads are recorded."""

    def __init__(self, state: ModelState = ModelState.UNLOADED, refuse: Exception | None = None):
        self.state = state
        self.refuse = refuse
        self.loads: list[tuple[str, str]] = []
        self.keep_alive: dict[str, float | None] = {}

    def status(self):
        return [{"name": "voice", "state": self.state, "policy": "keep_alive", "keep_alive_s": 300.0}]

    def set_client_keep_alive(self, name, seconds):
        self.keep_alive[name] = seconds

    def load(self, name, reason):
        if self.refuse is not None:
            raise self.refuse
        self.loads.append((name, reason))
        self.state = ModelState.READY


class Clock:
    def __init__(self, t: datetime):
        self.t = t

    def __call__(self):
        return self.t


def entry(sessions, days: str = "weekdays", at_minute: int = 375) -> None:
    with sessions() as s:
        s.add(PreloadEntry(model_name="voice", days=days, at_minute=at_minute, window_start_minute=390,
                           window_end_minute=420, evidence="test", applied_by="admin"))
        s.commit()


def test_job_loads_at_the_scheduled_minute_and_not_at_others(sessions):
    entry(sessions)
    residency = FakeResidency()
    clock = Clock(at(date(2026, 12, 1), 6, 14) + timedelta(seconds=30))  # a Tuesday
    job = Preloader(sessions, residency, clock=clock, tz=TZ)
    assert job.run() == [] and residency.loads == []
    clock.t += timedelta(seconds=40)  # 06:15:10
    [outcome] = job.run()
    assert residency.loads == [("voice", "preload schedule 06:15")]
    assert outcome.result == "loaded" and outcome.scheduled == "06:15"
    # Held until the window (15 min) plus its own keep-alive (5 min), so the TTL does not unload it first.
    assert residency.keep_alive == {"voice": 20 * 60.0}
    clock.t += timedelta(seconds=20)  # 06:15:30: the same minute again
    assert job.run() == []
    residency.state = ModelState.UNLOADED
    clock.t += timedelta(minutes=1)  # 06:16
    assert job.run() == [] and len(residency.loads) == 1
    # The next Saturday at 06:15: a weekday entry does not act.
    clock.t = at(date(2026, 12, 5), 6, 15)
    assert job.run() == [] and len(residency.loads) == 1
    clock.t = at(date(2026, 12, 7), 6, 15)  # Monday
    job.run()
    assert len(residency.loads) == 2


def test_job_catches_up_a_minute_it_missed_but_not_an_old_one(sessions):
    entry(sessions)
    residency = FakeResidency()
    clock = Clock(at(date(2026, 12, 1), 6, 13))
    job = Preloader(sessions, residency, clock=clock, tz=TZ)
    job.run()
    clock.t = at(date(2026, 12, 1), 6, 17)  # a long load held the job past 06:15
    assert [o.result for o in job.run()] == ["loaded"]
    residency.state = ModelState.UNLOADED
    clock.t = at(date(2026, 12, 2), 5, 0)
    job.run()
    clock.t = at(date(2026, 12, 2), 6, 40)  # 85 minutes without a run: 06:15 is too long ago
    assert job.run() == [] and len(residency.loads) == 1


def test_job_skips_a_resident_model_and_respects_the_managers_refusal(sessions):
    entry(sessions, days="daily")
    resident = FakeResidency(ModelState.READY)
    job = Preloader(sessions, resident, clock=Clock(at(date(2026, 12, 1), 6, 15)), tz=TZ)
    assert [o.result for o in job.run()] == ["resident"] and resident.loads == []
    refusal = NotEnoughMemory("not enough memory for voice: … cannot evict chat (busy: 1 in flight)")
    refused = FakeResidency(refuse=refusal)
    job = Preloader(sessions, refused, clock=Clock(at(date(2026, 12, 1), 6, 15)), tz=TZ)
    [outcome] = job.run()
    assert outcome.result == "refused" and "busy: 1 in flight" in outcome.detail
    # The hold is taken back: the model was not loaded.
    assert refused.keep_alive == {"voice": None} and list(job.outcomes) == [outcome]


def test_slots_are_the_local_quarter_hours_in_a_zone_offset_by_45_minutes(sessions):
    nepal = timezone(timedelta(hours=5, minutes=45))
    # 06:29 and 06:30 local (00:44 and 00:45 UTC) fall in different local slots.
    add_requests(sessions, "voice", [datetime(2026, 11, 29, 6, 29, tzinfo=nepal), datetime(2026, 11, 29, 6, 30, tzinfo=nepal)])
    with sessions() as s:
        [strip] = read_profile(s, NOW, 14, nepal).strips
    assert strip.requests[25] == 1 and strip.requests[26] == 1 and strip.total_requests == 2
