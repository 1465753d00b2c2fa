"""Admission per class: concurrency limits, bounded queue, priority and weighted fair share, timeouts;
members' quotas inside a class."""

import threading
import time

import pytest

from app.gateway.admission import Admission, MemberQueueFull, QueueFull, QueueTimeout, TooManyPlaces
from app.gateway.members import MemberLimits, Quota, class_quota
from app.policy import ClassPolicy
from tests.helpers import wait_until

VOICE = ClassPolicy("voice", priority=0, max_concurrent=1, max_queue=4, weight=1, queue_timeout_s=5)
CHAT = ClassPolicy("chat", priority=1, max_concurrent=1, max_queue=4, weight=3, queue_timeout_s=5)
DOCS = ClassPolicy("documents", priority=1, max_concurrent=1, max_queue=4, weight=1, queue_timeout_s=5)


def start_waiter(adm, policy, out, tag):
    """Admit in a thread; record tag when admitted (and the ticket)."""
    def run():
        t = adm.admit(policy)
        out.append((tag, t))
    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def test_admitted_at_once_below_the_limit():
    adm = Admission()
    t = adm.admit(CHAT)
    assert t.queue_position == 0
    assert adm.snapshot()["chat"]["in_flight"] == 1
    adm.release(t)
    assert adm.snapshot()["chat"]["in_flight"] == 0


def test_full_queue_is_refused():
    adm = Admission()
    small = ClassPolicy("x", max_concurrent=1, max_queue=1, queue_timeout_s=5)
    first = adm.admit(small)
    out = []
    start_waiter(adm, small, out, "queued")
    wait_until(lambda: adm.snapshot()["x"]["waiting"] == 1)
    with pytest.raises(QueueFull, match="1 requests running and 1 waiting"):
        adm.admit(small)
    adm.release(first)
    wait_until(lambda: out)
    assert out[0][1].queue_position == 1
    assert adm.snapshot()["x"]["rejected_total"] == 1


def test_waiting_past_the_class_timeout_gives_up():
    adm = Admission()
    short = ClassPolicy("x", max_concurrent=1, max_queue=4, queue_timeout_s=0.2)
    adm.admit(short)
    t0 = time.monotonic()
    with pytest.raises(QueueTimeout, match="queue timeout is 0.2 s"):
        adm.admit(short)
    assert 0.15 < time.monotonic() - t0 < 2
    assert adm.snapshot()["x"]["waiting"] == 0


def test_priority_then_weighted_fair_share_under_a_global_limit():
    adm = Admission(max_in_flight_total=1)
    blocker = adm.admit(ClassPolicy("background", priority=3))
    out = []
    # Queue: 4 chat (weight 3), 4 documents (weight 1), then one voice (priority 0) arrives last.
    for i in range(4):
        start_waiter(adm, CHAT, out, f"chat{i}")
        wait_until(lambda i=i: adm.snapshot()["chat"]["waiting"] == i + 1)
    for i in range(3):
        start_waiter(adm, DOCS, out, f"doc{i}")
        wait_until(lambda i=i: adm.snapshot()["documents"]["waiting"] == i + 1)
    start_waiter(adm, VOICE, out, "voice")
    wait_until(lambda: adm.snapshot()["voice"]["waiting"] == 1)
    adm.release(blocker)
    order = []
    while len(order) < 8:
        wait_until(lambda: len(out) > len(order))
        tag, ticket = out[len(order)]
        order.append(tag)
        adm.release(ticket)
    # Priority first: voice, although it came last. Then chat (weight 3) and documents (weight 1)
    # share by virtual time: each chat turn costs 1/3, each documents turn 1; ties go to the earlier arrival.
    assert order == ["voice", "chat0", "doc0", "chat1", "chat2", "chat3", "doc1", "doc2"]


def test_per_class_limit_does_not_block_other_classes():
    adm = Admission()
    adm.admit(VOICE)
    t = adm.admit(CHAT)  # voice is at its limit; chat is not affected
    assert t.queue_position == 0


# -- members' quotas inside a class -----------------------------------------------------------------

FOUR = ClassPolicy("chat", priority=1, max_concurrent=4, max_queue=4, weight=1, queue_timeout_s=5)


def test_a_member_holds_at_most_their_quota_and_the_rest_stays_free_for_others():
    adm = Admission()
    quota = class_quota(MemberLimits(), FOUR, share=0.5)
    assert (quota.max_concurrent, quota.max_queue, quota.own) == (2, 2, False)
    hog = [adm.admit(FOUR, "script", quota) for _ in range(2)]
    out = []
    waiters = [start_waiter_as(adm, FOUR, "script", quota, out, f"script{i}") for i in range(2)]
    wait_until(lambda: adm.member_snapshot()["script"]["chat"] == {"in_flight": 2, "waiting": 2})
    # Its share of the queue is full too: refused at once, naming the member's limits and how to raise them.
    with pytest.raises(MemberQueueFull, match=r"member 'script' already has 2 requests running and 2 waiting in "
                                              r"class 'chat'.*member_class_share.*hearth token member 'script'"):
        adm.admit(FOUR, "script", quota)
    # Another member is admitted at once, ahead of the flood's waiters: the class has two places left.
    t0 = time.monotonic()
    other = adm.admit(FOUR, "alice", quota)
    assert other.queue_position == 0 and time.monotonic() - t0 < 0.5
    assert adm.snapshot()["chat"] == {"in_flight": 3, "waiting": 2, "admitted_total": 3, "rejected_total": 1,
                                      "timed_out_total": 0}
    # A place the script frees goes to the script's own first waiter (no one else waits).
    adm.release(hog[0])
    wait_until(lambda: [tag for tag, _ in out] == ["script0"])
    for t in (hog[1], other, *(t for _, t in out)):
        adm.release(t)
    for w in waiters:
        w.join(5)
    wait_until(lambda: len(out) == 2)
    adm.release(out[1][1])
    # Idle members leave nothing behind.
    assert adm.member_snapshot() == {}


