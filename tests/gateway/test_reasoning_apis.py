"""Reasoning through every API of the gateway, whole and streamed, end to end: the gateway's pipeline and
adapters (create_app, in process) relay over loopback HTTP to a real runner app (its real routes, the
fake text model with a Qwen3-shaped template), whose answers split thoughts into reasoning_content.

Checked for OpenAI chat, Ollama chat and generate, Anthropic Messages and OpenAI Responses: the
thought reaches each API's own field and never its content; a streamed answer's pieces add up to
exactly the whole answer's fields; each API's thinking control reaches the runner's template; the
class default (voice: off) applies to a request that does not say, and the request's own field wins.
The runner's own /v1/messages and /v1/responses routes are checked the same way.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from werkzeug.serving import make_server

from app.engine.model_config import ModelConfig
from app.gateway.context import services
from app.gateway.tokens import create_token
from app.protocols.sse import events
from app.runner.app import create_app
from app.runner.config import RunnerConfig
from tests.engine.fake_model import FakeTextModel
from tests.helpers import dashboard_app

THINK, END_THINK, CALL, END_CALL = 400, 401, 402, 403
SPECIALS = {THINK: b"<think>", END_THINK: b"</think>", CALL: b"<tool_call>", END_CALL: b"</tool_call>"}
# Qwen3's shape (Hermes calls, <think>, past turns' reasoning shown), with its enable_thinking switch that
# renders an empty thought.
QWEN3_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n"
    "{% endfor %}"
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
THOUGHT, ANSWER = "Let me see.", "Hello there"
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
REPLIES = {
    "<think>\n\n</think>": ANSWER,  # thinking rendered off: the model answers at once (first key: it wins)
    "Hi?": f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}",
    "Long?": f"<think>\nabcdefghijklmnop\n</think>\n\n{ANSWER}",
    "Weather?": f"<think>\nCall it.\n</think>\n\n{CALL_TEXT}",
}
ANSWER_TOKENS = len(ANSWER)  # one token a byte
THOUGHT_TOKENS = 15  # <think>, "\nLet me see.\n", </think>
WEATHER = {"name": "get_weather", "description": "weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


class LoopbackLease:
    """A lease on the loopback runner: what the gateway's Exchange reads of a residency lease."""

    def __init__(self, url: str, model_name: str):
        self.url, self.model_name, self.node_label = url, model_name, "loopback runner"
        self.local, self.pid, self.released = False, None, False

    def release(self) -> None:
        """Nothing is held."""
        self.released = True


@pytest.fixture(scope="module")
def runner_url():
    """A real runner app on the fake model, served over loopback HTTP."""
    model = FakeTextModel(replies=REPLIES, template=QWEN3_LIKE, n_ctx=1024, n_batch=256, n_seq_max=4,
                          specials=SPECIALS)
    app = create_app(RunnerConfig(ModelConfig(path="/models/fake.gguf", n_ctx=1024, n_seq_max=4)), load=False,
                     backend=lambda _: model)
    app.state.load()
    assert app.state.status == "ok", app.state.error
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    app.state.engine.stop()


@pytest.fixture
def gateway(tmp_path, standin_model, runner_url, monkeypatch):
    """The gateway in process, every model leased on the loopback runner, and alice's token (chat, voice)."""
    with dashboard_app(tmp_path, standin_model) as app:
        svc = services(app)
        with svc.sessions() as s:
            token, _ = create_token(s, "alice", "chat", ["voice"])
            s.commit()
        monkeypatch.setattr(svc.router, "acquire", lambda name: LoopbackLease(runner_url, name))
        app.model_name = next(iter(svc.catalog.model_specs()))
        app.auth = {"Authorization": f"Bearer {token}"}
        yield app


def post(app, path: str, body: dict, klass: str | None = None):
    """A request to the gateway with alice's token (and a class, if given); the response, checked 200."""
    headers = {**app.auth, **({"X-Hearth-Class": klass} if klass else {})}
    r = app.test_client().post(path, json={"model": app.model_name, **body}, headers=headers)
    assert r.status_code == 200, r.get_data(as_text=True)
    return r


