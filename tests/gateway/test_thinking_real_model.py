"""Thinking controls on the real Gemma 3 270M through `hearth serve` (a template without reasoning): the
voice class's default off and every API's switch reach the real runner, which answers as it always did."""

from __future__ import annotations

import json

DEFAULT = "gemma-3-270m-q4_k_m"
SAY = [{"role": "user", "content": "Say hello."}]


def _post(serve, member: str, path: str, body: dict):
    r = serve.client.post(path, json={"model": DEFAULT, "temperature": 0, **body},
                          headers={"Authorization": f"Bearer {serve.tokens[member]}"})
    assert r.status_code == 200, r.text
    return r


def test_voice_answers_with_thinking_off_and_without_reasoning_fields(serve):
    answer = _post(serve, "kid", "/v1/chat/completions", {"messages": SAY, "max_tokens": 6}).json()
    assert answer["hearth_class"] == "voice"
    message = answer["choices"][0]["message"]
    assert message["content"] and "reasoning_content" not in message
    assert answer["usage"]["completion_tokens"] == 6


def test_each_apis_thinking_switch_is_accepted_by_a_model_that_does_not_think(serve):
    for think in (True, False, "high"):
        line = _post(serve, "alice", "/api/chat", {"messages": SAY, "think": think, "stream": False,
                                                   "options": {"num_predict": 4}}).json()
        assert line["done"] and line["message"]["content"] and "thinking" not in line["message"]
    streamed = _post(serve, "alice", "/api/generate", {"prompt": "Say hello.", "think": True,
                                                       "options": {"num_predict": 4}})
    lines = [json.loads(x) for x in streamed.text.splitlines() if x]
    assert lines[-1]["done"] and not any("thinking" in x for x in lines)
    msg = _post(serve, "alice", "/v1/messages", {"max_tokens": 4, "messages": SAY,
                                                 "thinking": {"type": "enabled", "budget_tokens": 1024}}).json()
    assert [b["type"] for b in msg["content"]] == ["text"]
    resp = _post(serve, "alice", "/v1/responses", {"input": "Say hello.", "max_output_tokens": 4,
                                                   "reasoning": {"effort": "low"}}).json()
    assert [i["type"] for i in resp["output"]] == ["message"]
    assert resp["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
