"""Each family's call grammar: llama.cpp compiles it over a real vocabulary, it admits the family's
well-formed calls (a thought first where the family thinks) and refuses a tool it was not offered."""

from pathlib import Path

import pytest

from app.engine.formats import AnswerParser
from app.engine.formats.detection import (
    COMMAND_R,
    DEEPSEEK_R1,
    DEEPSEEK_V3,
    FUNCTIONARY_V3_1,
    FUNCTIONARY_V3_2,
    GEMMA4,
    GENERIC,
    GPT_OSS,
    GRANITE,
    HERMES,
    KIMI_K2,
    LLAMA3,
    MAGISTRAL,
    MISTRAL,
    MISTRAL_LIST,
    QWEN3,
    QWEN3_CODER,
)
from app.engine.formats.grammars import call_grammar
from tests.engine.formats.conftest import TEMPLATES
from tests.engine.formats.grammar_matcher import VocabGrammars
from tests.engine.formats.helpers import TOOLS
from tests.engine.formats.test_cut_calls import TWO_CALLS

VOCAB = TEMPLATES.parent / "ggml-vocab-gemma-4.gguf"
# Gemma's SentencePiece vocabulary reads "▁" as a space: DeepSeek's markers need a byte-level one.
BPE_VOCAB = TEMPLATES.parent / "ggml-vocab-deepseek-llm.gguf"

# A well-formed call to get_weather(city="Paris") in each family's syntax, and the same naming "get_wether".
CALLS = {
    GENERIC: '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}',
    HERMES: '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    QWEN3: '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    QWEN3_CODER: "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    LLAMA3: '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    MISTRAL: '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
    MISTRAL_LIST: '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    MAGISTRAL: '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
    DEEPSEEK_R1: '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}'
                 "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    DEEPSEEK_V3: '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
                 "<｜tool▁calls▁end｜>",
    GRANITE: '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    COMMAND_R: '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}]'
               "<|END_ACTION|>",
    FUNCTIONARY_V3_1: '<function=get_weather>{"city": "Paris"}</function>',
    FUNCTIONARY_V3_2: 'get_weather\n{"city": "Paris"}',
    KIMI_K2: "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
             '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>',
    GEMMA4: '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
    GPT_OSS: '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
}
THOUGHTS = {QWEN3: "<think>\nThe weather, then.\n</think>\n\n", MAGISTRAL: "[THINK]The weather, then.[/THINK]",
            DEEPSEEK_R1: "<think>\nThe weather.\n</think>\n\n", COMMAND_R: "<|START_THINKING|>Weather.<|END_THINKING|>",
            GEMMA4: "<|channel>thought\nThe weather.<channel|>",
            GPT_OSS: "<|channel|>analysis<|message|>The weather.<|end|><|start|>assistant"}
FAMILIES = list(CALLS)


def _spm_safe(fmt) -> bool:
    return "▁" not in CALLS.get(fmt, "")


@pytest.fixture(scope="module")
def vocabs():
    if not VOCAB.is_file() or not BPE_VOCAB.is_file():
        pytest.skip(f"the vendored vocabularies are not unpacked at {VOCAB.parent}")
    loaded = {"spm": VocabGrammars(VOCAB), "bpe": VocabGrammars(BPE_VOCAB)}
    yield loaded
    for grammars in loaded.values():
        grammars.close()


@pytest.fixture
def vocab(vocabs, request):
    fmt = request.node.callspec.params.get("fmt") if hasattr(request.node, "callspec") else None
    return vocabs["spm" if fmt is None or _spm_safe(fmt) else "bpe"]


def _id(fmt):
    return fmt.name + ("_list" if fmt is MISTRAL_LIST else "") + ("_thinking" if fmt is QWEN3 else "")


@pytest.mark.parametrize("fmt", FAMILIES, ids=_id)
def test_required_admits_the_familys_call_and_refuses_an_unoffered_tool(vocab, fmt):
    g = call_grammar(fmt, TOOLS, "required", parallel=False)
    assert not g.lazy
    assert vocab.accepts(g, CALLS[fmt])
    assert not vocab.accepts(g, CALLS[fmt].replace("get_weather", "get_wether"))