def ndjson(r) -> list[dict]:
    return [json.loads(line) for line in r.get_data(as_text=True).splitlines() if line]


def sse(r) -> list[dict]:
    return [ev.json() for ev in events([r.get_data()]) if not ev.done]


# -- each API read into (reasoning, content, calls): whole, and streamed pieces concatenated ---------


def openai_chat(send, body: dict, stream: bool) -> dict:
    req = {"messages": [{"role": "user", "content": body.pop("say")}], **body}
    if not stream:
        message = send("/v1/chat/completions", req).get_json()["choices"][0]["message"]
        return {"reasoning": message.get("reasoning_content", ""), "content": message["content"] or "",
                "calls": [c["function"]["name"] for c in message.get("tool_calls") or []]}
    deltas = [c["choices"][0]["delta"] for c in sse(send("/v1/chat/completions", {**req, "stream": True}))
              if c.get("choices")]
    return {"reasoning": "".join(d.get("reasoning_content") or "" for d in deltas),
            "content": "".join(d.get("content") or "" for d in deltas),
            "calls": [c["function"]["name"] for d in deltas for c in d.get("tool_calls") or [] if c.get("id")]}


def ollama_chat(send, body: dict, stream: bool) -> dict:
    req = {"messages": [{"role": "user", "content": body.pop("say")}], "stream": stream, **body}
    lines = ndjson(send("/api/chat", req))
    messages = [line["message"] for line in lines]
    return {"reasoning": "".join(m.get("thinking", "") for m in messages),
            "content": "".join(m["content"] for m in messages),
            "calls": [c["function"]["name"] for m in messages for c in m.get("tool_calls") or []],
            "eval_count": lines[-1]["eval_count"]}


def ollama_generate(send, body: dict, stream: bool) -> dict:
    lines = ndjson(send("/api/generate", {"prompt": body.pop("say"), "stream": stream, **body}))
    return {"reasoning": "".join(line.get("thinking", "") for line in lines),
            "content": "".join(line["response"] for line in lines), "calls": [], "eval_count": lines[-1]["eval_count"]}


def anthropic(send, body: dict, stream: bool) -> dict:
    req = {"max_tokens": 128, "messages": [{"role": "user", "content": body.pop("say")}], **body}
    if not stream:
        blocks = send("/v1/messages", req).get_json()["content"]
        assert all(b["signature"] == "" for b in blocks if b["type"] == "thinking")
        return {"reasoning": "".join(b["thinking"] for b in blocks if b["type"] == "thinking"),
                "content": "".join(b["text"] for b in blocks if b["type"] == "text"),
                "calls": [b["name"] for b in blocks if b["type"] == "tool_use"], "blocks": [b["type"] for b in blocks]}
    evs = sse(send("/v1/messages", {**req, "stream": True}))
    deltas = [e["delta"] for e in evs if e["type"] == "content_block_delta"]
    opened = [e["content_block"] for e in evs if e["type"] == "content_block_start"]
    thinking_blocks = [e["index"] for e in evs if e["type"] == "content_block_start"
                       and e["content_block"]["type"] == "thinking"]
    for index in thinking_blocks:  # each thinking block is closed by an (empty) signature, then its stop
        closing = [e for e in evs if e.get("index") == index][-2:]
        assert closing[0]["delta"] == {"type": "signature_delta", "signature": ""}
        assert closing[1]["type"] == "content_block_stop"
    return {"reasoning": "".join(d["thinking"] for d in deltas if d["type"] == "thinking_delta"),
            "content": "".join(d["text"] for d in deltas if d["type"] == "text_delta"),
            "calls": [b["name"] for b in opened if b["type"] == "tool_use"], "blocks": [b["type"] for b in opened]}


