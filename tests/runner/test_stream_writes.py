"""A stream's socket writes (app.runner.generation.watched): tokens that come faster than COALESCE_S apart go out
together, slower ones and the first token at once. Driven on a scripted clock: the engine yields tokens at set
times, and the stream's sleep moves the clock (no real waiting, no timing in the assertions)."""

from __future__ import annotations

import queue

import pytest

from app.engine.request import Finished
from app.runner import generation
from app.runner.generation import COALESCE_S, FLUSH, watched


class ScriptedEngine:
    """An engine whose request's tokens become ready at fixed times of a fake clock (also the stream's clock)."""

    def __init__(self, ready_at: list[float]):
        self.ready_at = list(ready_at)
        self.now = 0.0
        self.request = type("R", (), {"events": queue.SimpleQueue(), "request_id": "r1"})()
        self.cancelled = False

    # the stream's clock and sleep
    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self._produce()

    def _produce(self) -> None:
        while self.ready_at and self.ready_at[0] <= self.now + 1e-12:
            self.ready_at.pop(0)
            last = not self.ready_at
            self.request.events.put(Finished("length", None) if last else ("token", self.now))

    # the engine's side
    def events(self, request, poll_s: float):
        while True:
            if request.events.empty():
                self.now = max(self.now, self.ready_at[0])  # waiting for the engine: the clock runs to its next token
                self._produce()
            ev = request.events.get()
            yield ev
            if isinstance(ev, Finished):
                return

    def cancel(self, request) -> None:
        self.cancelled = True


def writes(engine: ScriptedEngine, monkeypatch) -> list[tuple[float, int]]:
    """(clock at the write, tokens in it) for each write the stream makes."""
    monkeypatch.setattr(generation, "time", engine)
    out, held = [], 0
    for ev in watched({}, engine, engine.request):
        if ev is FLUSH:
            out.append((engine.now, held))
            held = 0
        elif not isinstance(ev, Finished):
            held += 1
    if held:
        out.append((engine.now, held))
    return out


def test_tokens_faster_than_the_interval_go_out_together(monkeypatch):
    # 200 tokens 0.2 ms apart (5,000 tok/s: the tiny model on one stream).
    engine = ScriptedEngine([0.001 + 0.0002 * i for i in range(201)])
    done = writes(engine, monkeypatch)
    assert sum(n for _, n in done) == 200
    assert done[0] == (pytest.approx(0.001), 1)  # the first token at once
    # One write per COALESCE_S at most: 40 ms of tokens in about 10 writes, not 200.
    assert len(done) <= 0.2 * 200 * 0.001 / COALESCE_S + 2
    gaps = [b[0] - a[0] for a, b in zip(done, done[1:])]
    assert all(g >= COALESCE_S - 1e-9 for g in gaps[:-1])
    assert not engine.cancelled


def test_tokens_slower_than_the_interval_each_go_out_when_ready(monkeypatch):
    # A model at 25 ms per token (Gemma 270M on this CPU): every token its own write, none held back.
    ready = [0.030 + 0.025 * i for i in range(21)]
    done = writes(engine := ScriptedEngine(ready), monkeypatch)
    assert [n for _, n in done] == [1] * 20
    assert [t for t, _ in done] == pytest.approx(ready[:20])
    assert not engine.cancelled