@pytest.mark.parametrize("fmt", FAMILIES, ids=_id)
def test_what_the_grammar_admits_the_parser_reads_as_the_call(fmt):
    parser = AnswerParser(fmt, TOOLS)
    parser.push(THOUGHTS.get(fmt, "") + CALLS[fmt])
    parser.finish()
    assert [(c.name, c.arguments) for c in parser.answer.calls] == [("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize("fmt", list(THOUGHTS), ids=_id)
def test_a_thought_may_come_before_a_required_call(vocab, fmt):
    g = call_grammar(fmt, TOOLS, "required", parallel=False)
    assert vocab.accepts(g, THOUGHTS[fmt] + CALLS[fmt])


def test_a_thought_the_prompt_opened_must_close_before_the_call(vocab):
    g = call_grammar(QWEN3, TOOLS, "required", parallel=False, in_thought=True)
    assert vocab.accepts(g, "The weather, then.\n</think>\n\n" + CALLS[QWEN3])


def test_named_choice_admits_only_that_tool(vocab):
    g = call_grammar(HERMES, TOOLS, {"type": "function", "function": {"name": "get_time"}}, parallel=False)
    assert not vocab.accepts(g, CALLS[HERMES])
    assert vocab.accepts(g, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_parallel_calls_only_when_allowed(vocab):
    two = CALLS[MISTRAL] + '[TOOL_CALLS]get_time[ARGS]{}'
    assert vocab.accepts(call_grammar(MISTRAL, TOOLS, "required", parallel=True), two)
    assert not vocab.accepts(call_grammar(MISTRAL, TOOLS, "required", parallel=False), two + "[TOOL_CALLS]")


def test_xml_parameters_are_typed(vocab):
    g = call_grammar(QWEN3_CODER, TOOLS, "required", parallel=False)
    days = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n{}\n</parameter>\n"
    assert vocab.accepts(g, days.format("3"))
    assert not vocab.accepts(g, days.format("three"))


@pytest.mark.parametrize("fmt", FAMILIES, ids=_id)
def test_auto_is_lazy_and_triggers_at_the_familys_marker(vocab, fmt):
    import re

    g = call_grammar(fmt, TOOLS, "auto", parallel=True)
    assert g.lazy and g.trigger_patterns
    start = next(m for m in (re.search(p, CALLS[fmt]) for p in g.trigger_patterns) if m) \
        if fmt is not FUNCTIONARY_V3_2 else None
    text = CALLS[fmt][start.start(1):] if start else ">>>" + CALLS[fmt]
    assert vocab.accepts(g, text)


@pytest.mark.parametrize("fmt,text", [
    (LLAMA3, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    (FUNCTIONARY_V3_1, "<|python_tag|>print(1)"),
])
def test_a_lazy_grammar_admits_the_python_tag_a_runner_triggers_on(vocab, fmt, text):
    assert vocab.accepts(call_grammar(fmt, TOOLS, "auto", parallel=False), text)


def test_none_and_no_tools_have_no_grammar():
    assert call_grammar(HERMES, TOOLS, "none", parallel=True) is None
    assert call_grammar(HERMES, [], "required", parallel=True) is None


def test_every_familys_grammar_compiles_with_the_embedded_models_vocabulary(gemma_path):
    grammars = VocabGrammars(Path(gemma_path))
    try:
        for fmt in FAMILIES:
            for choice in ("required", "auto"):
                grammars.llama.llama_sampler_free(grammars.compile(call_grammar(fmt, TOOLS, choice, parallel=True)))
            if _spm_safe(fmt):
                assert grammars.accepts(call_grammar(fmt, TOOLS, "required", parallel=False), CALLS[fmt]), fmt.name
    finally:
        grammars.close()


@pytest.mark.parametrize("fmt, text", TWO_CALLS, ids=[f"{f.name}-{i}" for i, (f, _) in enumerate(TWO_CALLS)])
def test_parallel_tool_calls_false_admits_exactly_one_call(vocab, fmt, text):
    # parallel_tool_calls false (Anthropic's disable_parallel_tool_use): the grammar spells one call, then ends.
    tools = [TOOLS[0], {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    assert vocab.accepts(call_grammar(fmt, tools, "required", parallel=True), text)
    one = call_grammar(fmt, tools, "required", parallel=False)
    assert not vocab.accepts(one, text)
    assert vocab.accepts(one, CALLS[fmt])
