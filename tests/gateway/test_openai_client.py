"""The official `openai` Python client, unchanged, against `hearth serve`."""

import json

import openai
import pydantic
import pytest

DEFAULT = "gemma-3-270m-q4_k_m"


@pytest.fixture()
def client(serve):
    c = openai.OpenAI(base_url=serve.url + "/v1", api_key=serve.tokens["alice"], max_retries=0)
    yield c
    c.close()


def test_chat(client):
    r = client.chat.completions.create(model=DEFAULT, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=5, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 5
    assert r.choices[0].finish_reason == "length"


def test_chat_stream(client):
    stream = client.chat.completions.create(model=DEFAULT, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage.completion_tokens == 6


def test_completions_and_models(client):
    r = client.completions.create(model=DEFAULT, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens == 4
    ids = [m.id for m in client.models.list()]
    assert DEFAULT in ids


def test_errors_map_to_the_clients_exceptions(serve, client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=DEFAULT, messages=[{"role": "user", "content": "Hi"}], temperature=7)
    assert e.value.body["param"] == "temperature"
    bad = openai.OpenAI(base_url=serve.url + "/v1", api_key="hth_wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=DEFAULT, messages=[{"role": "user", "content": "Hi"}])
    bad.close()
    kid = openai.OpenAI(base_url=serve.url + "/v1", api_key=serve.tokens["kid"], max_retries=0)
    with pytest.raises(openai.PermissionDeniedError):
        kid.chat.completions.create(model=DEFAULT, messages=[{"role": "user", "content": "Hi"}],
                                    extra_headers={"X-Hearth-Class": "coding"})
    kid.close()


LIGHT = {"type": "function", "function": {
    "name": "set_light", "description": "Switch a light on or off",
    "parameters": {"type": "object", "properties": {"room": {"type": "string", "enum": ["kitchen", "bedroom"]},
                                                    "on": {"type": "boolean"}},
                   "required": ["room", "on"], "additionalProperties": False}}}


def test_tool_call_then_the_follow_up_turn_with_its_result(client):
    messages = [{"role": "user", "content": "Turn on the kitchen light"}]
    # One call: with parallel calls allowed the grammar admits up to three, and whether the small model writes a
    # second one depends on what the shared runner's prefix cache and batch hold (it did, under load, and hit max_tokens).
    r = client.chat.completions.create(model=DEFAULT, messages=messages, tools=[LIGHT], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "set_light"
    args = json.loads(call.function.arguments)
    assert args["room"] in ("kitchen", "bedroom") and isinstance(args["on"], bool)
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"ok": true}'}]
    follow = client.chat.completions.create(model=DEFAULT, messages=messages, tools=[LIGHT], max_tokens=20,
                                            temperature=0)
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert follow.usage.prompt_tokens > r.usage.prompt_tokens


def test_streamed_tool_call_is_assembled_by_the_client(client):
    stream = client.chat.completions.create(model=DEFAULT, messages=[{"role": "user", "content": "Bedroom light off"}],
                                            tools=[LIGHT], tool_choice="required", max_tokens=60, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    parts = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert parts[0].id and parts[0].function.name == "set_light"
    args = json.loads("".join(p.function.arguments or "" for p in parts))
    assert set(args) == {"room", "on"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens > 0


class Reading(pydantic.BaseModel):
    room: str
    temperature_c: int
    window_open: bool


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(model=DEFAULT, messages=[
        {"role": "user", "content": "The bedroom is at 19 degrees and the window is open."}],
        response_format=Reading, max_tokens=80, temperature=0)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Reading)


def test_tools_and_structured_requests_are_marked_and_counted(serve, client):
    client.chat.completions.create(model=DEFAULT, messages=[{"role": "user", "content": "Hi"}], tools=[LIGHT],
                                   tool_choice="none", max_tokens=2, temperature=0)
    text = serve.client.get("/metrics").text
    assert 'hearth:gateway_feature_requests_total{class="chat",feature="tools"}' in text
