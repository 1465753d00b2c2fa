"""Tests for app.engine.scheduler: admission, token budget, modes, preemption, driven without llama.cpp."""

import random

import numpy as np
import pytest
from fake_model import FakeModel

from app.engine.engine import DECODE_OK
from app.engine.request import ContextOverflow, QueueFull, Request, RequestStatus, SamplingParams
from app.engine.scheduler import PACE_MIN_SAMPLES, ChunkCosts, CostModel, Scheduler, SchedulerConfig
from app.policy import NO_SLO, Mode, SloTargets

NEXT_TOKEN = 7


def make_config(**overrides) -> SchedulerConfig:
    """A roomy configuration; tests override what they exercise."""
    # Prompts of make_request share their leading tokens: these tests are about admission and
    # batches with every prompt computed; the prefix cache has its own tests (test_prefix_cache.py).
    values = dict(max_seqs=4, kv_cells=256, max_batch_tokens=64, token_budget=64, decode_reserve_cells=0,
                  prefix_cache=False)
    values.update(overrides)
    return SchedulerConfig(**values)


def make_request(n_prompt: int = 4, priority: int = 0, arrival_s: float = 0.0, max_tokens: int = 4, tag: int = 1):
    """A request whose prompt starts with tag, so its tokens are recognisable in a batch."""
    return Request(
        prompt_tokens=[tag] + [100 + i for i in range(n_prompt - 1)],
        params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        priority=priority,
        arrival_s=arrival_s,
    )


def step(sched: Scheduler, admit: bool = True, now: float = 0.0):
    """One iteration as the engine does it with unlimited KV: schedule, commit, one token per logits row."""
    schedule = sched.schedule(admit=admit, now=now)
    sched.commit(schedule)
    for c in schedule.chunks:
        if c.want_logits:
            c.request.output_tokens.append(NEXT_TOKEN)
            if c.request.first_token_s is None:
                c.request.first_token_s = now
    return schedule


def layout(schedule) -> list[tuple[int, int, int, bool]]:
    """A batch as (request id, start position, number of tokens, wants logits)."""
    return [(c.request.request_id, c.start_pos, len(c.tokens), c.want_logits) for c in schedule.chunks]


def simulate(sched: Scheduler, model: FakeModel, max_iterations: int = 10_000):
    """The engine loop on the fake model: decode, preempt on "no KV slot", sample, release at max_tokens."""
    finished: list[Request] = []
    batches = []
    for _ in range(max_iterations):
        if not sched.has_work:
            return finished, batches
        schedule = sched.schedule()
        while schedule.chunks:
            rc, _ = model.decode(schedule.chunks)
            if rc == DECODE_OK:
                break
            assert len(sched.running) > 1, "a lone sequence that fits the context was refused"
            model.clear_seq(sched.preempt(sched.choose_victim()))
            schedule = sched.schedule(admit=False)
        sched.commit(schedule)
        batches.append(schedule)
        assert sched.kv_used == model.kv_used
        for c in schedule.chunks:
            r = c.request
            if c.want_logits:
                r.output_tokens.append(model.next_token(tuple(r.prompt_tokens), tuple(r.all_tokens)))
                if len(r.output_tokens) >= r.params.max_tokens:
                    slot = sched.finish(r, RequestStatus.FINISHED_LENGTH)
                    model.clear_seq(slot)
                    finished.append(r)
    raise AssertionError("the simulation did not finish")


# -- configuration and queue --------------------------------------------------------------------


def test_config_rejects_a_budget_below_one_token_per_sequence():
    with pytest.raises(ValueError, match="at least max_seqs"):
        make_config(max_seqs=8, token_budget=4)


def test_config_rejects_a_budget_above_n_batch():
    with pytest.raises(ValueError, match="cannot exceed"):
        make_config(token_budget=128, max_batch_tokens=64)


def test_config_rejects_zero_slots():
    with pytest.raises(ValueError, match="max_seqs"):
        make_config(max_seqs=0)


def test_prompt_that_fills_the_context_is_refused():
    sched = Scheduler(make_config(kv_cells=32))
    with pytest.raises(ContextOverflow) as info:
        sched.add_request(make_request(32))
    assert (info.value.num_prompt_tokens, info.value.n_ctx) == (32, 32)
    assert sched.waiting == []
    sched.add_request(make_request(31))  # one cell left for the first generated token
    assert len(sched.waiting) == 1


def test_queue_full_when_max_waiting_reached():
    sched = Scheduler(make_config(max_waiting=3))
    for _ in range(3):
        sched.add_request(make_request())
    with pytest.raises(QueueFull) as info:
        sched.add_request(make_request())
    assert info.value.max_waiting == 3
    assert len(sched.waiting) == 3
    # Running requests don't count against the waiting limit.
    sched.schedule()
    sched.add_request(make_request())
    assert len(sched.waiting) == 1


def test_waiting_queue_is_in_priority_then_arrival_then_id_order():
    sched = Scheduler(make_config())
    a = make_request(priority=1, arrival_s=1.0)
    b = make_request(priority=0, arrival_s=3.0)
    c = make_request(priority=0, arrival_s=2.0)
    d = make_request(priority=1, arrival_s=0.5)
    e = make_request(priority=0, arrival_s=2.0)  # same arrival as c, later id
    for r in (a, b, c, d, e):
        sched.add_request(r)
    assert sched.waiting == [c, e, b, d, a]
    assert all(r.status is RequestStatus.WAITING for r in sched.waiting)


def test_find_looks_in_waiting_and_running():
    sched = Scheduler(make_config(max_seqs=1))
    a, b = make_request(arrival_s=0), make_request(arrival_s=1)
    sched.add_request(a)
    sched.add_request(b)
    sched.schedule()
    assert sched.find(a.request_id) is a
    assert sched.find(b.request_id) is b
    assert sched.find(-1) is None


