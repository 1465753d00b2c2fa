"""Reasoning through the runner (contract C2) on the fake text model with thinking templates: split whole and
streamed, thinking off by the template's switch or by a forced end, budgets, reasoning_format none."""

from __future__ import annotations

import pytest

from app.protocols.openai import ChatBody
from app.runner.job import EFFORT_BUDGETS, thinking_budget
from tests.runner.streams import loads, payloads

THINK, END_THINK, CALL, END_CALL = 400, 401, 402, 403
SPECIALS = {THINK: b"<think>", END_THINK: b"</think>", CALL: b"<tool_call>", END_CALL: b"</tool_call>"}

# Qwen3's shape: Hermes calls, <think>, and an enable_thinking switch that renders an empty thought.
QWEN3_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n"
    "{% endfor %}"
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
# DeepSeek-R1's shape: no switch, every answer opens with "<think>\n" in the prompt.
R1_LIKE = (
    "{% set strip = '</think>' %}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}"
)

THOUGHTFUL = "<think>\nLet me see.\n</think>\n\nHello there"
LONG_THOUGHT = "<think>\nabcdefghijklmnop\n</think>\n\nHello there"
REPLIES = {
    "<think>\n\n</think>": "Hello there",  # thinking rendered off: the model answers at once
    "Long?": LONG_THOUGHT,
    "Hi?": THOUGHTFUL,
    "Pondering?": "Pondering.\n</think>\n\nHello there",  # R1: the thought was opened by the prompt
}
ASK = {"messages": [{"role": "user", "content": "Hi?"}], "temperature": 0}


@pytest.fixture
def qwen3(make_runner):
    return lambda **config: make_runner(replies=REPLIES, template=QWEN3_LIKE, specials=SPECIALS, **config)


@pytest.fixture
def r1(make_runner):
    return lambda **config: make_runner(replies=REPLIES, template=R1_LIKE, specials=SPECIALS, **config)


def ask(c, content="Hi?", **body):
    """The whole answer's message and finish reason and usage, and the streamed deltas' fields concatenated."""
    req = {**ASK, "messages": [{"role": "user", "content": content}], **body}
    whole = loads(c.post("/v1/chat/completions", json=req))
    events = payloads(c.post("/v1/chat/completions", json={**req, "stream": True}))
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    streamed = {key: "".join(d.get(key) or "" for d in deltas) for key in ("reasoning_content", "content")}
    return whole["choices"][0], whole["usage"], streamed, events


def same_fields(message: dict, streamed: dict) -> None:
    """The streamed deltas add up to exactly the whole answer's fields."""
    assert streamed["reasoning_content"] == message.get("reasoning_content", "")
    assert streamed["content"] == (message["content"] or "")


def test_a_thought_is_split_into_reasoning_content_whole_and_streamed(qwen3):
    choice, usage, streamed, _ = ask(qwen3())
    message = choice["message"]
    assert message["reasoning_content"] == "Let me see." and message["content"] == "Hello there"
    same_fields(message, streamed)
    # <think>, the 13 bytes of "\nLet me see.\n", </think>
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 15}


def test_reasoning_format_none_leaves_the_thought_in_content_verbatim(qwen3):
    for c, body in ((qwen3(), {"reasoning_format": "none"}), (qwen3(reasoning_format="none"), {})):
        choice, _, streamed, _ = ask(c, **body)
        assert choice["message"]["content"] == THOUGHTFUL and "reasoning_content" not in choice["message"]
        same_fields(choice["message"], streamed)


@pytest.mark.parametrize("body", [
    {"chat_template_kwargs": {"enable_thinking": False}},
    {"reasoning_effort": "none"},
    {"reasoning_budget_tokens": 0},
    {"thinking_budget_tokens": 0},
])
def test_thinking_off_renders_the_templates_switch_off(qwen3, body):
    choice, usage, streamed, _ = ask(qwen3(), **body)
    assert choice["message"] == {"role": "assistant", "content": "Hello there"}
    same_fields(choice["message"], streamed)
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_the_runners_reasoning_off_and_budget_zero_turn_thinking_off_too(qwen3):
    for c in (qwen3(reasoning="off"), qwen3(reasoning_budget=0)):
        choice, _, _, _ = ask(c)
        assert choice["message"] == {"role": "assistant", "content": "Hello there"}


def test_a_request_can_turn_thinking_back_on_over_the_runners_default(qwen3):
    choice, _, _, _ = ask(qwen3(reasoning="off"), chat_template_kwargs={"enable_thinking": True})
    assert choice["message"]["reasoning_content"] == "Let me see."


def test_a_spent_budget_ends_the_thought_and_the_answer_follows(qwen3):
    choice, usage, streamed, _ = ask(qwen3(), content="Long?", reasoning_budget_tokens=3)
    # <think>, then "\n", "a", "b" are the budget; </think> is forced and the model goes on with its answer.
    assert choice["message"]["reasoning_content"] == "ab" and choice["message"]["content"] == "Hello there"
    same_fields(choice["message"], streamed)
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 5}


