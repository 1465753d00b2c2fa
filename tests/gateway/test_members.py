"""Members' rate windows (requests and tokens per minute and per day) and the limits in force."""

import pytest

from app.gateway.members import MemberLimits, RateLimited, Usage, rate_limits, share_of


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_requests_per_minute_slide_and_retry_after_says_when_a_place_frees():
    clock = Clock()
    usage = Usage(clock)
    limits = {"max_requests_per_min": 3}
    for _ in range(3):
        usage.check_and_count("alice", limits)
        clock.t += 10
    with pytest.raises(RateLimited) as refused:
        usage.check_and_count("alice", limits)
    err = refused.value
    assert (err.limit, err.value, err.used) == ("max_requests_per_min", 3, 3)
    # The first request (at t0) leaves the window 60 s after it: now is t0 + 30.
    assert err.retry_after_s == 31
    assert "member 'alice' has reached their limit of 3 requests per minute" in str(err)
    assert "--max-requests-per-min N" in str(err)
    # Another member is not affected.
    usage.check_and_count("bob", limits)
    clock.t += 31
    usage.check_and_count("alice", limits)


def test_a_refused_request_is_taken_back():
    usage = Usage(Clock())
    usage.check_and_count("alice", {})
    usage.uncount("alice")
    assert usage.snapshot() == {}


def test_tokens_per_minute_and_per_day_count_what_ended():
    clock = Clock()
    usage = Usage(clock)
    limits = {"max_tokens_per_min": 100, "max_tokens_per_day": 250}
    usage.check_and_count("alice", limits)
    usage.add_tokens("alice", 120)  # the request that crosses the limit completes
    with pytest.raises(RateLimited, match="100 tokens per minute") as refused:
        usage.check_and_count("alice", limits)
    assert refused.value.retry_after_s == 61  # the bucket of the 120 tokens leaves the window 61 s on
    clock.t += 61
    usage.check_and_count("alice", limits)
    usage.add_tokens("alice", 140)
    clock.t += 61
    with pytest.raises(RateLimited, match="250 tokens per day") as refused:
        usage.check_and_count("alice", limits)
    # The first 120 tokens leave the day about 24 h after they were used.
    assert 24 * 3600 - 200 < refused.value.retry_after_s <= 24 * 3600
    assert usage.snapshot()["alice"] == {"requests_per_min": 0, "tokens_per_min": 0, "tokens_per_day": 260}


def test_seeded_history_counts_and_a_quiet_day_is_forgotten():
    clock = Clock()
    usage = Usage(clock)
    usage.seed([("alice", clock.t - 3600, 2, 500), ("alice", clock.t - 30, 1, 10)])
    assert usage.snapshot()["alice"] == {"requests_per_min": 1, "tokens_per_min": 10, "tokens_per_day": 510}
    with pytest.raises(RateLimited):
        usage.check_and_count("alice", {"max_tokens_per_day": 500})
    clock.t += 25 * 3600
    assert usage.snapshot() == {}


def test_rate_limits_in_force_are_the_members_own_else_the_settings():
    settings = {"member_max_requests_per_min": 60, "member_max_tokens_per_min": None, "member_max_tokens_per_day": None}
    assert rate_limits(MemberLimits(), settings.get) == {"max_requests_per_min": 60}
    assert rate_limits(MemberLimits(max_requests_per_min=5, max_tokens_per_day=9), settings.get) == {
        "max_requests_per_min": 5, "max_tokens_per_day": 9}


@pytest.mark.parametrize("places,share,expected", [(4, 0.5, 2), (1, 0.5, 1), (3, 0.5, 1), (32, 0.5, 16), (0, 0.5, 0),
                                                    (8, 1.0, 8), (8, 0.05, 1)])
def test_a_share_is_at_least_one_place_and_never_more_than_the_class(places, share, expected):
    assert share_of(places, share) == expected
