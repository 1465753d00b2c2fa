"""Bad input, one table: every case through the gateway and, where it applies, straight at the runner.

Each case must get the right 4xx in OpenAI's error shape, naming what to fix, and the server must
answer the next normal request. This table supersedes scattered single cases: it is the one place
to add a new kind of bad request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx
import pytest

from app.protocols.openai import MAX_BODY_BYTES, MAX_GENERATION_BODY_BYTES
from tests.images import data_url, image_bytes

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "Say hello."}]
DEFAULT_MODEL = "gemma-3-270m-q4_k_m"
N_CTX = 1024  # runner_ctx of the shared serve (conftest)


@dataclass(frozen=True)
class Case:
    """One bad request and the answer it must get."""

    id: str
    body: dict | bytes
    status: int
    fragment: str  # must appear in the error message (case-insensitive)
    param: str | None = None
    code: str | None = None
    path: str = CHAT
    token: str | None = "alice"  # member whose token is sent; None sends none
    headers: dict = field(default_factory=dict)
    runner: bool = True  # also sent straight to the runner (no token, class or model there)


def chat_body(**extra) -> dict:
    return {"messages": HELLO, "max_tokens": 2, **extra}


CASES = [
    Case("malformed-json", b'{"messages": [', 400, "not valid JSON", code="invalid_json"),
    Case("json-not-an-object", b"[1, 2, 3]", 400, "JSON object", code="invalid_json"),
    Case("invalid-utf8", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "UTF-8",
         code="invalid_utf8"),
    Case("missing-messages", {"max_tokens": 2}, 400, "required", param="messages"),
    Case("empty-messages", {"messages": []}, 400, "at least 1", param="messages"),
    Case("messages-wrong-type", {"messages": "hello"}, 400, "list", param="messages"),
    Case("unknown-role", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "unknown role",
         param="messages.0.role"),
    Case("missing-role", {"messages": [{"content": "hi"}]}, 400, "required", param="messages.0.role"),
    Case("user-message-without-content", {"messages": [{"role": "user"}]}, 400,
         "'messages.0.content' is required in a user message", param="messages"),
    Case("content-wrong-type", {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content",
         param="messages.0.content"),
    Case("image-to-a-model-without-projector", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image_bytes())}}]}]}, 400, "--mmproj",
         param="messages.0.content.0", code="images_unsupported"),
    Case("unknown-content-part", {"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "http://x/y.mp4"}}]}]}, 400, "'image_url'",
         param="messages.0.content.0"),
    Case("max-tokens-wrong-type", chat_body(max_tokens="lots"), 400, "integer", param="max_tokens"),
    Case("max-tokens-zero", chat_body(max_tokens=0), 400, "greater than or equal to 1", param="max_tokens"),
    Case("max-tokens-negative", chat_body(max_tokens=-5), 400, "greater than or equal to 1", param="max_tokens"),
    Case("max-tokens-above-class-cap", chat_body(max_tokens=100_000), 400, "cap", param="max_tokens",
         code="max_tokens_above_cap", runner=False),
    Case("temperature-negative", chat_body(temperature=-0.5), 400, "greater than or equal to 0",
         param="temperature"),
    Case("temperature-too-high", chat_body(temperature=7), 400, "less than or equal to 2", param="temperature"),
    Case("top-p-zero", chat_body(top_p=0), 400, "greater than 0", param="top_p"),
    Case("top-p-above-one", chat_body(top_p=1.5), 400, "less than or equal to 1", param="top_p"),
    Case("top-k-huge", chat_body(top_k=2**40), 400, "top_k", param="top_k"),
    Case("seed-huge", chat_body(seed=2**70), 400, "seed", param="seed"),
    Case("stream-wrong-type", chat_body(stream="yes please"), 400, "boolean", param="stream"),
    Case("stop-wrong-type", chat_body(stop=5), 400, "stop", param="stop"),
    Case("too-many-stops", chat_body(stop=[str(i) for i in range(20)]), 400, "at most", param="stop"),
    Case("n-above-the-cap", chat_body(n=30), 400, "at most 8 choices", param="n"),
    Case("tool-choice-names-no-tool", chat_body(tools=[{"type": "function", "function": {"name": "f"}}],
                                                tool_choice={"type": "function", "function": {"name": "g"}}), 400,
         "not among the tools", param="tool_choice"),
    Case("schema-keyword-unsupported", chat_body(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}), 400, "uniqueItems",
         param="response_format", code="unsupported_schema"),
    Case("echo-unsupported", {"prompt": "hi", "echo": True}, 400, "not supported", param="echo",
         code="unsupported_parameter", path=COMPLETIONS),
    Case("fim-without-fim-tokens", {"prompt": "def f(", "suffix": "    return x", "max_tokens": 2}, 400,
         "fill-in-the-middle", param="suffix", code="fim_unsupported", path=COMPLETIONS),
    Case("prompt-empty", {"prompt": "", "max_tokens": 2}, 400, "prompt", param="prompt", path=COMPLETIONS),
    Case("prompt-missing", {"max_tokens": 2}, 400, "required", param="prompt", path=COMPLETIONS),
    Case("prompt-token-outside-vocab", {"prompt": [1, 99_999_999], "max_tokens": 2}, 400, "outside the vocabulary",
         param="prompt", path=COMPLETIONS),
    Case("prompt-longer-than-context", {"prompt": "word " * 1500, "max_tokens": 2}, 400, f"{N_CTX} tokens",
         param="prompt", code="context_length_exceeded", path=COMPLETIONS),
    Case("body-over-size-limit", b'{"prompt": "' + b"a" * MAX_GENERATION_BODY_BYTES + b'"}', 413,
         f"limit of {MAX_GENERATION_BODY_BYTES:,} bytes", code="body_too_large", path=COMPLETIONS),
    Case("body-over-size-limit-not-generating", b'{"input": "' + b"a" * (MAX_BODY_BYTES + 1) + b'"}', 413,
         f"limit of {MAX_BODY_BYTES:,} bytes", code="body_too_large", path="/v1/embeddings"),
    Case("unknown-model", chat_body(model="no-such-model"), 404, "unknown model", param="model",
         code="model_not_found", runner=False),
    Case("model-path-traversal", chat_body(model="../../../etc/passwd"), 404, "unknown model", param="model",
         code="model_not_found", runner=False),
    Case("unusable-model", chat_body(model="notes"), 404, "cannot be served", param="model",
         code="model_unusable", runner=False),
    Case("unknown-class-header", chat_body(), 400, "unknown class", param="X-Hearth-Class", code="unknown_class",
         headers={"X-Hearth-Class": "poetry"}, runner=False),
    Case("unknown-class-body", chat_body(hearth_class="poetry"), 400, "unknown class", code="unknown_class",
         runner=False),
    Case("class-not-allowed", chat_body(), 403, "may not use class 'chat'", code="class_not_allowed", token="kid",
         headers={"X-Hearth-Class": "chat"}, runner=False),
    Case("missing-token", chat_body(), 401, "missing API token", code="missing_token", token=None, runner=False),
    Case("wrong-token", chat_body(), 401, "invalid or revoked", code="invalid_token", token="hth_not-a-real-token",
         runner=False),
    Case("not-a-bearer-token", chat_body(), 401, "missing API token", code="missing_token", token=None,
         headers={"Authorization": "Basic YWxpY2U6c2VjcmV0"}, runner=False),
]


def _send(client: httpx.Client, case: Case, tokens: dict | None) -> httpx.Response:
    headers = {"Content-Type": "application/json", **case.headers}
    if tokens is not None and case.token is not None:
        headers["Authorization"] = f"Bearer {tokens.get(case.token, case.token)}"
    content = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
    return client.post(case.path, content=content, headers=headers)


def _check(r: httpx.Response, case: Case) -> None:
    assert r.status_code == case.status, (case.id, r.status_code, r.text[:500])
    err = r.json()["error"]
    # OpenAI's four fields; a context overflow also carries llama-server's token counts.
    extra = {"n_prompt_tokens", "n_ctx"} if err.get("type") == "exceed_context_size_error" else set()
    assert set(err) - extra == {"message", "type", "param", "code"}
    assert err["type"].endswith("_error")
    assert case.fragment.lower() in err["message"].lower(), (case.id, err["message"])
    if case.param is not None:
        assert err["param"] == case.param, (case.id, err)
    if case.code is not None:
        assert err["code"] == case.code, (case.id, err)


def _normal_request_works(client: httpx.Client, headers: dict) -> None:
    r = client.post(CHAT, json={"messages": HELLO, "max_tokens": 2, "temperature": 0}, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_the_table_covers_every_kind_of_bad_input():
    assert len(CASES) >= 20
    assert len({c.id for c in CASES}) == len(CASES)
    assert {400, 401, 403, 404, 413} <= {c.status for c in CASES}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_gateway_answers_bad_input_with_a_clear_4xx_and_keeps_serving(serve, case):
    _check(_send(serve.client, case, serve.tokens), case)
    _normal_request_works(serve.client, {"Authorization": f"Bearer {serve.tokens['alice']}"})


@pytest.fixture(scope="module")
def runner(serve):
    """A client straight at the runner that the gateway started for the default model."""
    r = serve.client.post(CHAT, json={"messages": HELLO, "max_tokens": 1},
                          headers={"Authorization": f"Bearer {serve.tokens['alice']}"})
    assert r.status_code == 200 and r.headers["X-Hearth-Model"] == DEFAULT_MODEL
    with httpx.Client(base_url=serve.runner_url(), headers=serve.runner_headers(), timeout=120) as client:
        yield client


@pytest.mark.parametrize("case", [c for c in CASES if c.runner], ids=lambda c: c.id)
def test_runner_answers_bad_input_with_a_clear_4xx_and_keeps_serving(runner, case):
    _check(_send(runner, case, None), case)
    _normal_request_works(runner, {})


@pytest.mark.parametrize("method,path,status", [
    ("GET", CHAT, 405), ("PUT", COMPLETIONS, 405), ("POST", "/v1/nothing", 404), ("GET", "/v1", 404),
])
def test_wrong_method_or_path_is_a_json_error(serve, method, path, status):
    r = serve.client.request(method, path, headers={"Authorization": f"Bearer {serve.tokens['alice']}"})
    assert r.status_code == status
    assert r.json()["error"]["message"]