# -- admission ----------------------------------------------------------------------------------


def test_admission_takes_policy_order_up_to_the_slot_limit():
    sched = Scheduler(make_config(max_seqs=2))
    low_early = make_request(priority=2, arrival_s=0.0)
    high_late = make_request(priority=0, arrival_s=5.0)
    mid = make_request(priority=1, arrival_s=1.0)
    high_early = make_request(priority=0, arrival_s=4.0)
    for r in (low_early, high_late, mid, high_early):
        sched.add_request(r)
    sched.schedule(now=10.0)
    assert sched.running == [high_early, high_late]
    assert [r.slot for r in sched.running] == [0, 1]
    assert sched.waiting == [mid, low_early]
    assert sched.free_slots == []
    assert high_early.status is RequestStatus.RUNNING and mid.status is RequestStatus.WAITING
    assert high_early.first_scheduled_s == 10.0 and mid.first_scheduled_s is None


def test_a_freed_slot_goes_to_the_next_in_policy_order():
    sched = Scheduler(make_config(max_seqs=2))
    a, b = make_request(arrival_s=0.0), make_request(arrival_s=1.0)
    c = make_request(priority=1, arrival_s=2.0)
    for r in (a, b, c):
        sched.add_request(r)
    sched.schedule()
    urgent = make_request(priority=0, arrival_s=9.0)  # a latecomer of a more urgent class
    sched.add_request(urgent)
    slot_a = sched.finish(a, RequestStatus.FINISHED_STOP)
    assert slot_a == 0 and a.slot is None and a.status is RequestStatus.FINISHED_STOP
    sched.schedule()
    assert sched.running == [b, urgent]
    assert urgent.slot == 0
    assert sched.waiting == [c]


def test_admission_keeps_a_decode_reserve_per_running_sequence():
    sched = Scheduler(make_config(kv_cells=100, decode_reserve_cells=10))
    a = make_request(40, arrival_s=0)
    b = make_request(30, arrival_s=1)  # 40 running + 30 + 1 * 10 reserve = 80 <= 100: admitted
    c = make_request(11, arrival_s=2)  # 70 running + 11 + 2 * 10 reserve = 101 > 100: waits
    d = make_request(1, arrival_s=3)  # would fit, but admission never skips the head of the queue
    for r in (a, b, c, d):
        sched.add_request(r)
    sched.schedule()
    assert sched.running == [a, b]
    assert sched.waiting == [c, d]


def test_admission_counts_the_prompts_of_sequences_admitted_in_the_same_iteration():
    # Three 30-token prompts cannot share 64 cells; admitting them together only pushes one
    # of them straight into preemption.
    sched = Scheduler(make_config(kv_cells=64, decode_reserve_cells=0))
    reqs = [make_request(30, arrival_s=t) for t in range(3)]
    for r in reqs:
        sched.add_request(r)
    sched.schedule()
    assert sched.running == reqs[:2]
    assert sched.waiting == reqs[2:]


def test_the_first_sequence_of_an_empty_engine_is_always_admitted():
    sched = Scheduler(make_config(kv_cells=64, decode_reserve_cells=16))
    big = make_request(63)
    sched.add_request(big)
    sched.schedule()
    assert sched.running == [big]


def test_no_sequence_fits_a_full_cache_until_one_finishes():
    sched = Scheduler(make_config(kv_cells=40, max_seqs=4))
    a, b = make_request(30, arrival_s=0), make_request(20, arrival_s=1)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert sched.running == [a]
    for _ in range(3):
        step(sched)
        assert sched.running == [a]
    sched.finish(a, RequestStatus.FINISHED_LENGTH)
    step(sched)
    assert sched.running == [b]


# -- token budget -------------------------------------------------------------------------------


def test_a_long_prompt_is_split_into_chunks_across_iterations():
    sched = Scheduler(make_config(token_budget=16, max_batch_tokens=16))
    r = make_request(50)
    sched.add_request(r)
    got = [layout(step(sched)) for _ in range(5)]
    rid = r.request_id
    assert got == [
        [(rid, 0, 16, False)],
        [(rid, 16, 16, False)],
        [(rid, 32, 16, False)],
        [(rid, 48, 2, True)],
        [(rid, 50, 1, True)],
    ]
    assert r.output_tokens == [NEXT_TOKEN, NEXT_TOKEN]
    assert r.num_computed == 51


def test_chunk_tokens_are_the_sequence_tokens_in_order():
    sched = Scheduler(make_config(token_budget=5, max_batch_tokens=8))
    r = make_request(12)
    sched.add_request(r)
    seen: list[int] = []
    for _ in range(3):
        seen += step(sched).chunks[0].tokens
    assert seen == r.prompt_tokens
    assert step(sched).chunks[0].tokens == [NEXT_TOKEN]


def test_decode_tokens_come_first_then_prompt_chunks_in_policy_order():
    sched = Scheduler(make_config(max_seqs=4, token_budget=8, max_batch_tokens=8))
    a = make_request(2, arrival_s=0)
    b = make_request(12, arrival_s=1)
    c = make_request(12, arrival_s=2)
    for r in (a, b, c):
        sched.add_request(r)
    ia, ib, ic = a.request_id, b.request_id, c.request_id
    got = [step(sched) for _ in range(5)]
    assert [layout(s) for s in got] == [
        [(ia, 0, 2, True), (ib, 0, 6, False)],
        [(ia, 2, 1, True), (ib, 6, 6, True), (ic, 0, 1, False)],
        [(ia, 3, 1, True), (ib, 12, 1, True), (ic, 1, 6, False)],
        [(ia, 4, 1, True), (ib, 13, 1, True), (ic, 7, 5, True)],
        [(ia, 5, 1, True), (ib, 14, 1, True), (ic, 12, 1, True)],
    ]
    assert [(s.num_decode_tokens, s.num_prompt_tokens) for s in got] == [(0, 8), (1, 7), (2, 6), (2, 5), (3, 0)]
    assert all(s.num_tokens <= 8 for s in got)