def test_the_runners_budget_applies_to_requests_that_name_none(qwen3):
    c = qwen3(reasoning_budget=3)
    assert ask(c, content="Long?")[0]["message"]["reasoning_content"] == "ab"
    assert ask(c, content="Long?", reasoning_budget_tokens=-1)[0]["message"]["reasoning_content"] == "ab"
    assert ask(c, content="Long?", reasoning_budget_tokens=6)[0]["message"]["reasoning_content"] == "abcde"


def test_the_budget_message_is_forced_before_the_end(qwen3):
    choice, _, _, _ = ask(qwen3(reasoning_budget=3, reasoning_budget_message=" Enough."), content="Long?")
    assert choice["message"]["reasoning_content"] == "ab Enough."
    assert choice["message"]["content"] == "Hello there"


def test_max_tokens_mid_thought_leaks_nothing_into_content(qwen3):
    choice, usage, streamed, _ = ask(qwen3(), content="Long?", max_tokens=8)
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] == "" and choice["message"]["reasoning_content"] == "abcdef"
    same_fields(choice["message"], streamed)
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 8}


def test_a_prompt_opened_thought_is_reasoning_and_thinking_off_forces_its_end(r1):
    c = r1()
    choice, _, streamed, _ = ask(c, content="Pondering?")
    assert choice["message"]["reasoning_content"] == "Pondering." and choice["message"]["content"] == "Hello there"
    same_fields(choice["message"], streamed)
    # No switch in the template: the end is forced at once and the thought never reaches the answer.
    choice, usage, streamed, _ = ask(c, content="Pondering?", reasoning_effort="none")
    assert choice["message"] == {"role": "assistant", "content": "Hello there"}
    same_fields(choice["message"], streamed)
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 1}  # the forced </think>


def test_thoughts_written_anyway_with_thinking_off_are_dropped_not_content(make_runner):
    # The template's switch is off, yet this model thinks: the budget ends it, nothing of it is content.
    c = make_runner(replies={"<think>\n\n</think>": THOUGHTFUL}, template=QWEN3_LIKE, specials=SPECIALS)
    choice, _, streamed, _ = ask(c, chat_template_kwargs={"enable_thinking": False})
    assert choice["message"] == {"role": "assistant", "content": "Hello there"}
    same_fields(choice["message"], streamed)


def test_logprobs_keep_one_entry_per_token_with_the_parser(qwen3):
    choice, usage, _, events = ask(qwen3(), logprobs=True, top_logprobs=1)
    assert len(choice["logprobs"]["content"]) == usage["completion_tokens"]
    streamed = [e for ev in events[:-1] if ev["choices"] for e in (ev["choices"][0]["logprobs"] or {}).get("content", [])]
    assert len(streamed) == usage["completion_tokens"]


def test_a_plain_template_keeps_the_plain_answer_and_no_reasoning_fields(make_runner):
    c = make_runner(replies={"Hi?": "Hello there"})
    choice, usage, streamed, _ = ask(c)
    assert choice["message"] == {"role": "assistant", "content": "Hello there"}
    assert "completion_tokens_details" not in usage and streamed["content"] == "Hello there"


def test_props_and_models_say_what_the_answers_can_hold(qwen3, make_runner):
    c = qwen3(reasoning_budget=64)
    props = loads(c.get("/props"))
    assert props["chat_format"]["name"] == "hermes" and props["chat_format"]["reasoning"] is True
    assert props["chat_format"]["think_start"] == "<think>" and props["chat_format"]["reasoning_budget"] == 64
    assert props["chat_template_caps"]["supports_tools"] is True
    assert props["chat_template_caps"]["supports_thinking"] is True
    (entry,) = loads(c.get("/v1/models"))["data"]
    assert entry["chat_format"]["tools"] is True and entry["chat_format"]["reasoning"] is True
    plain = loads(make_runner().get("/props"))
    assert plain["chat_format"]["name"] == "generic" and plain["chat_template_caps"]["supports_thinking"] is False


def test_efforts_become_budgets_only_where_the_template_ignores_them(qwen3, make_runner):
    state = qwen3().application.state
    assert thinking_budget(state, ChatBody.model_validate({**ASK, "reasoning_effort": "low"})) == EFFORT_BUDGETS["low"]
    assert thinking_budget(state, ChatBody.model_validate({**ASK, "reasoning_effort": "high"})) == -1
    assert thinking_budget(state, ChatBody.model_validate(
        {**ASK, "reasoning_effort": "low", "reasoning_budget_tokens": 7})) == 7
    reads_effort = make_runner(template=QWEN3_LIKE + "{{ reasoning_effort }}").application.state
    assert thinking_budget(reads_effort, ChatBody.model_validate({**ASK, "reasoning_effort": "low"})) == -1


def test_n_choices_each_split_and_their_reasoning_tokens_summed(qwen3):
    out = loads(qwen3().post("/v1/chat/completions", json={**ASK, "n": 2}))
    assert [ch["message"]["reasoning_content"] for ch in out["choices"]] == ["Let me see."] * 2
    assert out["usage"]["completion_tokens_details"] == {"reasoning_tokens": 30}
