"""Admission per class: concurrency limits, bounded queue, priority and weighted fair share, timeouts."""

import threading
import time

import pytest

from app.gateway.admission import Admission, QueueFull, QueueTimeout
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