def test_a_more_urgent_prefill_gets_the_budget_first():
    sched = Scheduler(make_config(max_seqs=2, token_budget=8, max_batch_tokens=8))
    low = make_request(20, priority=1, arrival_s=0)
    sched.add_request(low)
    step(sched)
    high = make_request(20, priority=0, arrival_s=5)
    sched.add_request(high)
    s = step(sched)
    assert sched.running == [low, high]  # running order is admission order ...
    assert layout(s) == [(high.request_id, 0, 8, False)]  # ... but the budget goes by policy order
    assert low.num_computed == 8


def test_batches_never_exceed_the_budget_and_every_request_completes():
    rng = random.Random(1234)
    config = make_config(max_seqs=6, kv_cells=4096, token_budget=24, max_batch_tokens=32)
    sched = Scheduler(config)
    model = FakeModel(n_ctx=4096, n_batch=32, n_seq_max=6)
    reqs = []
    for i in range(30):
        r = make_request(rng.randint(1, 70), priority=rng.randint(0, 2), arrival_s=i, max_tokens=rng.randint(1, 12))
        reqs.append(r)
        sched.add_request(r)
    finished, batches = simulate(sched, model)
    assert sorted(r.request_id for r in finished) == sorted(r.request_id for r in reqs)
    assert all(len(r.output_tokens) == r.params.max_tokens for r in reqs)
    assert model.violations == []
    for s in batches:
        assert s.num_tokens <= config.token_budget
        # Without preemption a decode chunk is the one that starts past the prompt.
        is_decode = [c.start_pos >= len(c.request.prompt_tokens) for c in s.chunks]
        assert is_decode == sorted(is_decode, reverse=True), "decode chunks must come first"
        assert sum(is_decode) == s.num_decode_tokens
        # Only the last prompt chunk can be cut short by the budget.
        assert [c.want_logits for c in s.chunks[:-1]] == [True] * (len(s.chunks) - 1)
    assert model.kv_used == 0
    assert sched.free_slots == list(range(6))


# -- modes --------------------------------------------------------------------------------------


def test_serial_mode_runs_one_request_at_a_time():
    sched = Scheduler(make_config(mode=Mode.SERIAL, max_seqs=4))
    model = FakeModel(n_seq_max=4)
    reqs = [make_request(5, priority=p, arrival_s=i, max_tokens=3) for i, p in enumerate((1, 0, 1, 0))]
    for r in reqs:
        sched.add_request(r)
    finished, batches = simulate(sched, model)
    assert all(len(s.chunks) == 1 for s in batches)
    assert finished == [reqs[1], reqs[3], reqs[0], reqs[2]]
    assert len(batches) == 4 * 3


def test_serial_mode_admits_nothing_while_one_runs():
    sched = Scheduler(make_config(mode=Mode.SERIAL, max_seqs=4))
    a, b = make_request(arrival_s=0), make_request(arrival_s=1)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(3):
        step(sched)
        assert sched.running == [a]
    sched.finish(a, RequestStatus.FINISHED_STOP)
    step(sched)
    assert sched.running == [b]


def test_static_mode_admits_a_new_batch_only_when_the_engine_is_empty():
    sched = Scheduler(make_config(mode=Mode.STATIC, max_seqs=2))
    model = FakeModel(n_seq_max=2)
    short = make_request(3, arrival_s=0, max_tokens=2)
    long = make_request(3, arrival_s=1, max_tokens=6)
    nxt = make_request(3, arrival_s=2, max_tokens=2)
    for r in (short, long, nxt):
        sched.add_request(r)
    finished, batches = simulate(sched, model)
    ids = [[c.request.request_id for c in s.chunks] for s in batches]
    assert ids == [
        [short.request_id, long.request_id],
        [short.request_id, long.request_id],
        [long.request_id],
        [long.request_id],
        [long.request_id],
        [long.request_id],
        [nxt.request_id],
        [nxt.request_id],
    ]
    assert finished == [short, long, nxt]


def test_static_mode_does_not_fill_a_slot_freed_mid_batch():
    sched = Scheduler(make_config(mode=Mode.STATIC, max_seqs=2))
    a, b, c = (make_request(arrival_s=t) for t in range(3))
    for r in (a, b, c):
        sched.add_request(r)
    step(sched)
    sched.finish(a, RequestStatus.FINISHED_STOP)
    for _ in range(3):
        step(sched)
        assert sched.running == [b] and sched.waiting == [c]
    sched.finish(b, RequestStatus.FINISHED_STOP)
    step(sched)
    assert sched.running == [c]


def test_continuous_mode_admits_while_others_generate():
    sched = Scheduler(make_config(mode=Mode.CONTINUOUS, max_seqs=4))
    a = make_request(3, arrival_s=0)
    sched.add_request(a)
    step(sched)
    step(sched)
    b = make_request(5, arrival_s=1)
    sched.add_request(b)
    s = step(sched)
    assert layout(s) == [(a.request_id, 4, 1, True), (b.request_id, 0, 5, True)]
    assert sched.running == [a, b]


