"""Each family's calls and thoughts, whole and streamed (every chunking agrees): cases after llama.cpp's test-chat.cpp."""

import pytest

from app.engine.formats import detect
from app.engine.formats.detection import (
    COMMAND_R,
    DEEPSEEK_R1,
    DEEPSEEK_V3,
    FUNCTIONARY_V3_1,
    FUNCTIONARY_V3_2,
    GEMMA4,
    GRANITE,
    KIMI_K2,
    KIMI_K2_THINKING,
    LLAMA3,
    MAGISTRAL,
    MISTRAL,
    QWEN3_CODER,
    QWEN3_CODER_THINKING,
)
from tests.engine.formats.helpers import calls_of, check

PARIS = [("get_weather", {"city": "Paris"})]


# -- Qwen3-Coder / Qwen3.5 / Nemotron XML ------------------------------------------------------

XML_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"


def test_xml_parameters_are_typed_by_the_schema():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    assert calls_of(check(QWEN3_CODER, text)) == [("get_weather", {"city": "42", "days": 3})]


def test_xml_multiline_string_values_are_kept_raw():
    text = '<tool_call>\n<function=python>\n<parameter=code>\nprint("a")\n\nprint(1)\n</parameter>\n</function>\n</tool_call>'
    assert calls_of(check(QWEN3_CODER, text)) == [("python", {"code": 'print("a")\n\nprint(1)'})]


def test_xml_thinking_then_two_calls():
    text = ("I'm\nthinking\n</think>\n\n" + XML_CALL + "\n"
            "<tool_call>\n<function=get_time>\n</function>\n</tool_call>")
    answer = check(QWEN3_CODER_THINKING, text, in_thought=True)
    assert answer.reasoning == "I'm\nthinking" and answer.content == ""
    assert calls_of(answer) == PARIS + [("get_time", {})]


def test_xml_a_call_ends_the_prompt_opened_thought_without_a_close():
    text = "Need to look.\n" + XML_CALL
    answer = check(QWEN3_CODER_THINKING, text, in_thought=True)
    assert answer.reasoning == "Need to look." and calls_of(answer) == PARIS


@pytest.mark.parametrize("text", [
    "<tool_call>\n<function=unknown>\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\nstray text<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
])
def test_xml_malformed_or_cut_calls_are_content(text):
    answer = check(QWEN3_CODER, text)
    assert answer.content == text and not answer.calls


# -- Llama 3.x --------------------------------------------------------------------------------

def test_llama3_bare_json_calls_with_parameters():
    assert calls_of(check(LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}}')) == PARIS
    assert calls_of(check(LLAMA3, '{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}')) \
        == PARIS


def test_llama3_python_tag_builtin_and_code():
    assert calls_of(check(LLAMA3, '<|python_tag|>python.call(code="print(\'hey\')")')) == \
        [("python", {"code": "print('hey')"})]
    assert calls_of(check(LLAMA3, "<|python_tag|>print(1)")) == [("python", {"code": "print(1)"})]
    assert calls_of(check(LLAMA3, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}')) == PARIS


def test_llama3_text_and_json_mid_answer_are_content():
    for text in ["Hello, world!", 'The call is {"name": "get_weather", "parameters": {}}', '{"name": "nope"}']:
        assert check(LLAMA3, text).content == text


# -- Mistral / Devstral / Magistral -----------------------------------------------------------

def test_mistral_named_calls_with_args_and_ids():
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}'
    assert calls_of(check(MISTRAL, text)) == PARIS + [("get_time", {})]
    answer = check(MISTRAL, '[TOOL_CALLS]get_weather[CALL_ID]abc123XYZ[ARGS]{"city": "Paris"}')
    assert answer.calls[0].id == "abc123XYZ"


def test_mistral_older_json_list():
    text = 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "123456789"}]'
    answer = check(MISTRAL, text)
    assert calls_of(answer) == PARIS and answer.content == "Sure." and answer.calls[0].id == "123456789"


