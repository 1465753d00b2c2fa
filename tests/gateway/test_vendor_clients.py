"""Anthropic's and OpenAI's Responses clients, unchanged, against `hearth serve` (relayed to a real runner)."""

import anthropic
import openai
import pytest

DEFAULT = "gemma-3-270m-q4_k_m"


@pytest.fixture()
def claude(serve):
    # auth_token: the gateway's bearer token (Anthropic's ANTHROPIC_AUTH_TOKEN).
    c = anthropic.Anthropic(base_url=serve.url, auth_token=serve.tokens["alice"], api_key=None, max_retries=0)
    yield c
    c.close()


def test_messages_through_the_gateway(claude):
    msg = claude.messages.create(model=DEFAULT, max_tokens=5, messages=[{"role": "user", "content": "Hi"}],
                                 extra_body={"temperature": 0})
    assert msg.type == "message" and msg.content[0].type == "text"
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 5
    with claude.messages.stream(model=DEFAULT, max_tokens=6, messages=[{"role": "user", "content": "Hi"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == final.content[0].text and final.usage.output_tokens == 6


def test_messages_errors_take_anthropics_shape(serve, claude):
    with pytest.raises(anthropic.NotFoundError) as exc:
        claude.messages.create(model="claude-sonnet-4", max_tokens=5, messages=[{"role": "user", "content": "Hi"}])
    assert exc.value.body["type"] == "error" and exc.value.body["error"]["type"] == "not_found_error"
    with anthropic.Anthropic(base_url=serve.url, auth_token="wrong", api_key=None, max_retries=0) as bad, \
            pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=DEFAULT, max_tokens=5, messages=[{"role": "user", "content": "Hi"}])


def test_responses_through_the_gateway(serve):
    with openai.OpenAI(base_url=serve.url + "/v1", api_key=serve.tokens["alice"], max_retries=0) as client:
        res = client.responses.create(model=DEFAULT, input="Hi", max_output_tokens=5, temperature=0)
        assert res.id.startswith("resp_") and res.output_text and res.usage.output_tokens == 5
        done = [e for e in client.responses.create(model=DEFAULT, input="Hi", max_output_tokens=5, temperature=0,
                                                   stream=True) if e.type == "response.completed"]
        assert done and done[0].response.output_text == res.output_text