def test_continuous_mode_fills_a_freed_slot_at_the_next_iteration():
    sched = Scheduler(make_config(mode=Mode.CONTINUOUS, max_seqs=2))
    a, b, c = (make_request(arrival_s=t) for t in range(3))
    for r in (a, b, c):
        sched.add_request(r)
    step(sched)
    sched.finish(a, RequestStatus.FINISHED_STOP)
    s = step(sched)
    assert sched.running == [b, c]
    assert layout(s) == [(b.request_id, 4, 1, True), (c.request_id, 0, 4, True)]


# -- preemption ---------------------------------------------------------------------------------


def test_victim_is_the_lowest_priority_then_the_most_recent():
    sched = Scheduler(make_config(max_seqs=5))
    reqs = {
        "p0_old": make_request(priority=0, arrival_s=0),
        "p1_old": make_request(priority=1, arrival_s=1),
        "p1_new": make_request(priority=1, arrival_s=3),
        "p0_new": make_request(priority=0, arrival_s=4),
        "p1_mid": make_request(priority=1, arrival_s=2),
    }
    for r in reqs.values():
        sched.add_request(r)
    sched.schedule()
    order = []
    while (victim := sched.choose_victim()) is not None:
        order.append(next(k for k, v in reqs.items() if v is victim))
        sched.preempt(victim)
    assert order == ["p1_new", "p1_mid", "p1_old", "p0_new", "p0_old"]
    assert Scheduler(make_config()).choose_victim() is None


def test_preempt_requeues_for_recompute_ahead_of_later_arrivals():
    sched = Scheduler(make_config(max_seqs=2))
    a, b = make_request(5, arrival_s=0, tag=11), make_request(5, arrival_s=1, tag=22)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(3):
        step(sched, now=1.0)
    later = make_request(5, arrival_s=2)
    sched.add_request(later)
    assert b.output_tokens == [NEXT_TOKEN] * 3 and b.num_computed == 7
    slot = sched.preempt(b)
    assert slot == 1
    assert b.slot is None and b.num_computed == 0 and b.status is RequestStatus.WAITING
    assert b.num_preemptions == 1 and sched.num_preemptions_total == 1
    assert sched.running == [a] and sched.waiting == [b, later]
    assert sched.free_slots == [1]
    assert sched.kv_used == a.num_computed
    # Readmitted, it recomputes prompt and generated tokens in one chunk, then samples.
    s = step(sched, now=5.0)
    assert sched.running == [a, b] and b.slot == 1
    recompute = [c for c in s.chunks if c.request is b]
    assert len(recompute) == 1
    assert recompute[0].tokens == b.prompt_tokens + [NEXT_TOKEN] * 3
    assert recompute[0].start_pos == 0 and recompute[0].want_logits
    assert len(b.output_tokens) == 4
    assert b.first_scheduled_s == 1.0  # queue time is measured to the first admission only


def test_preemption_with_a_tiny_cache_loses_nothing_and_matches_an_unpreempted_run():
    model = FakeModel(n_ctx=64, n_batch=32, n_seq_max=8)
    config = make_config(max_seqs=8, kv_cells=64, token_budget=32, max_batch_tokens=32, decode_reserve_cells=4)
    sched = Scheduler(config)
    reqs = [make_request(6, priority=i % 2, arrival_s=i, max_tokens=24, tag=20 + i) for i in range(8)]
    for r in reqs:
        sched.add_request(r)
    finished, _ = simulate(sched, model)
    assert sorted(r.request_id for r in finished) == sorted(r.request_id for r in reqs)
    assert len(finished) == len(set(map(id, finished)))
    assert sched.num_preemptions_total > 0
    assert sum(r.num_preemptions for r in reqs) == sched.num_preemptions_total
    for r in reqs:
        assert r.output_tokens == model.expected_tokens(r.prompt_tokens, 24)
    assert model.violations == []
    assert model.kv_used == 0 and sched.kv_used == 0


# -- finishing ----------------------------------------------------------------------------------


def test_finish_releases_a_running_request_and_drops_a_waiting_one():
    sched = Scheduler(make_config(max_seqs=1))
    a, b = make_request(arrival_s=0), make_request(arrival_s=1)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert sched.finish(b, RequestStatus.FINISHED_CANCELLED, now=3.0) is None
    assert b.status is RequestStatus.FINISHED_CANCELLED and b.finished_s == 3.0
    assert sched.waiting == []
    assert sched.finish(a, RequestStatus.FINISHED_CANCELLED, now=4.0) == 0
    assert sched.running == [] and sched.free_slots == [0] and not sched.has_work
    assert sched.kv_used == 0


# -- the SLO budget ---------------------------------------------------------------------------------

VOICE = SloTargets(ttft_ms=500, tpot_ms=100, preemptible=False)
BACKGROUND = SloTargets(ttft_ms=30000, tpot_ms=500, preemptible=True)


def slo_request(slo: SloTargets, n_prompt: int, priority: int, arrival_s: float = 0.0, max_tokens: int = 4,
                tag: int = 1, cls: str = "default") -> Request:
    """A request of a class with targets (as the runner builds it from the gateway's header)."""
    r = make_request(n_prompt, priority=priority, arrival_s=arrival_s, max_tokens=max_tokens, tag=tag)
    r.slo = slo
    r.class_name = cls
    return r


def fixed_costs(sched: Scheduler, base_ms: float, decode_ms: float, prefill_ms: float) -> None:
    """Pin the cost model (the engine fits it from measured iterations; these tests choose it), as if warm."""
    sched.cost.base_ms, sched.cost.decode_ms, sched.cost.prefill_ms = base_ms, decode_ms, prefill_ms
    sched.cost.num_samples = PACE_MIN_SAMPLES


def measured_knee(sched: Scheduler, knee: int) -> None:
    """Feed the chunk costs iterations where chunks from `knee` tokens up cost the same per token, smaller dearer."""
    for size in ChunkCosts.SIZES:
        if size > sched.config.token_budget:
            break
        per_token = 1.0 if size >= knee else 3.0
        for _ in range(sched.chunks.min_samples):
            sched.chunks.observe(size, per_token * size)
    assert sched.chunks.knee == knee


