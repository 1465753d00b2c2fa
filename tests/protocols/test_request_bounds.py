"""Bounds on what a body can make a runner build, checked as the body is read: one table of hostile bodies.

Each hostile body is refused with a 400 in OpenAI's error shape that names the bound and its limit,
before anything is converted or compiled; each body just inside a bound is accepted. The same checks
run in the gateway and in the runner (both read bodies with these schemas), and the Ollama,
Anthropic and Responses bodies are checked as the OpenAI chat bodies they become.
"""

from __future__ import annotations

import json

import pytest

from app.protocols import anthropic, ollama, responses
from app.protocols.openai import (
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_TOOLS,
    ApiError,
    ChatBody,
    CompletionBody,
    NativeCompletionBody,
    parse_body,
    validation_error,
)
from app.schema_subset import (
    MAX_ENUM_VALUES,
    MAX_GRAMMAR_LEFT_DEPTH,
    MAX_REPETITIONS,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_PROPERTIES,
)
from tests.protocols.bounds_cases import CASES, HELLO, ISSUE_FORMAT, chain, nested, props, rf, tool


def refusal(body: dict, schema=ChatBody) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse_body(json.dumps(body).encode(), schema)
    return caught.value


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_a_hostile_body_is_refused_by_name_before_anything_is_built(case):
    err = refusal({"messages": HELLO, **case.extra})
    assert err.status == 400 and err.body()["error"]["type"] == "invalid_request_error"
    assert err.param == case.param and err.code == case.code, err.message
    for fragment in case.fragments:
        assert fragment in err.message, err.message


@pytest.mark.parametrize("extra", [
    rf({"type": "string", "maxLength": MAX_REPETITIONS}),
    rf({"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": MAX_REPETITIONS}),
    rf(props(MAX_SCHEMA_PROPERTIES)),
    rf(props(999, required=False)),
    rf({"enum": list(range(MAX_ENUM_VALUES))}),
    rf(nested(MAX_SCHEMA_DEPTH)),
    rf({"type": "string", "pattern": r"^[a-z]{1,64}(\.[a-z]{1,64})*@[a-z]{2,1000}$"}),
    rf({"type": "integer", "minimum": -(10**18), "maximum": 10**18}),
    rf({"$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"}),
    {"tools": [tool(f"t{i}", props(MAX_SCHEMA_PROPERTIES // MAX_TOOLS)) for i in range(MAX_TOOLS)]},
    {"grammar": 'root ::= [a-z]{0,1999} ("." [a-z]+)*'},
    {"grammar": chain(MAX_GRAMMAR_LEFT_DEPTH - 2)},
    {"logit_bias": {str(i): -100 for i in range(MAX_LOGIT_BIAS)}},
    {"logit_bias": [["hello", False], [15, 100]]},
    {"stop": ["x" * MAX_STOP_CHARS] * 8},
], ids=["max-length", "max-items", "properties", "optional-properties", "enum", "depth", "pattern", "integers",
        "recursive-ref", "tools", "grammar", "grammar-chain", "logit-bias", "logit-bias-pairs", "stops"])
def test_a_body_just_inside_every_bound_is_accepted(extra):
    parse_body(json.dumps({"messages": HELLO, **extra}).encode(), ChatBody)


def test_native_and_completion_bodies_have_the_same_bounds():
    err = refusal({"prompt": "x", "grammar": 'root ::= "a"{5,3}'}, NativeCompletionBody)
    assert (err.param, err.code) == ("grammar", "invalid_grammar")
    err = refusal({"prompt": "x", "json_schema": ISSUE_FORMAT["json_schema"]["schema"]}, NativeCompletionBody)
    assert (err.param, err.code) == ("json_schema", "schema_too_large")
    # (NaN itself no longer gets this far: the body reader refuses it as not JSON.)
    err = refusal({"prompt": "x", "logit_bias": {"1": 1000.0}}, CompletionBody)
    assert err.param == "logit_bias"


def test_a_body_nested_past_what_json_can_read_is_a_400():
    raw = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(ApiError) as caught:
        parse_body(raw, ChatBody)
    assert caught.value.status == 400 and caught.value.code == "invalid_json"
    assert "more than 64 deep" in caught.value.message


def _as_chat(chat: dict) -> ApiError:
    """The refusal of a translated body, as the gateway's pipeline validates it."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as caught:
        ChatBody.model_validate(chat)
    return validation_error(caught.value)


def test_ollama_format_is_bounded_as_response_format():
    chat = ollama.chat_to_openai({"model": "m", "messages": HELLO, "format": ISSUE_FORMAT["json_schema"]["schema"]})
    err = _as_chat(chat)
    assert (err.status, err.param, err.code) == (400, "response_format", "schema_too_large")
    assert "'maxLength'" in err.message


def test_anthropic_tools_and_responses_formats_are_bounded_too():
    chat = anthropic.to_chat({"messages": HELLO, "max_tokens": 5, "tools": [
        {"name": "f", "input_schema": props(1, maxLength=10**9)}]})
    err = _as_chat(chat)
    assert (err.param, err.code) == ("tools", "schema_too_large")
    chat = responses.to_chat({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                                 "schema": {"enum": list(range(5000))}}}})
    err = _as_chat(chat)
    assert (err.param, err.code) == ("response_format", "schema_too_large")
