"""The chat prompt (contract C3) and /apply-template: thinking, reasoning_effort and the rendered text (fake model)."""

from __future__ import annotations

import pytest

from app.protocols.openai import ChatBody
from app.runner.prompts import chat_prompt
from tests.runner.streams import loads

SAY_HI = [{"role": "user", "content": "Say hi"}]
# A template that prints what it was given: the effort, and thinking on or off where llama.cpp looks for it (an
# opened thought ending the generation prompt).
SHOWING_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                    "{% if reasoning_effort is defined %}effort={{ reasoning_effort }}\n{% endif %}"
                    "{% if add_generation_prompt %}<assistant>{% if enable_thinking %}<think>{% endif %}{% endif %}")
# Apertus writes its switch into the system turn: llama.cpp finds no reasoning there and renders it off by default.
SWITCH_IN_SYSTEM = ("<system>Deliberation: {{ 'enabled' if enable_thinking else 'disabled' }}\n"
                    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>")


def prompt_text(client, thinking=None, **body) -> str:
    state = client.application.state
    return chat_prompt(state, ChatBody.model_validate({"messages": SAY_HI, **body}), thinking=thinking).text


@pytest.mark.parametrize(("reasoning", "body", "thinks"), [
    ("auto", {}, True),
    ("on", {}, True),
    ("off", {}, False),
    ("on", {"reasoning_effort": "none"}, False),
    ("off", {"chat_template_kwargs": {"enable_thinking": True}}, True),
    ("on", {"chat_template_kwargs": {"enable_thinking": False}}, False),
])
def test_thinking_follows_the_request_then_the_runners_reasoning(make_runner, reasoning, body, thinks):
    c = make_runner(template=SHOWING_TEMPLATE, reasoning=reasoning)
    assert ("<think>" in prompt_text(c, **body)) is thinks


def test_the_callers_thinking_wins_over_the_request(make_runner):
    c = make_runner(template=SHOWING_TEMPLATE, reasoning="on")
    assert "<think>" not in prompt_text(c, thinking=False)
    assert "<think>" in prompt_text(c, thinking=True, chat_template_kwargs={"enable_thinking": False})


def test_thinking_is_on_by_default_only_where_llama_cpp_finds_reasoning(make_runner):
    c = make_runner(template=SWITCH_IN_SYSTEM, reasoning="on")
    assert "Deliberation: disabled" in prompt_text(c)
    assert "Deliberation: enabled" in prompt_text(c, chat_template_kwargs={"enable_thinking": True})


def test_an_effort_reaches_the_template_and_none_does_not(make_runner):
    c = make_runner(template=SHOWING_TEMPLATE)
    assert "effort=high\n" in prompt_text(c, reasoning_effort="high")
    assert "effort=" not in prompt_text(c, reasoning_effort="none")
    assert "effort=" not in prompt_text(c)


def test_the_text_is_what_the_tokens_are(make_runner):
    c = make_runner(template=SHOWING_TEMPLATE)
    state = c.application.state
    prompt = chat_prompt(state, ChatBody.model_validate({"messages": SAY_HI}))
    assert prompt.text == "<user>Say hi\n<assistant><think>"
    assert prompt.tokens == state.model.tokenize(prompt.text, add_special=True, parse_special=True)


def test_apply_template_renders_with_the_same_thinking(make_runner):
    c = make_runner(template=SHOWING_TEMPLATE, reasoning="on")
    off = loads(c.post("/apply-template", json={"messages": SAY_HI,
                                                "chat_template_kwargs": {"enable_thinking": False}}))["prompt"]
    assert off == "<user>Say hi\n<assistant>"
