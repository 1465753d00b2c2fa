"""A template's inputs as llama.cpp builds them: probed capabilities decide the messages' shape (no llama.cpp here)."""

from __future__ import annotations

from app.engine.chat import ChatTemplate

CALL = {"id": "a1b2c3d4e", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
HISTORY = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]

# Reads a call's arguments as an object (as gpt-oss does) / prints them whole (as Hermes-style templates do).
OBJECT_ARGUMENTS = ("{% for t in tools %}{{ t.function.name }};{% endfor %}{% for m in messages %}"
                    "{% for c in m.tool_calls or [] %}{% for k, v in c.function.arguments.items() %}{{ k }}={{ v }}"
                    "{% endfor %}{% endfor %}{% endfor %}")
TEXT_ARGUMENTS = ("{% for t in tools %}{{ t.function.name }};{% endfor %}{% for m in messages %}"
                  "{% for c in m.tool_calls or [] %}{{ c.function.arguments }}{% endfor %}{% endfor %}")
NO_SYSTEM_ROLE = "{% for m in messages %}{% if m.role != 'system' %}[{{ m.role }}]{{ m.content }}{% endif %}{% endfor %}"


def test_arguments_become_objects_only_where_the_template_reads_them_so():
    objects, text = ChatTemplate(OBJECT_ARGUMENTS, "", ""), ChatTemplate(TEXT_ARGUMENTS, "", "")
    assert objects.caps.supports_object_arguments and not text.caps.supports_object_arguments
    assert objects.render(HISTORY, tools=TOOLS) == "get_weather;city=Oslo"
    # The client's text, unchanged (not re-serialised, not double-encoded).
    assert text.render(HISTORY, tools=TOOLS) == 'get_weather;{"city": "Oslo"}'


def test_an_object_sent_as_arguments_is_kept_as_its_compact_dump_for_text_templates():
    call = {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}}
    history = [HISTORY[0], {"role": "assistant", "tool_calls": [call]}]
    assert ChatTemplate(TEXT_ARGUMENTS, "", "").render(history, tools=TOOLS) == 'get_weather;{"city":"Oslo","unit":"c"}'


def test_a_system_message_is_folded_into_the_next_turn_where_the_template_has_no_system_role():
    template = ChatTemplate(NO_SYSTEM_ROLE, "", "")
    assert not template.caps.supports_system_role
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert template.render(messages) == "[user]Be brief.\nHi"


def test_variables_are_given_as_llama_cpp_gives_them():
    source = ("{{ add_generation_prompt is defined }}|{{ tools is defined }}|{{ messages[0].content == '' }}|"
              "{{ messages[0] | list | join(',') }}")
    template = ChatTemplate(source, "", "")
    messages = [{"role": "assistant", "content": None, "tool_calls": [CALL], "name": "n"}]
    assert template.render(messages, add_generation_prompt=False) == "False|False|True|role,content,name,tool_calls"
    assert template.render(messages, tools=TOOLS).startswith("True|True|")


def test_text_parts_are_joined_only_for_templates_that_take_strings():
    parts = [{"role": "user", "content": [{"type": "text", "text": "One"}, {"type": "text", "text": "Two"}]}]
    assert ChatTemplate("{{ messages[0].content }}", "", "").render(parts) == "One\nTwo"
    typed = ChatTemplate("{% for p in messages[0].content %}<{{ p.text }}>{% endfor %}", "", "")
    assert typed.caps.supports_typed_content
    assert typed.render(parts) == "<One><Two>"


def test_thinking_is_found_where_llama_cpp_finds_it():
    opens_a_thought = "{% if add_generation_prompt %}<a>{% if enable_thinking %}<think>{% endif %}{% endif %}"
    switch_in_system = "Deliberation: {{ enable_thinking }}\n{% if add_generation_prompt %}<a>{% endif %}"
    shows_past_reasoning = "{% for m in messages %}{{ m.reasoning_content }}{{ m.content }}{% endfor %}"
    assert ChatTemplate(opens_a_thought, "", "").supports_thinking
    assert not ChatTemplate(switch_in_system, "", "").supports_thinking
    assert ChatTemplate(shows_past_reasoning, "", "").supports_thinking
