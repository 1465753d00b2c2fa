"""The runner survives every bound: each hostile body is a 400 in its API's error shape, nothing is built
for it, and the next normal request is answered (fake model); and once on the real GGUF over real HTTP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from app.engine import grammar
from app.residency.supervisor import free_port
from tests.protocols.bounds_cases import CASES, ISSUE_FORMAT, props, rf
from tests.runner.streams import loads

HELLO = [{"role": "user", "content": "Say hi"}]
REPLIES = {"Say hi": "Hello there"}


def assert_serving(c) -> None:
    """A normal request right after a refusal is answered normally."""
    r = c.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 32})
    assert r.status_code == 200, r.get_data(as_text=True)
    assert loads(r)["choices"][0]["message"]["content"] == "Hello there"


def error_of(r) -> dict:
    """A refusal's JSON body."""
    assert r.status_code == 400, r.get_data(as_text=True)
    return json.loads(r.get_data(as_text=True))


def built() -> int:
    """Characters of converted grammars (and refusals) kept: unchanged when a body is refused at the door."""
    return grammar._schema_gbnf.cache_chars() + grammar._calls_gbnf.cache_chars()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_each_bound_is_a_400_and_the_runner_answers_the_next_request(make_runner, case):
    c = make_runner(replies=REPLIES)
    before = built()
    r = c.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 8, **case.extra})
    err = error_of(r)["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == case.param and err["code"] == case.code
    assert all(f in err["message"] for f in case.fragments), err["message"]
    assert built() == before  # refused before any conversion
    assert_serving(c)


def test_a_schema_past_the_converters_budget_is_a_400_naming_it(make_runner):
    # Every door bound lets it through (400 integer fields of 18 digits); its grammar would pass the budget.
    names = [f"n{i}" for i in range(400)]
    schema = {"type": "object", "required": names, "properties": {
        n: {"type": "integer", "minimum": -123456789012345678, "maximum": 987654321098765432} for n in names}}
    c = make_runner(replies=REPLIES)
    r = c.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 8, **rf(schema)})
    err = error_of(r)["error"]
    assert (err["param"], err["code"]) == ("response_format", "grammar_too_large")
    assert f"{grammar.MAX_GENERATED_GRAMMAR_CHARS:,}" in err["message"]
    assert_serving(c)


def test_native_anthropic_and_responses_bodies_are_refused_in_their_own_shapes(make_runner):
    c = make_runner(replies=REPLIES)
    r = c.post("/completion", json={"prompt": "Say hi", "grammar": 'root ::= "a"{5,3}'})
    assert error_of(r)["error"]["code"] == "invalid_grammar"
    r = c.post("/v1/messages", json={"max_tokens": 8, "messages": HELLO,
                                     "tools": [{"name": "f", "input_schema": props(1, maxLength=10**9)}]})
    body = error_of(r)
    assert body["type"] == "error" and "'maxLength'" in body["error"]["message"]
    r = c.post("/v1/responses", json={"input": "Say hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": ISSUE_FORMAT["json_schema"]["schema"]}}})
    assert "'maxLength'" in error_of(r)["error"]["message"]
    assert_serving(c)


@pytest.fixture
def gemma_runner(gemma_path, tmp_path):
    """A real `hearth runner` process on the embedded GGUF, on loopback."""
    port = free_port()
    log_path = tmp_path / "runner.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "runner", "--model", str(gemma_path),
                                 "--port", str(port), "--threads", "2", "--ctx", "1024", "--parallel", "2"],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, log_path.read_text()
        try:
            if client.get("/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.2)
    yield client, proc
    client.close()
    proc.terminate()
    proc.wait(15)


def test_the_issue_body_is_a_400_and_the_real_runner_serves_on(gemma_runner):
    client, proc = gemma_runner
    r = client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 4, "response_format": ISSUE_FORMAT})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "schema_too_large" and "'maxLength'" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    # A constrained request just inside the bounds compiles in llama.cpp and is answered (with a
    # pattern's \d, which llama.cpp's GBNF spells [0-9]).
    r = client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 8, "temperature": 0, **rf(
        {"type": "object", "properties": {"a": {"type": "string", "maxLength": 1000},
                                          "d": {"type": "string", "pattern": r"^\d{4}-\d{2}$"}},
         "required": ["a", "d"]})})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].startswith("{")
    assert proc.poll() is None
