"""Engine.hold: a runner yields the cores to another runner's more urgent request (serve's CoreShare), pausing only
while all its own work is of preemptible classes less urgent than that request. A fake model (no llama.cpp)."""

import pytest
from fake_model import FakeModel
from test_engine_fake import collect, greedy, prompt

from app.engine.engine import Engine
from app.policy import SloTargets
from tests.helpers import wait_until

BACKGROUND = SloTargets(ttft_ms=30000, tpot_ms=500, preemptible=True)
VOICE = SloTargets(ttft_ms=500, tpot_ms=100, preemptible=False)


@pytest.fixture
def engine():
    model = FakeModel(n_seq_max=4)
    e = Engine(model, clock=model.clock)
    yield e
    e.stop()


def _held_a_while(engine: Engine) -> None:
    wait_until(lambda: engine.snapshot().counters.held_seconds_total > 0, timeout_s=10,
               message="the engine to pause under the hold")


def test_held_background_work_waits_and_goes_on_when_the_hold_is_lifted(engine):
    r = engine.submit(prompt(10), greedy(6, ignore_eos=True), priority=3, slo=BACKGROUND)
    engine.hold(0, 30)
    engine.start()
    _held_a_while(engine)
    assert engine.model.batches == [] and r.output_tokens == []
    engine.hold(None)
    deltas, fin = collect(r)
    assert fin.finish_reason == "length" and len(r.output_tokens) == 6


def test_a_request_the_hold_does_not_cover_runs_at_once_and_the_held_work_with_it(engine):
    background = engine.submit(prompt(10), greedy(40, ignore_eos=True), priority=3, slo=BACKGROUND)
    engine.hold(1, 30)
    engine.start()
    _held_a_while(engine)
    # As urgent as the hold (a chat question on this runner too): served now, under the hold, and the background
    # sequence is computed in the same batches rather than idling them.
    chat = engine.submit(prompt(11), greedy(12, ignore_eos=True), priority=1, slo=VOICE)
    collect(chat)
    assert len(chat.output_tokens) == 12 and background.num_computed > 0
    # Alone again under the hold: paused until it is lifted.
    engine.hold(None)
    collect(background)
    assert len(background.output_tokens) == 40


def test_non_preemptible_work_is_never_held(engine):
    coding = engine.submit(prompt(12), greedy(3, ignore_eos=True), priority=5, slo=SloTargets(preemptible=False))
    engine.hold(0, 30)
    engine.start()
    deltas, fin = collect(coding)
    assert len(coding.output_tokens) == 3 and engine.snapshot().counters.held_seconds_total == 0


def test_a_hold_ends_by_itself_when_its_time_is_up(engine):
    r = engine.submit(prompt(10), greedy(3, ignore_eos=True), priority=3, slo=BACKGROUND)
    engine.hold(0, 5)
    engine.start()
    _held_a_while(engine)
    engine.model.clock.advance(6)  # the engine's clock: the hold's 5 s are over (it looks again within a second)
    collect(r)
    assert len(r.output_tokens) == 3
