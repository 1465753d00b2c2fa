"""Each family through the runner with llama.cpp's own template (vendored models/templates) on the fake text model:
the format detected from the template, its markers streamed as special tokens, the prompt's open thought seen,
reasoning, content and calls split right, and the streamed deltas adding up to the whole answer."""

from __future__ import annotations

import json

import pytest

from app.engine.formats import detect
from tests.engine.formats.conftest import TEMPLATES
from tests.runner.streams import loads, payloads
from tests.runner.test_tool_formats import TIME, WEATHER, streamed_calls, text_of

PARIS = [("get_weather", {"city": "Paris"})]
R1_CALL = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
           '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
XML_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"

# (template, the model's raw answer, expected reasoning, content, calls)
CASES = [
    ("Qwen-Qwen3-0.6B", '<think>\nLooking.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
                        '{"city": "Paris"}}\n</tool_call>', "Looking.", "", PARIS),
    ("Qwen-Qwen3-0.6B", "<think>\nHm.\n</think>\n\nHello there", "Hm.", "Hello there", []),
    ("Qwen3-Coder", XML_CALL, "", "", PARIS),
    ("openai-gpt-oss-120b", "<|channel|>analysis<|message|>Looking.<|end|><|start|>assistant<|channel|>commentary "
                            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
     "Looking.", "", PARIS),
    ("openai-gpt-oss-120b", "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final"
                            "<|message|>Hello there", "Hm.", "Hello there", []),
    ("meta-llama-Llama-3.1-8B-Instruct", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", "", PARIS),
    ("Mistral-Small-3.2-24B-Instruct-2506", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", "", PARIS),
    ("mistralai-Ministral-3-14B-Reasoning-2512", "[THINK]Hm.[/THINK]Hello there", "Hm.", "Hello there", []),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "Looking.\n</think>\n\n" + R1_CALL, "Looking.", "", PARIS),
    ("deepseek-ai-DeepSeek-V3.1", 'Looking.</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather'
                                  '<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "Looking.", "", PARIS),
    ("ibm-granite-granite-3.3-2B-Instruct", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     "", "", PARIS),
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use",
     '<|START_THINKING|>Looking.<|END_THINKING|><|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": '
     '"get_weather", "parameters": {"city": "Paris"}}\n]<|END_ACTION|>', "Looking.", "", PARIS),
    ("meetkai-functionary-medium-v3.1", '<function=get_weather>{"city": "Paris"}</function>', "", "", PARIS),
    ("google-gemma-2-2b-it", '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}',
     "", "", PARIS),
]


def specials_of(template: str) -> dict[int, bytes]:
    """The family's special tokens as fake token ids: what the parser needs to see, and the thought's markers."""
    fmt = detect(template)
    texts = set(fmt.preserved)
    for marker in (fmt.think_start, fmt.think_end):
        # A marker made of several special tokens (harmony's "<|channel|>analysis<|message|>") is those tokens.
        if marker and not any(t != marker and t in marker for t in fmt.preserved):
            texts.add(marker)
    return {400 + i: t.encode() for i, t in enumerate(sorted(texts))}


@pytest.fixture(scope="module")
def vendored() -> dict[str, str]:
    if not TEMPLATES.is_dir():
        pytest.skip(f"the vendored llama.cpp templates are not unpacked at {TEMPLATES} (scripts/build_llama_tools.sh)")
    return {p.stem: p.read_text() for p in TEMPLATES.glob("*.jinja")}


@pytest.mark.parametrize("name, raw, reasoning, content, calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_family_splits_whole_and_streamed_alike(make_runner, vendored, name, raw, reasoning, content, calls):
    template = vendored[name]
    c = make_runner(replies={"Weather in Paris?": raw}, template=template, specials=specials_of(template),
                    n_ctx=8192)
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER, TIME],
            "temperature": 0, "max_tokens": 400}
    whole = loads(c.post("/v1/chat/completions", json=body))["choices"][0]
    message = whole["message"]
    got_calls = [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in message.get("tool_calls", [])]
    assert (message.get("reasoning_content", ""), message["content"] or "", got_calls) == (reasoning, content, calls)
    assert whole["finish_reason"] == ("tool_calls" if calls else "stop")
    events = payloads(c.post("/v1/chat/completions", json={**body, "stream": True}))[:-1]
    assert [c["function"] for c in streamed_calls(events)] == [t["function"] for t in message.get("tool_calls", [])]
    assert text_of(events, "reasoning_content") == reasoning
    assert text_of(events, "content") == content


@pytest.mark.parametrize("name, raw", [
    ("openai-gpt-oss-120b", "<|channel|>analysis<|message|>Long thoughts.<|end|><|start|>assistant<|channel|>final"
                            "<|message|>Hello there"),
    ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "Long thoughts.\n</think>\n\nHello there"),  # no switch
    ("mistralai-Ministral-3-14B-Reasoning-2512", "[THINK]Long thoughts.[/THINK]Hello there"),
    ("Qwen-Qwen3-0.6B", "<think>\nLong thoughts.\n</think>\n\nHello there"),
])
def test_thinking_off_ends_each_familys_thought_and_nothing_of_it_is_content(make_runner, vendored, name, raw):
    template = vendored[name]
    c = make_runner(replies={"Hi?": raw}, template=template, specials=specials_of(template), n_ctx=8192)
    body = {"messages": [{"role": "user", "content": "Hi?"}], "temperature": 0, "reasoning_effort": "none"}
    whole = loads(c.post("/v1/chat/completions", json=body))
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "Hello there"}
    events = payloads(c.post("/v1/chat/completions", json={**body, "stream": True}))[:-1]
    assert text_of(events, "content") == "Hello there" and text_of(events, "reasoning_content") == ""
