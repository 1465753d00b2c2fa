"""A cut inside the second of two calls, through a real runner on each family double with an array or several calls
(issue 53): the first call goes out as a delta before the stream ends, comes back whole in the whole answer with
finish_reason "length", and the cut call is neither a call nor content.

The doubles (app/devtools/family_models.py) carry each family's real vocabulary and template; the request's
grammar spells the family's two_calls script token for token, and max_tokens cuts it just before "Tokyo", the
second call's argument. The first answer (logprobs on) tells how many tokens come before it.
"""

from __future__ import annotations

import json

import pytest

from app.devtools import family_models
from app.devtools.family_models import TOOLS, family_model, load_scripts
from app.engine.model_config import ModelConfig
from app.runner.config import RunnerConfig
from tests.runner.loaded import loaded_runner
from tests.runner.streams import loads, payloads

MULTI_CALL = ["gemma3", "qwen3", "qwen3_coder", "mistral", "magistral", "deepseek_r1", "deepseek_v3", "granite",
              "command_r", "functionary_v3_2"]
PARIS = {"name": "get_weather", "arguments": {"city": "Paris"}}


@pytest.fixture(scope="module")
def vendored():
    try:
        return family_models.vendored_models_dir()
    except RuntimeError as exc:
        pytest.skip(str(exc))


def _tokens_before(client, body: dict, word: str) -> int:
    """How many generated tokens come before the one that starts writing `word`."""
    whole = loads(client.post("/v1/chat/completions", json={**body, "logprobs": True}))
    text = ""
    for i, entry in enumerate(whole["choices"][0]["logprobs"]["content"]):
        text += entry["token"]
        if word[:2] in text[text.find("get_time"):] and "get_time" in text:
            return i
    raise AssertionError(f"{word!r} never came: {text!r}")


@pytest.mark.parametrize("family", MULTI_CALL)
def test_a_cut_in_the_second_call_keeps_the_first_streamed_and_whole(vendored, family):
    double = family_model(family)
    raw = next(s.raw for s in load_scripts(family) if s.name == "two_calls")
    cfg = RunnerConfig(ModelConfig(path=str(double.path), n_ctx=2048, n_seq_max=1, n_threads=1))
    with loaded_runner(cfg) as client:
        body = {"messages": [{"role": "user", "content": "Weather in Paris and time in Tokyo?"}], "tools": TOOLS,
                "temperature": 0, "max_tokens": 256, "grammar": double.gbnf(raw)}
        body["max_tokens"] = _tokens_before(client, body, "Tokyo")
        choice = loads(client.post("/v1/chat/completions", json=body))["choices"][0]
        message = choice["message"]
        assert choice["finish_reason"] == "length"
        assert [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                for c in message["tool_calls"]] == [PARIS]
        assert not message["content"], "the cut call came back as content"
        events = payloads(client.post("/v1/chat/completions",
                                      json={**body, "stream": True, "timings_per_token": True}))[:-1]
    calls: dict[int, dict] = {}
    first_whole_after = None  # tokens generated when the first call's arguments went out
    generated = 0
    for ev in events:
        generated = (ev.get("timings") or {}).get("predicted_n", generated)
        for d in (ev["choices"][0]["delta"].get("tool_calls") or []) if ev["choices"] else []:
            call = calls.setdefault(d["index"], {"name": "", "arguments": ""})
            call["name"] += d["function"].get("name") or ""
            call["arguments"] += d["function"].get("arguments") or ""
            if d["index"] == 0 and call["arguments"] and first_whole_after is None:
                first_whole_after = generated
    finishing = next(i for i, ev in enumerate(events) if ev["choices"] and ev["choices"][0]["finish_reason"])
    # The first call went out while the model was still writing the second, not with the end of the answer.
    assert first_whole_after is not None and 0 < first_whole_after < body["max_tokens"] - 2
    assert [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in calls.values()] == [PARIS]
    assert events[finishing]["choices"][0]["finish_reason"] == "length"
    assert "".join(ev["choices"][0]["delta"].get("content") or "" for ev in events if ev["choices"]) == ""