def responses(send, body: dict, stream: bool) -> dict:
    req = {"input": body.pop("say"), **body}

    def read(output: list[dict]) -> dict:
        return {"reasoning": "".join(p["text"] for i in output if i["type"] == "reasoning" for p in i["content"]),
                "content": "".join(p["text"] for i in output if i["type"] == "message" for p in i["content"]),
                "calls": [i["name"] for i in output if i["type"] == "function_call"],
                "blocks": [i["type"] for i in output]}

    if not stream:
        resp = send("/v1/responses", req).get_json()
        return {**read(resp["output"]), "reasoning_tokens": resp["usage"]["output_tokens_details"]["reasoning_tokens"]}
    evs = sse(send("/v1/responses", {**req, "stream": True}))
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    done = evs[-1]["response"]
    streamed = {"reasoning": "".join(e["delta"] for e in evs if e["type"] == "response.reasoning_text.delta"),
                "content": "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta"),
                "calls": [e["item"]["name"] for e in evs if e["type"] == "response.output_item.added"
                          and e["item"]["type"] == "function_call"],
                "blocks": [e["item"]["type"] for e in evs if e["type"] == "response.output_item.added"],
                "reasoning_tokens": done["usage"]["output_tokens_details"]["reasoning_tokens"]}
    # The completed response's items hold what the deltas said.
    assert {k: v for k, v in read(done["output"]).items()} == {k: streamed[k] for k in read(done["output"])}
    return streamed


APIS = {"openai": openai_chat, "ollama_chat": ollama_chat, "ollama_generate": ollama_generate,
        "anthropic": anthropic, "responses": responses}


def both(read, send, **body) -> dict:
    """The whole answer read, after checking the streamed one reads the same."""
    whole, streamed = read(send, dict(body), False), read(send, dict(body), True)
    assert streamed == whole
    return whole


def via_gateway(app, klass: str | None = None):
    return lambda path, body: post(app, path, body, klass)


@pytest.mark.parametrize("api", APIS)
def test_each_api_splits_the_thought_whole_and_streamed_alike(gateway, api):
    answer = both(APIS[api], via_gateway(gateway), say="Hi?")
    assert (answer["reasoning"], answer["content"]) == (THOUGHT, ANSWER)
    if api == "anthropic":
        assert answer["blocks"] == ["thinking", "text"]
    if api == "responses":
        assert answer["blocks"] == ["reasoning", "message"] and answer["reasoning_tokens"] == THOUGHT_TOKENS


