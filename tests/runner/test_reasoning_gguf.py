"""The reasoning budget end to end on the embedded GGUF: a DeepSeek-R1 template opens the thought in the prompt,
a grammar would let it run on, the budget ends it through that grammar, and the answer comes split."""

from __future__ import annotations

import pytest

from app.engine.model_config import ModelConfig
from app.runner.config import RunnerConfig
from tests.engine.formats.conftest import TEMPLATES
from tests.runner.loaded import loaded_runner
from tests.runner.streams import loads, payloads

R1 = TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja"
# The thought may run 300 characters; only the budget makes it end after a few tokens.
GRAMMAR = 'root ::= [a-z ]{1,300} "</think>" [A-Za-z] [A-Za-z ]{0,40}'


@pytest.fixture(scope="module")
def runner(gemma_path):
    if not R1.is_file():
        pytest.skip(f"the vendored llama.cpp templates are not unpacked at {TEMPLATES}")
    cfg = RunnerConfig(ModelConfig(path=str(gemma_path), n_ctx=1024, n_seq_max=2, n_threads=2),
                       chat_template=R1.read_text())
    with loaded_runner(cfg) as client:
        yield client


def test_the_budget_ends_a_prompt_opened_thought_through_the_grammar(runner):
    body = {"messages": [{"role": "user", "content": "Tell me about the sea."}], "temperature": 0,
            "max_tokens": 80, "grammar": GRAMMAR, "reasoning_budget_tokens": 4}
    whole = loads(runner.post("/v1/chat/completions", json=body))
    message = whole["choices"][0]["message"]
    end_tokens = len(runner.application.state.think_tokens[1])
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4 + end_tokens}
    assert message["reasoning_content"] and message["content"]
    assert "</think>" not in message["content"] + message["reasoning_content"]
    events = payloads(runner.post("/v1/chat/completions", json={**body, "stream": True}))[:-1]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]


def test_reasoning_format_none_keeps_the_prompt_opened_marker_and_the_thought_in_content(runner):
    body = {"messages": [{"role": "user", "content": "Tell me about the sea."}], "temperature": 0,
            "max_tokens": 80, "grammar": GRAMMAR, "reasoning_budget_tokens": 4, "reasoning_format": "none"}
    message = loads(runner.post("/v1/chat/completions", json=body))["choices"][0]["message"]
    assert "reasoning_content" not in message
    assert message["content"].startswith("<think>\n") and "</think>" in message["content"]