def test_the_knee_is_the_smallest_chunk_about_as_cheap_per_token_as_the_cheapest():
    chunks = ChunkCosts(max_tokens=512, default=32, tolerance=0.15, min_samples=2)
    chunks.observe(64, 64 * 5.0)
    assert chunks.knee == 32  # one measured bin, and too few samples: the default
    # A CPU-like curve: a thin chunk pays the iteration's fixed cost for few tokens.
    for size, per_token in ((16, 6.0), (32, 4.0), (64, 3.0), (128, 2.6), (256, 2.5), (512, 2.45)):
        for _ in range(2):
            chunks.observe(size, size * per_token)
    assert chunks.knee == 128  # 2.6 is within 15 % of 2.45; 3.0 is not
    assert chunks.as_dict()["ms_per_token_by_chunk"]["64"]["samples"] == 3
    # A chunk size is the largest bin it reaches: 300 tokens count with 256; fewer than 16 are not binned.
    chunks.observe(300, 300 * 2.5)
    chunks.observe(8, 8 * 50.0)
    assert chunks.as_dict()["ms_per_token_by_chunk"]["256"]["samples"] == 3 and "8" not in chunks.as_dict()["ms_per_token_by_chunk"]
    assert ChunkCosts(max_tokens=64).knee == 32 and ChunkCosts(max_tokens=16).knee == 16  # never above the batch


def test_a_target_out_of_reach_keeps_the_pace_of_a_knee_chunk_instead_of_starving_prefill():
    sched = Scheduler(make_config(max_seqs=3, token_budget=512, max_batch_tokens=512, kv_cells=4096))
    measured_knee(sched, 128)
    decoding_voice_and_a_document(sched)
    fixed_costs(sched, base_ms=10, decode_ms=2, prefill_ms=1)
    # Voice's pace leaves (90 − 12) / 1 = 78 prompt tokens, less than the 128 past which a chunk costs its
    # best: 100 ms is out of this machine's reach beside prefill, so the iteration carries a knee chunk and the
    # pace it keeps, (12 + 128) / 0.9 ms, is reported.
    s = step(sched, now=0.0)
    assert s.num_prompt_tokens == 128 and sched.prefill_budget == 128
    assert sched.reachable_tpot_ms == pytest.approx((12 + 128) / 0.9)
    assert sched.feasibility()["reachable_tpot_ms"] == pytest.approx((12 + 128) / 0.9, abs=0.01)
    # A full batch (3 slots) decoding beside a knee chunk: the TPOT the hardware keeps at the household's busiest.
    assert sched.full_batch_tpot_ms() == pytest.approx((10 + 3 * 2 + 128) / 0.9)


def test_a_voice_prompt_is_not_held_to_a_less_urgent_answers_pace_but_what_follows_it_is():
    chat_slo = SloTargets(ttft_ms=1500, tpot_ms=150, preemptible=False)
    for urgent in (True, False):
        sched = Scheduler(make_config(max_seqs=3, token_budget=512, max_batch_tokens=512, kv_cells=4096))
        chat = slo_request(chat_slo, 4, priority=1, max_tokens=50)
        sched.add_request(chat)
        step(sched, now=0.0)  # chat decodes from here
        fixed_costs(sched, base_ms=10, decode_ms=2, prefill_ms=1)
        if urgent:
            other = slo_request(VOICE, 300, priority=0, arrival_s=1, tag=2)
        else:
            other = slo_request(BACKGROUND, 300, priority=3, arrival_s=1, tag=2)
        sched.add_request(other)
        s = step(sched, now=0.0)
        prompt = [n for rid, _, n, _ in layout(s) if rid == other.request_id]
        if urgent:
            # Voice's whole prompt goes (chat's 135-ms pace would have left it 123 tokens): voice first.
            assert prompt == [300] and sched.tightest_tpot_ms is None
        else:
            # A background prompt keeps chat's pace: (0.9 × 150 − 12) / 1 = 123 tokens.
            assert prompt == [123] and sched.tightest_tpot_ms == 150


def test_paces_are_measuring_until_enough_warm_iterations_were_fitted():
    sched = Scheduler(make_config(max_seqs=3, token_budget=512, max_batch_tokens=512, kv_cells=4096))
    measured_knee(sched, 128)
    decoding_voice_and_a_document(sched)
    # A cold first iteration after a load (2 s) and a few warm ones: the fit's paces are not a verdict yet.
    sched.cost.observe(3, 0, 2000.0)
    for _ in range(PACE_MIN_SAMPLES - 2):
        sched.cost.observe(3, 0, 16.0)
    step(sched, now=0.0)
    feasible = sched.feasibility()
    assert not feasible["pace_measured"] and feasible["reachable_tpot_ms"] is None
    sched.cost.observe(3, 0, 16.0)
    fixed_costs(sched, base_ms=10, decode_ms=2, prefill_ms=1)
    step(sched, now=0.0)
    assert sched.feasibility()["pace_measured"] and sched.feasibility()["reachable_tpot_ms"] is not None


def test_a_pause_of_seconds_does_not_move_a_warm_fit_for_the_iterations_after_it():
    cost = CostModel()
    for i in range(PACE_MIN_SAMPLES * 3):
        cost.observe(8, 0, 40.0 + (i % 3))
    before = cost.iteration_ms(8, 0)
    cost.observe(8, 0, 3000.0)  # the runner stood still for 3 s
    assert cost.iteration_ms(8, 0) < before * 1.05
    # A machine that really slowed down still moves it.
    for _ in range(300):
        cost.observe(8, 0, 120.0)
    assert cost.iteration_ms(8, 0) == pytest.approx(120.0, rel=0.1)