@pytest.mark.parametrize("text", ["[TOOL_CALLS]nope[ARGS]{}", "[TOOL_CALLS]get_weather[ARGS][1]",
                                  "[TOOL_CALLS] hello there", "[TOOL_CALLS]get_weather[ARGS]{\"city\": "])
def test_mistral_malformed_is_content(text):
    answer = check(MISTRAL, text)
    assert answer.content == text and not answer.calls


def test_magistral_thinks_in_think_brackets_and_a_marker_inside_is_thought():
    answer = check(MAGISTRAL, "[THINK]I'm\nthinking[/THINK]Hello, world!\nWhat's up?")
    assert (answer.reasoning, answer.content) == ("I'm\nthinking", "Hello, world!\nWhat's up?")
    answer = check(MAGISTRAL, '[THINK]Let me think about [TOOL_CALLS]get_time[ARGS]{} and more[/THINK]'
                              '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}')
    assert answer.reasoning == "Let me think about [TOOL_CALLS]get_time[ARGS]{} and more"
    assert calls_of(answer) == PARIS and answer.content == ""


# -- DeepSeek ---------------------------------------------------------------------------------

R1_CALL = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
           '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')


def test_deepseek_r1_thought_from_the_prompt_then_a_call():
    answer = check(DEEPSEEK_R1, "I'm\nthinking\n</think>\n\n" + R1_CALL, in_thought=True)
    assert answer.reasoning == "I'm\nthinking" and calls_of(answer) == PARIS and answer.content == ""


