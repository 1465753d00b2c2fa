"""Every route of the gateway's openapi.json fuzzed against a real `hearth serve` (issue 41): requests the
description allows and requests it does not (schemathesis' positive and negative modes), each answered below
500 in its API's error shape, and the serve still serving afterwards.

Schemathesis, not hand-written hypothesis strategies: it reads the published description, so a route or a
field added there is fuzzed without touching this file, and its negative mode breaks each constraint the
description states (types, required fields, bounds), which is where a parser's 500s hide. Hypothesis drives
it underneath (tests/reliability/test_fuzz.py fuzzes the body parser alone with hypothesis).

The serve's catalog holds the stand-in model, a GGUF nothing can load, and each generation body names a model
the catalog lacks (a missing model is the default model's path, tests/gateway/test_untrusted_input.py): everything a request passes before a runner is asked (token, body reader, validation,
adapters, class, model resolution) runs for every case, without starting a runner per case. The real-model
serve's schemathesis run (tests/reliability/test_fuzz.py, `model` tier) goes on into the runners.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from app.gateway.openapi import openapi_document
from tests.fuzzing import cases, label, operations
from tests.helpers import ServeStarter

# Per operation (24 of them), both modes: about a thousand requests in well under a minute on the 2-core box.
MAX_EXAMPLES = 50
# A model no catalog holds: generation routes answer 404 after everything that reads the body has run.
ABSENT_MODEL = "fuzz-no-such-model"
# Routes that answer 501 by design (Ollama's create and push: Hearth builds and pushes no models).
NOT_IMPLEMENTED = {"/api/create", "/api/push"}
SHAPES = {"/v1/messages": "anthropic"}
# The routes that would start a runner for the model a body names (or for the default model, without one).
GENERATION = {"/v1/chat/completions", "/v1/completions", "/infill", "/v1/embeddings", "/v1/messages", "/v1/responses",
              "/api/chat", "/api/generate", "/api/embed", "/api/embeddings"}

schema = schemathesis.openapi.from_dict(openapi_document())
STATS = {"cases": 0, "started": None}


@pytest.fixture(scope="module")
def standin_serve(tmp_path_factory, standin_model):
    """A real `hearth serve` whose only model cannot be loaded."""
    starter = ServeStarter(tmp_path_factory.mktemp, standin_model)
    yield starter()
    starter.stop_all()


def _error_message(path: str, body) -> str:
    """The message of an error answer, in the route's API shape."""
    if path.startswith("/api/"):
        return body["error"]
    if SHAPES.get(path) == "anthropic":
        assert body["type"] == "error"
    return body["error"]["message"]


@pytest.mark.parametrize("operation", operations(schema), ids=label)
@settings(max_examples=MAX_EXAMPLES, deadline=None, phases=[Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_no_request_gets_a_5xx(operation, data, standin_serve):
    case = data.draw(cases(operation), label="case")
    STATS["started"] = STATS["started"] or time.monotonic()
    STATS["cases"] += 1
    if isinstance(case.body, dict) and case.operation.path in GENERATION:
        case.body["model"] = ABSENT_MODEL
    case.headers = {**(case.headers or {}), "Authorization": f"Bearer {standin_serve.tokens['alice']}"}
    response = case.call(base_url=standin_serve.url, timeout=60)
    path = case.operation.path
    allowed = 501 if path in NOT_IMPLEMENTED else 499
    assert response.status_code <= allowed, (case.as_curl_command(), response.text[:500])
    if response.status_code >= 400 and "application/json" in response.headers.get("content-type", ""):
        message = _error_message(path, response.json())
        assert message and "Traceback" not in message


# A body each generation route takes (its model absent from the catalog), for the field-by-field sweep below.
HELLO = [{"role": "user", "content": "hi"}]
VALID = {
    "/v1/chat/completions": {"messages": HELLO}, "/v1/completions": {"prompt": "hi"},
    "/infill": {"input_prefix": "a", "input_suffix": "b"}, "/v1/embeddings": {"input": "hi"},
    "/v1/messages": {"messages": HELLO, "max_tokens": 8}, "/v1/responses": {"input": "hi"},
    "/api/chat": {"messages": HELLO}, "/api/generate": {"prompt": "hi"}, "/api/embed": {"input": "hi"},
    "/api/embeddings": {"prompt": "hi"},
}
# What a client may wrongly put in any field: each JSON type, and the two values json.loads once failed on.
DEEP, LONG = "__deep__", "__long__"
WRONG = ["high", "", -1, 2**63, 1.5e308, True, None, [], {}, [{}], {"": None}, "\u0000", DEEP, LONG]


def _fields(path: str) -> list[str]:
    body_schema = openapi_document()["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    name = body_schema["$ref"].rsplit("/", 1)[1]
    return sorted(openapi_document()["components"]["schemas"][name]["properties"])


@pytest.mark.parametrize("path", sorted(VALID))
def test_every_field_of_every_generation_route_takes_any_wrong_value_without_a_5xx(standin_serve, path):
    """Each described field of a valid body set to each kind of wrong value, one at a time: the sweep that finds
    a field read before it is checked ("reasoning": "high"), which random generation may take long to hit."""
    headers = {"Authorization": f"Bearer {standin_serve.tokens['alice']}", "Content-Type": "application/json"}
    failures = []
    with httpx.Client(base_url=standin_serve.url, timeout=60, headers=headers) as client:
        for field in _fields(path):
            for wrong in WRONG:
                if field == "model" and wrong in ("", None):
                    continue  # the default model's path (503 here: it cannot load), tests/gateway/test_untrusted_input.py
                body = {**VALID[path], field: wrong}
                if field != "model":
                    body["model"] = ABSENT_MODEL
                text = (json.dumps(body).replace(f'"{DEEP}"', "[" * 100_000 + "]" * 100_000)
                        .replace(f'"{LONG}"', "9" * 5000))
                STATS["cases"] += 1
                r = client.post(path, content=text)
                if r.status_code >= 500 or "application/json" not in r.headers.get("content-type", ""):
                    failures.append((field, wrong if len(str(wrong)) < 20 else str(wrong)[:20], r.status_code,
                                     r.text[:200]))
    assert not failures


def test_the_serve_still_serves_after_the_fuzzing(standin_serve, capsys):
    # After the parametrized cases above (pytest runs a module's tests in order).
    health = httpx.get(f"{standin_serve.url}/healthz", timeout=30)
    assert health.status_code == 200
    models = httpx.get(f"{standin_serve.url}/v1/models", timeout=30,
                       headers={"Authorization": f"Bearer {standin_serve.tokens['alice']}"})
    assert models.status_code == 200 and models.json()["data"]
    assert standin_serve.proc.poll() is None
    if STATS["started"] is not None:
        with capsys.disabled():
            print(f"\nfuzzing: {STATS['cases']} requests (schemathesis over {len(list(schema.get_all_operations()))} "
                  "operations, then the field sweep) "
                  f"in {time.monotonic() - STATS['started']:.1f} s")


def test_the_description_names_every_route_the_gateway_serves(gateway_app):
    served = set()
    for rule in gateway_app.url_map.iter_rules():
        if rule.endpoint.split(".")[0] in ("gateway", "ollama", "vendors", "audio"):
            path = re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule)
            served |= {(path, method.lower()) for method in rule.methods - {"HEAD", "OPTIONS"}}
    described = {(path, method) for path, operations in openapi_document()["paths"].items() for method in operations}
    assert served == described