def test_a_target_within_reach_is_budgeted_as_before_and_reported_so():
    sched = Scheduler(make_config(max_seqs=3, token_budget=512, max_batch_tokens=512, kv_cells=4096))
    measured_knee(sched, 256)
    decoding_voice_and_a_document(sched)
    fixed_costs(sched, base_ms=10, decode_ms=2, prefill_ms=0.25)
    # (90 − 12) / 0.25 = 312 prompt tokens keep voice's pace, more than the knee: within reach, budgeted as before.
    assert step(sched, now=0.0).num_prompt_tokens == 312 and sched.reachable_tpot_ms is None
    sched.finish(sched.running[0], RequestStatus.FINISHED_LENGTH)
    step(sched, now=0.0)
    assert sched.feasibility()["reachable_tpot_ms"] is None  # nothing with a target decodes


def test_prefill_budget_follows_the_tightest_tpot_target_among_decoding_sequences():
    sched = Scheduler(make_config(max_seqs=3, token_budget=512, max_batch_tokens=512, kv_cells=4096))
    fixed_costs(sched, base_ms=10, decode_ms=2, prefill_ms=0.5)
    doc = slo_request(BACKGROUND, 2000, priority=3)
    sched.add_request(doc)
    # Nothing decodes: no output is waiting on this iteration, the prefill takes the whole batch.
    assert step(sched).num_prompt_tokens == 512 and sched.tightest_tpot_ms is None
    voice = slo_request(VOICE, 4, priority=0, arrival_s=1, max_tokens=3, tag=2)
    sched.add_request(voice)
    s = step(sched, now=1.0)
    # The voice prompt alone: its first token comes out of this iteration, which waits on no less urgent prompt.
    assert layout(s) == [(voice.request_id, 0, 4, True)]
    # Voice decoding, its first token out at 1.0 s: its second is due by 1.09 s. At 1.0 s that leaves
    # 0.9 × 100 ms − 10 ms base − 2 ms for its token: (90 − 12) / 0.5 prefill tokens.
    s = step(sched, now=1.0)
    assert s.num_decode_tokens == 1 and s.num_prompt_tokens == (90 - 12) / 0.5 == sched.prefill_budget
    assert sched.tightest_tpot_ms == 100
    sched.finish(voice, RequestStatus.FINISHED_LENGTH)
    assert step(sched).num_prompt_tokens == 512  # nothing decodes again


def decoding_voice_and_a_document(sched: Scheduler, max_tokens: int = 50) -> Request:
    """A voice answer decoding (its first token out at 0 s) beside a long document prompt."""
    voice = slo_request(VOICE, 4, priority=0, max_tokens=max_tokens)
    sched.add_request(voice)
    step(sched, now=0.0)
    sched.add_request(slo_request(BACKGROUND, 3000, priority=3, arrival_s=1, tag=2))
    return voice


def test_a_sequence_ahead_of_its_pace_banks_time_for_a_bigger_prompt_chunk():
    sched = Scheduler(make_config(token_budget=512, max_batch_tokens=512, kv_cells=4096))
    voice = decoding_voice_and_a_document(sched)
    fixed_costs(sched, base_ms=10, decode_ms=2, prefill_ms=4)
    # Its 2nd token is due by 0.09 s: one pace leaves (90 − 12) / 4 = 19 prompt tokens, fewer than a
    # chunk is worth (32), so this iteration decodes alone and the time is banked.
    assert step(sched, now=0.0).num_prompt_tokens == 0 and sched.prefill_budget == 19
    # The decode-only iteration was quick: at 0.01 s voice has 2 tokens, its 3rd due by 0.18 s.
    assert len(voice.output_tokens) == 2
    assert step(sched, now=0.01).num_prompt_tokens == (170 - 12) // 4


def test_a_sequence_behind_its_pace_still_lets_one_pace_of_prefill_through():
    sched = Scheduler(make_config(token_budget=512, max_batch_tokens=512, kv_cells=4096))
    decoding_voice_and_a_document(sched)
    fixed_costs(sched, base_ms=10, decode_ms=2, prefill_ms=1)
    # Long overdue (its 2nd token was due by 0.09 s): an iteration may still take 0.9 × 100 ms.
    assert step(sched, now=5.0).num_prompt_tokens == 90 - 12


def test_no_iteration_is_stretched_beyond_the_stall_limit():
    sched = Scheduler(make_config(token_budget=2048, max_batch_tokens=2048, kv_cells=8192))
    voice = decoding_voice_and_a_document(sched, max_tokens=500)
    fixed_costs(sched, base_ms=10, decode_ms=2, prefill_ms=1)
    voice.first_token_s = 10.0  # its pace 10 s ahead of the clock
    assert step(sched, now=0.0).num_prompt_tokens == 5 * 100 - 12  # slo_max_stall × 100 ms


def test_a_small_piece_of_a_long_prompt_waits_but_the_end_of_a_prompt_goes():
    sched = Scheduler(make_config(max_seqs=3, token_budget=512, max_batch_tokens=512, kv_cells=4096))
    decoding_voice_and_a_document(sched)
    fixed_costs(sched, base_ms=10, decode_ms=2, prefill_ms=4)  # one pace leaves (90 − 12) / 4 = 19 tokens
    assert step(sched, now=0.0).num_prompt_tokens == 0 and sched.prefill_budget == 19
    # A 10-token chat prompt fits whole in those 19 tokens: it goes (its TTFT), the document still waits.
    chat = slo_request(SloTargets(ttft_ms=1500, tpot_ms=150), 10, priority=1, arrival_s=2, tag=3)
    sched.add_request(chat)
    s = step(sched, now=0.0)
    assert [(rid, n) for rid, _, n, _ in layout(s) if n > 1] == [(chat.request_id, 10)]