def test_deepseek_r1_two_calls_and_content_before():
    text = ("Looking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
            '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n'
            "{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    answer = check(DEEPSEEK_R1, text)
    assert answer.content == "Looking." and calls_of(answer) == PARIS + [("get_time", {})]


def test_deepseek_r1_a_fence_closed_on_the_arguments_line_and_an_empty_thought():
    text = ("</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
            '```json\n{"city": "Paris"}```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    answer = check(DEEPSEEK_R1, text, in_thought=True)
    assert (answer.reasoning, answer.content) == ("", "") and calls_of(answer) == PARIS


def test_deepseek_v3_1_calls():
    text = '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    answer = check(DEEPSEEK_V3, "Thinking it over</think>" + text, in_thought=True)
    assert answer.reasoning == "Thinking it over" and calls_of(answer) == PARIS


def test_deepseek_malformed_section_is_content_whole():
    text = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>nope\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    answer = check(DEEPSEEK_R1, text)
    assert answer.content == text and not answer.calls


# -- Granite, Command-R, Functionary ------------------------------------------------------------

def test_granite_tool_call_list_and_response_wrappers():
    answer = check(GRANITE, '<think>I\'m\nthinking</think><response>Hello, world!</response>')
    assert (answer.reasoning, answer.content) == ("I'm\nthinking", "Hello, world!")
    answer = check(GRANITE, '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                            '{"name": "get_time", "arguments": {}}]')
    assert calls_of(answer) == PARIS + [("get_time", {})]


def test_command_r_thinking_action_and_response():
    text = ('<|START_THINKING|>I\'m\nthinking<|END_THINKING|><|START_ACTION|>[\n'
            '    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}\n]<|END_ACTION|>')
    answer = check(COMMAND_R, text)
    assert answer.reasoning == "I'm\nthinking" and calls_of(answer) == PARIS and answer.calls[0].id == "0"
    answer = check(COMMAND_R, "<|START_THINKING|>I'm\nthinking<|END_THINKING|><|START_RESPONSE|>Hello, world!\n"
                              "What's up?<|END_RESPONSE|>")
    assert (answer.reasoning, answer.content) == ("I'm\nthinking", "Hello, world!\nWhat's up?")


def test_functionary_v3_1_function_tags_and_python():
    answer = check(FUNCTIONARY_V3_1, 'Sure<function=get_weather>{"city": "Paris"}</function>')
    assert calls_of(answer) == PARIS and answer.content == "Sure"
    assert calls_of(check(FUNCTIONARY_V3_1, "<|python_tag|>print(1)")) == [("python", {"code": "print(1)"})]


def test_functionary_v3_2_recipients():
    answer = check(FUNCTIONARY_V3_2, 'all\nHello, world!\nWhat\'s up?>>>get_weather\n{"city": "Paris"}')
    assert answer.content == "Hello, world!\nWhat's up?" and calls_of(answer) == PARIS
    answer = check(FUNCTIONARY_V3_2, 'get_weather\n{"city": "Paris"}>>>get_time\n{}')
    assert calls_of(answer) == PARIS + [("get_time", {})] and answer.content == ""
    answer = check(FUNCTIONARY_V3_2, "python\nprint(1)")
    assert calls_of(answer) == [("python", {"code": "print(1)"})]


def test_functionary_v3_2_without_tools_the_all_recipient_is_still_markup():
    # llama-server strips it too: the recipient line is the template's wrapper, not the answer.
    answer = check(FUNCTIONARY_V3_2, "all\nIt is sunny in Paris today.", tools=[])
    assert answer.content == "It is sunny in Paris today." and not answer.calls
    answer = check(FUNCTIONARY_V3_2, 'get_weather\n{"city": "Paris"}', tools=[])
    assert answer.content == 'get_weather\n{"city": "Paris"}' and not answer.calls


# -- Kimi K2 ---------------------------------------------------------------------------------

KIMI_CALL = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
             '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>'
             "{}<|tool_call_end|><|tool_calls_section_end|>")


def test_kimi_calls_keep_their_own_ids():
    answer = check(KIMI_K2, "Hello, world!\nWhat's up?" + KIMI_CALL)
    assert answer.content == "Hello, world!\nWhat's up?" and calls_of(answer) == PARIS + [("get_time", {})]
    assert [c.id for c in answer.calls] == ["functions.get_weather:0", "functions.get_time:1"]


def test_kimi_thinking_then_calls_and_a_malformed_section():
    answer = check(KIMI_K2_THINKING, "<think>I need to call two functions</think>" + KIMI_CALL)
    assert answer.reasoning == "I need to call two functions" and len(answer.calls) == 2
    bad = KIMI_CALL.replace("get_time", "nope")
    # The first unit's call went out when it ended; the section's broken rest is text.
    broken = check(KIMI_K2, bad)
    assert calls_of(broken) == PARIS and broken.content == bad[bad.index("<|tool_call_begin|>functions.nope"):]
    no_call = KIMI_CALL.replace("get_weather", "nope")
    assert check(KIMI_K2, no_call).content == no_call


# -- detection on the real templates ----------------------------------------------------------

@pytest.mark.parametrize("name,expected", [
    ("Qwen3-Coder", "qwen3_coder"), ("Qwen3.5-4B", "qwen3_coder"), ("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "qwen3_coder"),
    ("openai-gpt-oss-120b", "gpt_oss"), ("meta-llama-Llama-3.1-8B-Instruct", "llama3"),
    ("meta-llama-Llama-3.2-3B-Instruct", "llama3"), ("meta-llama-Llama-3.3-70B-Instruct", "llama3"),
    ("Mistral-Small-3.2-24B-Instruct-2506", "mistral"), ("unsloth-mistral-Devstral-Small-2507", "mistral"),
    ("mistralai-Mistral-Nemo-Instruct-2407", "mistral"), ("mistralai-Ministral-3-14B-Reasoning-2512", "magistral"),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "deepseek_r1"), ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "deepseek_r1"),
    ("llama-cpp-deepseek-r1", "deepseek_r1"), ("deepseek-ai-DeepSeek-V3.1", "deepseek_v3"),
    ("ibm-granite-granite-3.3-2B-Instruct", "granite"), ("CohereForAI-c4ai-command-r7b-12-2024-tool_use", "command_r"),
    ("meetkai-functionary-medium-v3.1", "functionary_v3_1"), ("meetkai-functionary-medium-v3.2", "functionary_v3_2"),
    ("Qwen-Qwen3-0.6B", "hermes"), ("Qwen-QwQ-32B", "hermes"), ("ibm-granite-granite-4.0.jinja"[:-6], "hermes"),
    ("google-gemma-2-2b-it", "generic"), ("microsoft-Phi-3.5-mini-instruct", "generic"),
    ("moonshotai-Kimi-K2", "kimi_k2"), ("Kimi-K2-Instruct", "kimi_k2"), ("Kimi-K2-Thinking", "kimi_k2"),
])
def test_detect_names_each_familys_format(templates, name, expected):
    assert detect(templates[name]).name == expected


