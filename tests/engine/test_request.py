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
