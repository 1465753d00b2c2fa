"""app.gateway.cores: which local runners yield the CPU to the most urgent request, and the holds sent in order."""

from app.gateway.cores import SERVE, CoreShare, Work, plan

A, B, C = "http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"


def test_a_voice_request_holds_the_runners_whose_work_is_all_preemptible_and_less_urgent():
    work = [Work(0, False, A), Work(3, True, B), Work(2, True, C), Work(3, True, C)]
    assert plan(work) == {B: 0, C: 0}


def test_a_runner_with_any_request_that_may_not_wait_is_left_alone():
    assert plan([Work(0, False, A), Work(3, True, B), Work(1, False, B)]) == {}
    # Preemptible but as urgent as the urgent request: no hold either.
    assert plan([Work(1, False, A), Work(1, True, B)]) == {}


def test_the_runner_serving_the_urgent_request_is_never_held_and_only_urgent_classes_hold():
    assert plan([Work(0, False, A), Work(3, True, A)]) == {}
    assert plan([Work(2, True, A), Work(3, True, B)]) == {}  # preemptible work holds nobody
    assert plan([]) == {}


def test_speech_in_serves_own_process_holds_background_runners():
    assert plan([Work(0, False, SERVE), Work(3, True, B)]) == {B: 0}


def test_the_most_urgent_class_decides_and_both_of_its_runners_are_spared():
    work = [Work(1, False, A), Work(0, False, B), Work(3, True, C), Work(0, False, C)]
    # C serves a voice request itself: spared; A (chat, not preemptible) is never held.
    assert plan(work) == {}
    assert plan([Work(1, False, A), Work(0, False, B), Work(2, True, C)]) == {C: 0}


def test_holds_and_their_lifting_are_sent_once_each_in_order():
    sent = []
    share = CoreShare(lambda url, priority, for_s: sent.append((url, priority)))
    bg = share.enter(3, True, B)
    assert sent == []
    voice = share.enter(0, False, A)
    assert sent == [(B, 0)] and share.held() == {B: 0}
    chat = share.enter(1, False, A)
    assert sent == [(B, 0)]  # nothing changed for B
    share.leave(voice)
    assert sent == [(B, 0), (B, 1)]  # the chat request still holds it, at its own priority
    share.leave(chat)
    assert sent == [(B, 0), (B, 1), (B, None)] and share.held() == {}
    share.leave(bg)
    share.leave(bg)  # twice: nothing more
    assert len(sent) == 3


def test_a_runner_that_cannot_be_told_does_not_fail_the_request_and_switching_it_off_lifts_every_hold():
    on = [True]
    sent = []

    def send(url, priority, for_s):
        sent.append((url, priority))
        if url == C:
            raise OSError("connection refused")

    share = CoreShare(send, enabled=lambda: on[0])
    share.enter(3, True, B)
    share.enter(3, True, C)
    voice = share.enter(0, False, A)
    assert sorted(sent) == [(B, 0), (C, 0)]
    on[0] = False
    share.leave(share.enter(1, False, A))  # any change applies the setting
    assert (B, None) in sent and share.held() == {}
    share.leave(voice)