@pytest.mark.parametrize("name,reasoning", [
    ("Qwen-Qwen3-0.6B", True), ("Qwen-Qwen2.5-7B-Instruct", False), ("Qwen3.5-4B", True), ("Qwen3-Coder", False),
    ("openai-gpt-oss-120b", True), ("mistralai-Ministral-3-14B-Reasoning-2512", True),
    ("Mistral-Small-3.2-24B-Instruct-2506", False), ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", True),
    ("meta-llama-Llama-3.1-8B-Instruct", False), ("google-gemma-2-2b-it", False),
])
def test_detect_says_whether_the_model_thinks(templates, name, reasoning):
    assert detect(templates[name]).reasoning is reasoning


# -- Gemma 4 ----------------------------------------------------------------------------------

def test_gemma4_thought_and_dict_syntax_calls():
    text = ('<|channel>thought\nI\'m\nthinking<channel|><|tool_call>call:get_weather{city:<|"|>San Francisco<|"|>,'
            "days:3}<tool_call|><|tool_call>call:python{code:<|\"|>print([1, {2: 3}])<|\"|>}<tool_call|>")
    answer = check(GEMMA4, text)
    assert answer.reasoning == "I'm\nthinking" and answer.content == ""
    assert calls_of(answer) == [("get_weather", {"city": "San Francisco", "days": 3}),
                                ("python", {"code": "print([1, {2: 3}])"})]


def test_gemma4_nested_values_and_content_before():
    from app.engine.formats.gemma import gemma_value

    assert gemma_value('{todos:[<|"|>buy milk<|"|>,<|"|>walk dog<|"|>],config:{theme:<|"|>dark<|"|>,n:-1.5e3},'
                       "x:null,y:true}") == {"todos": ["buy milk", "walk dog"], "config": {"theme": "dark", "n": -1.5e3},
                                             "x": None, "y": True}
    answer = check(GEMMA4, 'Hello, world!<|tool_call>call:get_time{}<tool_call|>')
    assert answer.content == "Hello, world!" and calls_of(answer) == [("get_time", {})]


@pytest.mark.parametrize("text", ["<|tool_call>call:get_weather{city:Paris}<tool_call|>",
                                  "<|tool_call>call:nope{}<tool_call|>", '<|tool_call>call:get_weather{city:<|"|>Par'])
def test_gemma4_malformed_calls_are_content(text):
    answer = check(GEMMA4, text)
    assert answer.content == text and not answer.calls


@pytest.mark.parametrize("text", ["<|channel>thought\n<channel|>Hello, world!\nWhat's up?<channel|>",
                                  "<|channel>thought\n<channel|>Hello, world!\nWhat's up?<|channel>thought\n<channel|>",
                                  "<|channel><|channel>thought\n<channel|>Hello, world!\nWhat's up?"])
def test_gemma4_stray_channel_markers_are_dropped(text):
    answer = check(GEMMA4, text)
    assert (answer.reasoning, answer.content) == ("", "Hello, world!\nWhat's up?")


def test_gemma4_is_detected(templates):
    assert detect(templates["google-gemma-4-31B-it"]) == GEMMA4
    assert detect(templates["google-gemma-4-31B-it-interleaved"]) == GEMMA4


def test_gemma4_a_stray_marker_at_the_very_end_is_dropped_too():
    assert check(GEMMA4, "Hello<|channel>").content == "Hello"


def test_functionary_v3_2_a_long_first_line_is_content_however_it_is_cut():
    text = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]}>>>get_weather\n{"city": "Paris"}'
    answer = check(FUNCTIONARY_V3_2, text)
    assert answer.content == text.split(">>>")[0] and calls_of(answer) == PARIS