def test_on_a_machine_too_slow_for_the_target_prefill_may_double_the_iteration():
    sched = Scheduler(make_config(token_budget=512, max_batch_tokens=512, kv_cells=4096))
    decoding_voice_and_a_document(sched)
    fixed_costs(sched, base_ms=198, decode_ms=2, prefill_ms=0.5)  # 200 ms before any prefill: 80 ms is out of reach
    assert step(sched).num_prompt_tokens == (2 * 200 - 200) / 0.5


def test_without_targets_or_with_the_budget_off_prefill_takes_the_whole_token_budget():
    for config, slo in ((make_config(), NO_SLO), (make_config(slo_budget=False), VOICE)):
        sched = Scheduler(config)
        fixed_costs(sched, base_ms=60, decode_ms=2, prefill_ms=1)
        sched.add_request(slo_request(slo, 4, priority=0, max_tokens=50))
        step(sched)
        sched.add_request(slo_request(slo, 200, priority=3, arrival_s=1, tag=2))
        assert step(sched).num_prompt_tokens == 63  # the budget less the decode token


def test_cost_model_solved_when_read_gives_the_fit_solved_every_iteration():
    # The fit is solved when a cost is read (and every SOLVE_EVERY observations), not after each iteration: the
    # answer must be the one an every-iteration solve gives, whenever it is read.
    lazy, eager = CostModel(), CostModel()
    rng = random.Random(3)
    for i in range(100):
        n_decode, n_prefill = rng.randint(0, 8), rng.choice([0, 16, 64])
        ms = 4.0 + 1.5 * n_decode + 0.3 * n_prefill + rng.uniform(-0.5, 0.5)
        lazy.observe(n_decode, n_prefill, ms)
        eager.observe(n_decode, n_prefill, ms)
        eager._solve()
        if i % 37 == 0:
            assert lazy.decode_ms == eager.decode_ms
    assert (lazy.base_ms, lazy.decode_ms, lazy.prefill_ms) == (eager.base_ms, eager.decode_ms, eager.prefill_ms)


def test_cost_model_fits_the_measured_iterations():
    cost = CostModel(prior_ms=(1.0, 1.0, 1.0))
    rng = random.Random(7)
    for _ in range(300):
        n_decode, n_prefill = rng.randint(0, 8), rng.choice([0, 0, 16, 64, 256])
        cost.observe(n_decode, n_prefill, 12.0 + 3.0 * n_decode + 0.25 * n_prefill)
    assert cost.base_ms == pytest.approx(12.0, abs=0.5)
    assert cost.decode_ms == pytest.approx(3.0, abs=0.1)
    assert cost.prefill_ms == pytest.approx(0.25, abs=0.01)
    assert cost.prefill_within(100.0, 2) == pytest.approx((100 - 12 - 6) / 0.25, abs=10)


def test_cost_model_solves_its_ridge_system_as_a_general_solver_does():
    # Noisy iterations, decode-only stretches (prefill column all zero but for the ridge) and prompt bursts.
    cost = CostModel()
    rng = random.Random(3)
    for i in range(400):
        n_decode = rng.randint(1, 8)
        n_prefill = 0 if i < 150 or rng.random() < 0.7 else rng.choice([16, 64, 512])
        cost.observe(n_decode, n_prefill, rng.uniform(0.5, 2.0) * (0.2 + 0.05 * n_decode + 0.01 * n_prefill))
        w = cost.prior_weight
        a = np.array(cost._xx) + w * np.eye(3)
        theta = np.linalg.solve(a, np.array(cost._xy) + w * np.array(cost.prior_ms))
        assert (cost.base_ms, cost.decode_ms, cost.prefill_ms) == pytest.approx(
            (max(theta[0], 0.0), max(theta[1], 1e-3), max(theta[2], 1e-3)), rel=1e-9, abs=1e-12)


# -- preemption by priority ---------------------------------------------------------------------------


def test_a_more_urgent_request_preempts_a_preemptible_sequence_whose_cells_stay_cached():
    model = FakeModel(n_ctx=4096, n_batch=64, n_seq_max=2)
    sched = Scheduler(make_config(max_seqs=2, kv_cells=4096, prefix_cache=True), memory=model)
    bg = [slo_request(BACKGROUND, 40, priority=3, arrival_s=i, max_tokens=20, tag=10 + i, cls="background")
          for i in range(2)]
    for r in bg:
        sched.add_request(r)
    step(sched, now=0.0)
    step(sched, now=0.1)
    assert all(r.output_tokens for r in bg)
    voice = slo_request(VOICE, 8, priority=0, arrival_s=5, tag=3, cls="voice")
    sched.add_request(voice)
    s = step(sched, now=5.0)
    # The most recently arrived background sequence gave up its slot; the voice prompt ran at once.
    assert voice in sched.running and bg[1] in sched.waiting and bg[0] in sched.running
    assert (voice.request_id, 0, 8, True) in layout(s)
    assert sched.preemptions_by_class == {("background", "slot"): 1}
    assert bg[1].num_preemptions == 1 and sched.num_preemptions_total == 1
    # Its cells stayed as a cached prefix: on resumption only its last token goes through the model.
    while voice.status is RequestStatus.RUNNING:
        step(sched, now=5.1)
        if len(voice.output_tokens) >= voice.params.max_tokens:
            sched.finish(voice, RequestStatus.FINISHED_LENGTH)
    s = step(sched, now=6.0)
    assert bg[1] in sched.running
    assert [(rid, n) for rid, _, n, _ in layout(s)] == [(bg[0].request_id, 1), (bg[1].request_id, 1)]
    assert not sched.cache.check()


