"""The official `openai` Python client, unchanged, against `hearth serve`."""

import openai
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