@pytest.mark.parametrize("api", ["openai", "ollama_chat", "anthropic", "responses"])
def test_a_thought_before_a_tool_call_stays_out_of_the_call(gateway, api):
    tools = [{"type": "function", "function": WEATHER}]
    if api == "anthropic":
        tools = [{"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}]
    if api == "responses":
        tools = [{"type": "function", **WEATHER}]
    answer = both(APIS[api], via_gateway(gateway), say="Weather?", tools=tools)
    assert (answer["reasoning"], answer["content"].strip(), answer["calls"]) == ("Call it.", "", ["get_weather"])
    if api in ("anthropic", "responses"):
        assert answer["blocks"] == (["thinking", "tool_use"] if api == "anthropic" else ["reasoning", "function_call"])


@pytest.mark.parametrize(("api", "off"), [
    ("ollama_chat", {"think": False}),
    ("ollama_generate", {"think": False}),
    ("anthropic", {"thinking": {"type": "disabled"}}),
    ("responses", {"reasoning": {"effort": "none"}}),
])
def test_each_apis_off_switch_renders_the_templates_thinking_off(gateway, api, off):
    answer = both(APIS[api], via_gateway(gateway), say="Hi?", **off)
    assert (answer["reasoning"], answer["content"]) == ("", ANSWER)
    if api.startswith("ollama"):
        assert answer["eval_count"] == ANSWER_TOKENS  # the model never thought: the template's switch was off
    if api == "responses":
        assert answer["reasoning_tokens"] == 0 and answer["blocks"] == ["message"]


@pytest.mark.parametrize(("api", "on"), [
    ("ollama_chat", {"think": True}),
    ("ollama_chat", {"think": "high"}),
    ("ollama_generate", {"think": True}),
    ("anthropic", {"thinking": {"type": "enabled", "budget_tokens": 1024}}),
    ("anthropic", {"thinking": {"type": "adaptive"}}),
    ("responses", {"reasoning": {"effort": "high", "summary": "auto"}}),
])
def test_each_apis_on_switch_is_honoured_where_ollama_refused_it(gateway, api, on):
    answer = both(APIS[api], via_gateway(gateway), say="Hi?", **on)
    assert (answer["reasoning"], answer["content"]) == (THOUGHT, ANSWER)


def test_anthropics_budget_ends_the_thought_when_spent(gateway):
    answer = both(anthropic, via_gateway(gateway), say="Long?", thinking={"type": "enabled", "budget_tokens": 3})
    # <think>, "\n", "a", "b" are the budget; </think> is forced and the answer follows.
    assert (answer["reasoning"], answer["content"]) == ("ab", ANSWER)


@pytest.mark.parametrize("api", APIS)
def test_voice_does_not_think_unless_the_request_says_so(gateway, api):
    voice = via_gateway(gateway, "voice")
    assert services(gateway).classes.get("voice").thinking == "off"
    answer = both(APIS[api], voice, say="Hi?")
    assert (answer["reasoning"], answer["content"]) == ("", ANSWER)
    on = {"openai": {"chat_template_kwargs": {"enable_thinking": True}}, "ollama_chat": {"think": True},
          "ollama_generate": {"think": True}, "anthropic": {"thinking": {"type": "enabled", "budget_tokens": 512}},
          "responses": {"reasoning": {"effort": "medium"}}}[api]
    assert both(APIS[api], voice, say="Hi?", **on)["reasoning"] == THOUGHT  # the request's own field wins


def test_a_class_set_to_on_or_off_applies_to_openai_requests_that_name_no_thinking(gateway):
    svc = services(gateway)
    from app.store.models import RequestClass

    with svc.sessions() as s:
        s.get(RequestClass, "chat").thinking = "off"
        s.commit()
    svc.classes.invalidate()
    chat = via_gateway(gateway, "chat")
    assert both(openai_chat, chat, say="Hi?")["reasoning"] == ""
    assert both(openai_chat, chat, say="Hi?", reasoning_effort="high")["reasoning"] == THOUGHT


def test_a_bad_think_value_is_refused_in_ollamas_shape(gateway):
    r = gateway.test_client().post("/api/chat", headers=gateway.auth, json={
        "model": gateway.model_name, "messages": [{"role": "user", "content": "Hi?"}], "think": "very"})
    assert r.status_code == 400
    assert r.get_json() == {"error": "'think' must be true, false, \"low\", \"medium\" or \"high\" (got 'very')"}


@pytest.mark.parametrize("api", ["anthropic", "responses"])
def test_the_runners_own_messages_and_responses_routes_split_the_thought_too(runner_url, api):
    def send(path: str, body: dict):
        r = httpx.post(runner_url + path, json=body, timeout=30)
        assert r.status_code == 200, r.text
        return _Answer(r.content)

    answer = both(APIS[api], send, say="Hi?")
    assert (answer["reasoning"], answer["content"]) == (THOUGHT, ANSWER)
    assert answer["blocks"] == (["thinking", "text"] if api == "anthropic" else ["reasoning", "message"])
    off = {"thinking": {"type": "disabled"}} if api == "anthropic" else {"reasoning": {"effort": "none"}}
    assert both(APIS[api], send, say="Hi?", **off)["reasoning"] == ""


class _Answer:
    """An httpx answer read as the readers above read Flask's test responses."""

    def __init__(self, content: bytes):
        self.content = content

    def get_data(self, as_text: bool = False):
        return self.content.decode() if as_text else self.content

    def get_json(self):
        return json.loads(self.content)


def test_earlier_thoughts_of_each_api_reach_the_template_as_reasoning_content(runner_url):
    from app.protocols import anthropic as anthropic_api
    from app.protocols import ollama as ollama_api
    from app.protocols import responses as responses_api

    bye = {"role": "user", "content": "Bye"}
    histories = [
        ollama_api.ChatAdapter({"model": "m", "messages": [
            {"role": "user", "content": "Hi?"}, {"role": "assistant", "content": ANSWER, "thinking": THOUGHT}, bye]}),
        anthropic_api.MessagesAdapter({"model": "m", "max_tokens": 8, "messages": [
            {"role": "user", "content": "Hi?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": THOUGHT, "signature": ""},
                                              {"type": "text", "text": ANSWER}]}, bye]}),
        responses_api.ResponsesAdapter({"model": "m", "input": [
            {"role": "user", "content": "Hi?"},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": THOUGHT}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": ANSWER}]}, bye]}),
    ]
    for adapter in histories:
        r = httpx.post(runner_url + "/apply-template", json={"messages": adapter.to_openai()["messages"]}, timeout=30)
        assert f"<|im_start|>assistant\n<think>\n{THOUGHT}\n</think>\n\n{ANSWER}<|im_end|>" in r.json()["prompt"]