def test_a_class_not_marked_preemptible_keeps_its_slot():
    sched = Scheduler(make_config(max_seqs=1))
    chat = slo_request(SloTargets(tpot_ms=150, preemptible=False), 8, priority=1, max_tokens=20)
    sched.add_request(chat)
    step(sched)
    voice = slo_request(VOICE, 4, priority=0, arrival_s=1, tag=2)
    sched.add_request(voice)
    step(sched, now=1.0)
    assert sched.running == [chat] and sched.waiting == [voice] and sched.num_preemptions_total == 0


def test_only_a_more_urgent_request_preempts():
    sched = Scheduler(make_config(max_seqs=1))
    first = slo_request(BACKGROUND, 8, priority=3, max_tokens=20)
    sched.add_request(first)
    step(sched)
    sched.add_request(slo_request(BACKGROUND, 4, priority=3, arrival_s=1, tag=2))
    step(sched, now=1.0)
    assert sched.running == [first] and sched.num_preemptions_total == 0


def test_a_just_resumed_sequence_is_not_preempted_again_for_a_while():
    sched = Scheduler(make_config(max_seqs=1, preempt_protect_s=2.0))
    bg = slo_request(BACKGROUND, 8, priority=3, max_tokens=100, cls="background")
    sched.add_request(bg)
    step(sched, now=0.0)
    v1 = slo_request(VOICE, 4, priority=0, arrival_s=1, max_tokens=1, tag=2)
    sched.add_request(v1)
    step(sched, now=1.0)
    assert sched.running == [v1]
    sched.finish(v1, RequestStatus.FINISHED_LENGTH)
    step(sched, now=1.5)
    assert sched.running == [bg] and bg.admitted_s == 1.5
    v2 = slo_request(VOICE, 4, priority=0, arrival_s=2, max_tokens=1, tag=3)
    sched.add_request(v2)
    step(sched, now=3.0)  # resumed 1.5 s ago: spared
    assert sched.running == [bg] and sched.waiting == [v2]
    step(sched, now=3.6)  # 2.1 s: preemptible again
    assert sched.running == [v2] and bg.num_preemptions == 2


def test_a_more_urgent_request_short_of_kv_preempts_too():
    sched = Scheduler(make_config(max_seqs=4, kv_cells=128, token_budget=64, max_batch_tokens=64))
    bg = slo_request(BACKGROUND, 100, priority=3, max_tokens=20, cls="background")
    sched.add_request(bg)
    step(sched)
    step(sched)
    voice = slo_request(VOICE, 40, priority=0, arrival_s=1, tag=2, cls="voice")
    sched.add_request(voice)
    step(sched, now=1.0)
    assert sched.running == [voice] and sched.preemptions_by_class == {("background", "kv"): 1}


def test_serial_and_static_modes_never_preempt_by_priority():
    for mode in (Mode.SERIAL, Mode.STATIC):
        sched = Scheduler(make_config(max_seqs=1, mode=mode))
        bg = slo_request(BACKGROUND, 8, priority=3, max_tokens=20)
        sched.add_request(bg)
        step(sched)
        sched.add_request(slo_request(VOICE, 4, priority=0, arrival_s=1, tag=2))
        step(sched, now=1.0)
        assert sched.running == [bg] and sched.num_preemptions_total == 0, mode


def test_a_full_cache_preempts_a_preemptible_class_first():
    sched = Scheduler(make_config())
    chat = slo_request(SloTargets(tpot_ms=150), 8, priority=4, arrival_s=2)  # least urgent, but not preemptible
    bg = slo_request(BACKGROUND, 8, priority=3, arrival_s=1, tag=2)
    voice = slo_request(VOICE, 8, priority=0, arrival_s=0, tag=3)
    for r in (chat, bg, voice):
        sched.add_request(r)
    step(sched)
    assert sched.choose_victim() is bg
    sched.preempt(bg)
    assert sched.choose_victim() is chat  # then by priority, as before


def test_less_urgent_prompts_behind_an_urgent_prefill_get_only_what_its_target_leaves():
    sched = Scheduler(make_config(max_seqs=4, token_budget=512, max_batch_tokens=512, kv_cells=8192))
    fixed_costs(sched, base_ms=10, decode_ms=2, prefill_ms=0.5)
    bg = [slo_request(BACKGROUND, 1500, priority=3, tag=i, arrival_s=i) for i in (1, 2)]
    for r in bg:
        sched.add_request(r)
    # Alone, background prompts fill the batch: one class's own tokens are never held back.
    assert layout(step(sched)) == [(bg[0].request_id, 0, 512, False)]
    # A voice prompt longer than its target's share: all of it goes (its TTFT gains from big chunks) and
    # nothing less urgent rides along; a short one, ending in this iteration, has it to itself too: its first
    # token waits on nothing less urgent (the household mix at 8 through serve: voice TTFT p95 0.133x -> 0.078x of
    # llama-server's, tok/s 1.26x -> 1.21x).
    long_voice = slo_request(VOICE, 300, priority=0, arrival_s=5, tag=9)
    sched.add_request(long_voice)
    assert layout(step(sched)) == [(long_voice.request_id, 0, 300, True)]
    sched.finish(long_voice, RequestStatus.FINISHED_LENGTH)
    voice = slo_request(VOICE, 20, priority=0, arrival_s=6, tag=10)
    sched.add_request(voice)
    assert layout(step(sched)) == [(voice.request_id, 0, 20, True)]
    # Its next iteration, decoding, leaves the background prompt what its TPOT target allows again.
    assert layout(step(sched))[1][0] == bg[0].request_id
