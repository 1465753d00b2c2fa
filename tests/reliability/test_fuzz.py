"""Fuzzing: the request schema (hypothesis) and the gateway's published OpenAPI description (schemathesis).

Property: whatever arrives, the answer is a 4xx naming the problem or a normal answer, never a 5xx
and never an exception escaping the parser. Example counts are kept small for a 2-core machine.
"""

from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error

from app.gateway.openapi import openapi_document
from app.protocols.openai import ApiError, ChatBody, CompletionBody, parse_body
from app.runner.sampling import sampling_params
from tests.fuzzing import cases, label, operations

FIELDS = sorted(set(ChatBody.model_fields) | set(CompletionBody.model_fields) | {"tools", "logprobs", "role"})
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
# Bodies shaped like requests: known field names with any JSON values, plus unknown keys.
bodies = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=10), json_values, max_size=8)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot", ""])},
                                          optional={"content": json_values}), max_size=3)


def _parse_ok_or_4xx(raw: bytes, schema) -> None:
    try:
        body, _ = parse_body(raw, schema)
    except ApiError as err:
        assert 400 <= err.status < 500
        assert err.message and err.body()["error"]["message"] == err.message
        return
    # Whatever validates must turn into engine settings without surprises.
    sampling_params(body, 16)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_escape_the_parser(raw):
    _parse_ok_or_4xx(raw, ChatBody)
    _parse_ok_or_4xx(raw, CompletionBody)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies, messages)
def test_request_shaped_json_is_either_valid_or_a_4xx(body, msgs):
    _parse_ok_or_4xx(json.dumps(body).encode(), CompletionBody)
    _parse_ok_or_4xx(json.dumps({**body, "messages": msgs}).encode(), ChatBody)


# The description the gateway publishes at /openapi.json (the test below checks they are the same
# document). Loaded at import: schemathesis's fixture-based loader does not run under pytest 9.
schema = schemathesis.openapi.from_dict(openapi_document())
MAX_FUZZ_TOKENS = 2


@pytest.mark.parametrize("operation", operations(schema), ids=label)
@settings(max_examples=15, deadline=None, phases=[Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_gateway_never_answers_5xx_to_what_its_description_allows(operation, data, serve):
    case = data.draw(cases(operation), label="case")
    if case.operation.path in ("/api/create", "/api/push"):
        return  # 501 by design (Hearth builds and pushes no models); tests/gateway/test_fuzz_routes.py covers them
    if isinstance(case.body, dict):
        # Valid bodies really generate: keep them short so the suite stays fast on two cores.
        # Absent, the class default (hundreds of tokens) would apply.
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = case.body.get(key)
            # JSON integers may come as 2000.0, which the schema accepts as 2000.
            if value is None or (isinstance(value, int | float) and not isinstance(value, bool)
                                 and value > MAX_FUZZ_TOKENS):
                case.body[key] = MAX_FUZZ_TOKENS
        if case.operation.path in ("/api/chat", "/api/generate"):
            # Ollama's length is options.num_predict.
            options = case.body.get("options")
            case.body["options"] = {**(options if isinstance(options, dict) else {}), "num_predict": MAX_FUZZ_TOKENS}
    # A real token, so bodies get past authentication (401s are covered by the bad-input table).
    case.headers = {**(case.headers or {}), "Authorization": f"Bearer {serve.tokens['alice']}"}
    response = case.call_and_validate(base_url=serve.url, checks=[not_a_server_error], timeout=120)
    if response.status_code >= 400 and "application/json" in str(response.headers.get("content-type")):
        error = response.json()["error"]  # Ollama's routes answer {"error": "message"}, the others an object
        assert error if isinstance(error, str) else error["message"]


def test_openapi_description_is_generated_from_the_request_models(serve):
    doc = serve.client.get("/openapi.json").json()
    assert doc == json.loads(json.dumps(openapi_document()))
    assert doc["openapi"].startswith("3.")
    chat = doc["components"]["schemas"]["ChatBody"]
    # A field with an alias ("speculative.n_max", llama-server's name) is described under the name clients send.
    assert {f.alias or name for name, f in ChatBody.model_fields.items()} <= set(chat["properties"])
    assert chat["properties"]["temperature"]["maximum"] == 2.0
    assert doc["paths"]["/v1/chat/completions"]["post"]["security"] == [{"bearerAuth": []}]


def test_legacy_functions_that_are_not_a_list_are_a_400():
    # Found by the fuzz test above in CI: {"functions": 1} reached a for loop.
    for functions in (1, "f", {"name": "x"}, True):
        raw = json.dumps({"messages": [{"role": "user", "content": "hi"}], "functions": functions}).encode()
        try:
            parse_body(raw, ChatBody)
        except ApiError as err:
            assert err.status == 400 and "'functions' must be a list" in err.message
        else:
            raise AssertionError(f"functions={functions!r} was accepted")