def test_a_waiter_whose_member_is_at_quota_stands_aside_for_the_next_member():
    adm = Admission()
    small = ClassPolicy("x", max_concurrent=2, max_queue=8, queue_timeout_s=5)
    quota = Quota(max_concurrent=1, max_queue=4)
    others = adm.admit(small, "bob", quota)
    mine = adm.admit(small, "script", quota)
    out = []
    start_waiter_as(adm, small, "script", quota, out, "script-late")  # arrives first, waits for script's place
    wait_until(lambda: adm.snapshot()["x"]["waiting"] == 1)
    start_waiter_as(adm, small, "carol", quota, out, "carol")
    wait_until(lambda: adm.snapshot()["x"]["waiting"] == 2)
    # bob's place frees: script is at its quota, so carol (who came later) takes it.
    adm.release(others)
    wait_until(lambda: out)
    assert out[0][0] == "carol"
    adm.release(mine)
    wait_until(lambda: len(out) == 2)
    assert out[1][0] == "script-late" and out[1][1].member == "script"


def test_own_limits_override_the_share_within_the_class_cap():
    assert class_quota(MemberLimits(max_concurrent=10, max_queue=0), FOUR, 0.5) == Quota(4, 0, own=True)
    assert class_quota(MemberLimits(), ClassPolicy("one", max_concurrent=1, max_queue=1), 0.5) == Quota(1, 1)
    assert class_quota(MemberLimits(), ClassPolicy("big", max_concurrent=16, max_queue=64), 0.25) == Quota(4, 16)


def start_waiter_as(adm, policy, member, quota, out, tag, places=1):
    """Admit as a member in a thread; record tag when admitted (and the ticket)."""
    def run():
        out.append((tag, adm.admit(policy, member, quota, places)))
    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


# -- `n` choices take `n` places --------------------------------------------------------------------

EIGHT = ClassPolicy("chat", priority=1, max_concurrent=8, max_queue=8, weight=1, queue_timeout_s=5)


def test_n_choices_take_n_places_of_the_member_the_class_and_the_total():
    adm = Admission(max_in_flight_total=8)
    quota = Quota(max_concurrent=2, max_queue=2)
    # More choices than the member may ever run: refused at once, naming the member's limit.
    with pytest.raises(TooManyPlaces, match=r"'n': 8 choices take 8 places and member 'script' may hold 2 running "
                                            r"places in class 'chat'.*--max-concurrent N.*at most 2 choices"):
        adm.admit(EIGHT, "script", quota, places=8)
    two = adm.admit(EIGHT, "script", quota, places=2)
    assert adm.snapshot()["chat"]["in_flight"] == 2
    assert adm.member_snapshot() == {"script": {"chat": {"in_flight": 2, "waiting": 0}}}
    # The member's two places are taken: the next request of theirs waits, and two more choices fill their queue.
    out = []
    start_waiter_as(adm, EIGHT, "script", quota, out, "script-next", places=2)
    wait_until(lambda: adm.member_snapshot()["script"]["chat"] == {"in_flight": 2, "waiting": 2})
    with pytest.raises(MemberQueueFull):
        adm.admit(EIGHT, "script", quota)
    # The class's eight places, less the member's two: six left for someone else, not seven.
    other = adm.admit(EIGHT, "alice", Quota(8, 8), places=6)
    assert adm.snapshot()["chat"]["in_flight"] == 8
    start_waiter_as(adm, EIGHT, "bob", Quota(8, 8), out, "bob")
    wait_until(lambda: adm.snapshot()["chat"]["waiting"] == 3)
    adm.release(two)
    wait_until(lambda: [tag for tag, _ in out] == ["script-next"])
    assert out[0][1].places == 2
    adm.release(other)
    wait_until(lambda: len(out) == 2)
    for _, t in out:
        adm.release(t)
    assert adm.snapshot()["chat"]["in_flight"] == 0 and adm.member_snapshot() == {}


def test_a_request_for_many_places_is_not_passed_by_single_ones():
    adm = Admission()
    four = ClassPolicy("x", max_concurrent=4, max_queue=8, queue_timeout_s=5)
    held = [adm.admit(four, f"m{i}", Quota(4, 8)) for i in range(3)]
    out = []
    start_waiter_as(adm, four, "big", Quota(4, 8), out, "big", places=3)
    wait_until(lambda: adm.snapshot()["x"]["waiting"] == 3)
    # One place is free, but the three-place request came first: a single one queues behind it.
    start_waiter_as(adm, four, "small", Quota(4, 8), out, "small")
    wait_until(lambda: adm.snapshot()["x"]["waiting"] == 4)
    assert out == []
    for t in held[:2]:
        adm.release(t)
    wait_until(lambda: [tag for tag, _ in out] == ["big"])
    adm.release(out[0][1])
    wait_until(lambda: [tag for tag, _ in out] == ["big", "small"])
    adm.release(out[1][1])
    adm.release(held[2])


def test_more_choices_than_the_class_runs_name_the_class():
    adm = Admission()
    with pytest.raises(TooManyPlaces, match=r"class 'x' runs at most 2 sequences at once"):
        adm.admit(ClassPolicy("x", max_concurrent=2, max_queue=8), "alice", Quota(2, 8, own=True), places=3)
    assert adm.snapshot()["x"]["rejected_total"] == 1
