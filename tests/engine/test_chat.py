"""Tests for app.engine.chat: chat templates from GGUFs, Gemma 3's format, the fallback."""

from datetime import datetime

import gguf
import pytest

from app.engine.chat import (
    ChatTemplate,
    ChatTemplateError,
    fallback_template,
    load_chat_template,
    strip_leading_bos,
    template_from_gguf,
)


@pytest.fixture(scope="session")
def gemma(gemma_path):
    """The chat template Hearth uses for the embedded Gemma 3 model."""
    return template_from_gguf(gemma_path)


USER_X = [{"role": "user", "content": "x"}]


def write_gguf(path, architecture="llama", template=None, tokens=None, bos_id=1, eos_id=2,
               endianess=gguf.GGUFEndian.LITTLE):
    """Writes a weightless GGUF with just the metadata chat templating reads."""
    tokens = tokens or ["<unk>", "<s>", "</s>", "hello"]
    writer = gguf.GGUFWriter(path, architecture, endianess=endianess)
    # Keys the reader must skip, around the ones it reads, as in real GGUFs.
    writer.add_uint32("test.before_tokens", 7)
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_bos_token_id(bos_id)
    writer.add_eos_token_id(eos_id)
    writer.add_array("test.nested", [[1, 2], [3]])
    if template is not None:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


def test_embedded_gemma_has_no_template_so_the_builtin_gemma3_one_is_used(gemma, gemma_path):
    # The embedded GGUF carries no tokenizer.chat_template; if a future build adds one,
    # this fails so the Gemma assertions below are re-checked against the model's own.
    assert gemma.origin == "builtin:gemma3"
    assert (gemma.bos_token, gemma.eos_token) == ("<bos>", "<eos>")
    assert load_chat_template(gemma_path).origin == "builtin:gemma3"


def test_gemma_system_and_user_match_the_official_format(gemma):
    prompt = gemma.render([
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is a NAS?"},
    ])
    assert prompt == (
        "<bos><start_of_turn>user\nYou are a helpful assistant.\n\nWhat is a NAS?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def test_gemma_multi_turn(gemma):
    prompt = gemma.render([
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "  Tell me a joke.\n"},
    ])
    assert prompt == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello! How can I help?<end_of_turn>\n"
        "<start_of_turn>user\nTell me a joke.<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def test_gemma_without_generation_prompt(gemma):
    prompt = gemma.render([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert prompt == "<bos><start_of_turn>user\nHi<end_of_turn>\n"


def test_content_parts_are_flattened_to_text(gemma):
    prompt = gemma.render([
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": t} for t in ("One", "Two")]},
    ])
    assert prompt == (
        "<bos><start_of_turn>user\nBe brief.\n\nOne\nTwo<end_of_turn>\n<start_of_turn>model\n"
    )


def test_developer_role_is_treated_as_system(gemma):
    prompt = gemma.render([{"role": "developer", "content": "S"}, {"role": "user", "content": "U"}])
    assert prompt == "<bos><start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\n"


def test_gemma_rejects_non_alternating_roles_with_a_template_message(gemma):
    with pytest.raises(ChatTemplateError, match="alternate user/assistant"):
        gemma.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ChatTemplateError, match="at least one user message"):
        gemma.render([{"role": "system", "content": "only a system prompt"}])


@pytest.mark.parametrize(("messages", "message"), [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    (["hello"], r"messages\[0\] must be an object"),
    ([{"role": "robot", "content": "x"}], r"messages\[0\].role is 'robot'"),
    ([{"role": "user", "content": 42}], "string or a list of text parts"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "text parts only"),
    ([{"role": "user", "content": [{"type": "text", "text": None}]}], r"\.text must be a string"),
])
def test_bad_messages_say_what_to_fix(gemma, messages, message):
    with pytest.raises(ChatTemplateError, match=message):
        gemma.render(messages)


def test_strip_leading_bos(gemma):
    prompt = gemma.render([{"role": "user", "content": "Hi"}])
    rest, had_bos = strip_leading_bos(prompt, gemma.bos_token)
    assert had_bos and rest == "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert strip_leading_bos("plain", "<bos>") == ("plain", False)
    assert strip_leading_bos("<bos>x", "") == ("<bos>x", False)


def test_raise_exception_in_a_template_becomes_chat_template_error():
    template = ChatTemplate("{{ raise_exception('no tools here') }}", "<s>", "</s>")
    with pytest.raises(ChatTemplateError, match="rejected the messages: no tools here"):
        template.render(USER_X)


def test_template_runtime_and_syntax_errors_become_chat_template_error():
    with pytest.raises(ChatTemplateError, match="does not compile: line 1"):
        ChatTemplate("{% for m in messages %}", "", "")
    with pytest.raises(ChatTemplateError, match="failed on these messages"):
        ChatTemplate("{{ messages[0].content + 1 }}", "", "").render(USER_X)


def test_templates_run_in_a_sandbox_on_copies_of_their_inputs():
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        ChatTemplate("{{ ''.__class__.__mro__ }}", "", "").render(USER_X)
    # A template may build lists as llama.cpp's engine lets it (Kimi K2 appends), never changing the caller's.
    messages = [{"role": "user", "content": "x"}]
    template = ChatTemplate("{% set _ = messages.append(messages[0]) %}{{ messages | length }}", "", "")
    assert template.render(messages) == "2"
    assert template.render(messages) == "2" and messages == [{"role": "user", "content": "x"}]


def test_helpers_match_transformers():
    source = (
        "{{ tools | tojson }}|{{ {'k': '<ü>'} | tojson(indent=2) }}|{{ strftime_now('%Y-%m-%d') }}"
        "|{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}"
    )
    template = ChatTemplate(source, "", "", clock=lambda: datetime(2025, 3, 14, 9, 26))
    rendered = template.render(
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
        tools=[{"type": "function", "function": {"name": "lights", "description": "Turn <lights> on & off"}}],
    )
    # Tools reach the template as llama.cpp hands them over: description and parameters always present.
    assert rendered == (
        '[{"type": "function", "function": {"name": "lights", "description": "Turn <lights> on & off", '
        '"parameters": {}}}]|{\n  "k": "<ü>"\n}|2025-03-14|user'
    )


def test_llama_server_extra_context_dates_and_no_functions_text():
    # firefunction-v2 reads `datetime` and `functions`, Llama 3.x `date_string`; a request's kwargs win. llama.cpp
    # gives no `functions` text (firefunction-v2 renders it empty there), so neither does Hearth.
    source = "{{ datetime }}|{{ date_string }}|{{ functions }}|{{ 'x' + functions }}"
    template = ChatTemplate(source, "", "", clock=lambda: datetime(2025, 3, 4, 9, 26))
    tools = [{"type": "function", "function": {"name": "lights"}}]
    assert template.render(USER_X) == "Mar 04 2025|04 Mar 2025||x"
    assert template.render(USER_X, tools=tools) == "Mar 04 2025|04 Mar 2025||x"
    assert template.render(USER_X, kwargs={"date_string": "01 Jan 2000"}) == "Mar 04 2025|01 Jan 2000||x"


def test_trim_and_lstrip_blocks_are_on():
    source = "{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}"
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert ChatTemplate(source, "", "").render(messages) == "a\nb\n"


def test_fallback_template_is_chatml():
    template = fallback_template()
    assert template.origin == "fallback:chatml"
    prompt = template.render([
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "text", "text": "U"}]},
    ])
    assert prompt == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )


def test_gguf_own_template_is_used_with_its_bos_and_eos(tmp_path):
    source = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}"
    source += "{% endfor %}"
    path = write_gguf(tmp_path / "own.gguf", template=source)
    template = template_from_gguf(path)
    assert template.origin == "gguf"
    assert template.source == source
    assert template.render([{"role": "user", "content": "hi"}]) == "<s>[user]hi</s>"


def test_gguf_own_template_wins_over_the_builtin_one(tmp_path):
    path = write_gguf(tmp_path / "gemma-own.gguf", architecture="gemma3", template="{{ 'own' }}")
    assert template_from_gguf(path).origin == "gguf"


def test_big_endian_gguf_is_read(tmp_path):
    path = write_gguf(
        tmp_path / "be.gguf", template="{{ bos_token }}!", endianess=gguf.GGUFEndian.BIG
    )
    assert template_from_gguf(path).render(USER_X) == "<s>!"


def test_gguf_without_template_or_known_architecture(tmp_path):
    path = write_gguf(tmp_path / "bare.gguf", bos_id=2, eos_id=1)
    assert template_from_gguf(path) is None
    template = load_chat_template(path)
    assert template.origin == "fallback:chatml"
    assert (template.bos_token, template.eos_token) == ("</s>", "<s>")


def test_out_of_range_special_token_ids_give_empty_strings(tmp_path):
    source = "{{ bos_token }}|{{ eos_token }}"
    path = write_gguf(tmp_path / "odd.gguf", template=source, bos_id=99, eos_id=2)
    assert template_from_gguf(path).render(USER_X) == "|</s>"


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all", b"GGUF\x03\x00\x00\x00\x00"])
def test_files_that_are_not_gguf_raise_chat_template_error(tmp_path, content):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ChatTemplateError, match="GGUF"):
        template_from_gguf(path)