# -- the vendors' own clients, unchanged, against the gateway on loopback ------------------------------


@pytest.fixture
def gateway_url(gateway):
    """The in-process gateway served over loopback HTTP, for clients that only speak HTTP."""
    server = make_server("127.0.0.1", 0, gateway, threaded=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_ollamas_client_reads_thinking_whole_and_streamed(gateway, gateway_url):
    import ollama as ollama_client

    client = ollama_client.Client(host=gateway_url, headers=gateway.auth)
    said = [{"role": "user", "content": "Hi?"}]
    whole = client.chat(model=gateway.model_name, messages=said, think=True)
    assert (whole.message.thinking, whole.message.content) == (THOUGHT, ANSWER)
    parts = list(client.chat(model=gateway.model_name, messages=said, think=True, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == THOUGHT
    assert "".join(p.message.content for p in parts) == ANSWER
    off = client.chat(model=gateway.model_name, messages=said, think=False)
    assert (off.message.thinking, off.message.content, off.eval_count) == (None, ANSWER, ANSWER_TOKENS)


def test_anthropics_client_reads_thinking_blocks_whole_and_streamed(gateway, gateway_url):
    import anthropic as anthropic_sdk

    token = gateway.auth["Authorization"].removeprefix("Bearer ")
    with anthropic_sdk.Anthropic(base_url=gateway_url, auth_token=token, api_key=None, max_retries=0) as claude:
        ask = {"model": gateway.model_name, "max_tokens": 64, "messages": [{"role": "user", "content": "Hi?"}],
               "thinking": {"type": "enabled", "budget_tokens": 1024}}
        msg = claude.messages.create(**ask)
        assert [b.type for b in msg.content] == ["thinking", "text"]
        assert (msg.content[0].thinking, msg.content[0].signature, msg.content[1].text) == (THOUGHT, "", ANSWER)
        with claude.messages.stream(**ask) as stream:
            final = stream.get_final_message()
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
            ("thinking", THOUGHT), ("text", ANSWER)]


def test_openais_client_reads_reasoning_items_whole_and_streamed(gateway, gateway_url):
    import openai

    token = gateway.auth["Authorization"].removeprefix("Bearer ")
    with openai.OpenAI(base_url=gateway_url + "/v1", api_key=token, max_retries=0) as client:
        ask = {"model": gateway.model_name, "input": "Hi?", "reasoning": {"effort": "high"}}
        res = client.responses.create(**ask)
        assert [i.type for i in res.output] == ["reasoning", "message"]
        assert res.output[0].content[0].text == THOUGHT and res.output_text == ANSWER
        assert res.usage.output_tokens_details.reasoning_tokens == THOUGHT_TOKENS
        with client.responses.stream(**ask) as stream:
            thought = "".join(e.delta for e in stream if e.type == "response.reasoning_text.delta")
            final = stream.get_final_response()
        assert thought == THOUGHT and final.output_text == ANSWER
        assert final.output[0].content[0].text == THOUGHT
