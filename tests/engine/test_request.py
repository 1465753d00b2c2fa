"""Request: the token list the scheduler reads every iteration stays right as output grows."""

from __future__ import annotations

import pytest

from app.engine.request import Delta, Request


def test_all_tokens_follows_appended_output_without_being_rebuilt():
    r = Request(prompt_tokens=[1, 2, 3])
    first = r.all_tokens
    assert first == [1, 2, 3]
    r.output_tokens.append(7)
    r.output_tokens.append(8)
    assert r.all_tokens == [1, 2, 3, 7, 8]
    assert r.all_tokens is first  # the same list, extended in place
    assert r.num_tokens == 5 and r.all_tokens[-1] == 8


def test_all_tokens_is_rebuilt_when_the_output_is_replaced():
    r = Request(prompt_tokens=[1, 2])
    r.output_tokens.extend([5, 6, 7])
    assert r.all_tokens == [1, 2, 5, 6, 7]
    r.output_tokens = [9]
    assert r.all_tokens == [1, 2, 9]


def test_a_delta_is_an_immutable_value_with_named_fields():
    d = Delta("hi", 1)
    assert (d.text, d.num_tokens, d.logprob) == ("hi", 1, None)
    assert d == Delta("hi", 1, None)
    with pytest.raises(AttributeError):
        d.text = "x"


def test_request_ids_are_random_so_they_show_no_one_elses_activity():
    requests = [Request(prompt_tokens=[1]) for _ in range(200)]
    ids = [r.request_id for r in requests]
    assert len(set(ids)) == len(ids)
    # A counter (the id's old kind) would tell a member how many requests others sent between two of theirs.
    steps = {b - a for a, b in zip(ids, ids[1:], strict=False)}
    assert steps != {1} and len(steps) > 100
    assert all(0 <= i < 2**53 for i in ids)  # exact as a JSON number in any client
    # Ties still break in submission order, not by the random id.
    same = [Request(prompt_tokens=[1], arrival_s=5.0) for _ in range(20)]
    assert sorted(same, key=Request.sort_key) == same
    assert same[0].make_stats().request_id == same[0].request_id
