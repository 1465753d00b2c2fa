"""The repetitive-work scenarios of the speculation axis: their prompts, [bench] defaults and the command line's axes."""

import pytest

from app.cli import build_parser
from app.verdict.command import axes
from app.verdict.scenarios import PromptCutter, ScenarioError, load_scenario, parse_scenario, plan, shipped_names
from app.verdict.spec import DEFAULT_LLAMA_SPEC
from app.verdict.texts import CODE_EDIT_START, CODE_FUNCTIONS, ha_context, repeat_prompt

REPEATS = ("code-edit", "document-quote", "tool-arguments")


def test_the_three_repetitive_scenarios_ship_as_one_greedy_stream_with_off_and_ngram_lookup():
    assert set(REPEATS) <= set(shipped_names())
    for name in REPEATS:
        s = load_scenario(name)
        assert s.kind == "script" and len(s.streams) == 1 and s.streams[0].count == 1
        assert s.modes == ("continuous",) and s.spec == ("off", "ngram-lookup")
        assert s.llama_spec == ("off", "ngram-simple", "ngram-map-k", "ngram-mod")
    assert load_scenario("code-edit").streams[0].output_tokens == (256, 256)
    # The older scenarios name no axis: nothing changes for them.
    h = load_scenario("household")
    assert (h.modes, h.spec, h.llama_spec) == (None, (), ())


def test_a_repetitive_prompt_is_one_whole_text_that_ends_where_the_copy_starts():
    code = repeat_prompt("code-edit")
    assert code.startswith(CODE_FUNCTIONS) and code.endswith("# The same functions, with type hints:\n\n" + CODE_EDIT_START)
    # Every function of the list is in the prompt: the copy has them all to draw from.
    assert code.count("\ndef ") + code.startswith("def ") == 7
    quote = repeat_prompt("document-quote")
    assert quote.endswith("Dear neighbours, the residents' association") and quote.count("Dear neighbours") == 2
    tool = repeat_prompt("tool-arguments")
    assert tool.startswith(ha_context()) and tool.endswith('"light.living_room_floor_lamp",')
    assert ha_context().count("\nlight.") == 16
    with pytest.raises(KeyError):
        repeat_prompt("poem")


def test_the_plan_sends_the_same_whole_prompt_whatever_the_cutter_and_counts_its_tokens():
    s = load_scenario("code-edit")
    (estimated,) = plan(s, 1, PromptCutter())
    assert estimated.text == repeat_prompt("code-edit") and estimated.max_tokens == 256
    assert estimated.prompt_tokens == len(estimated.text) // 4
    # With the target's tokenizer (one token per word here), the count is exact; the text stays whole.
    words: dict[str, int] = {}
    cutter = PromptCutter(lambda t: [words.setdefault(w, len(words)) for w in t.split()], lambda toks: "")
    (exact,) = plan(s, 1, cutter)
    assert exact.text == estimated.text and exact.prompt_tokens == len(exact.text.split())
    assert plan(s, 1, cutter) == [exact]


def test_a_scenario_file_names_its_bench_defaults_and_bad_ones_are_named():
    base = {"name": "x", "kind": "script", "streams": [{"class": "coding", "text": "code-edit", "output_tokens": 8}]}
    s = parse_scenario({**base, "bench": {"spec": ["off", "ngram-mod"]}})
    # A spec axis without llama-server arms of its own gets each of llama-server's n-gram types.
    assert s.spec == ("off", "ngram-mod") and s.llama_spec == DEFAULT_LLAMA_SPEC and s.modes is None
    assert s.streams[0].prompt_tokens == (0, 0)
    with pytest.raises(ScenarioError, match="bench.spec: unknown speculation arm 'eagle'"):
        parse_scenario({**base, "bench": {"spec": ["off", "eagle"]}})
    with pytest.raises(ScenarioError, match="bench.llama_spec: llama-server arm ngram-lookup: ngram-lookup is Hearth's own"):
        parse_scenario({**base, "bench": {"spec": ["off"], "llama_spec": ["ngram-lookup"]}})
    with pytest.raises(ScenarioError, match="bench.modes"):
        parse_scenario({**base, "bench": {"modes": ["batched"]}})
    # A cut kind still needs its prompt length.
    with pytest.raises(ScenarioError, match=r"streams\[0\].prompt_tokens"):
        parse_scenario({"name": "x", "kind": "script", "streams": [{"class": "chat", "text": "chat", "output_tokens": 8}]})


def _args(*argv):
    return build_parser().parse_args(["bench", "replay", *argv])


def test_the_command_line_takes_the_scenarios_axes_unless_told():
    code = load_scenario("code-edit")
    assert axes(_args("--scenario", "code-edit"), code) == (("continuous",), ("off", "ngram-lookup"), DEFAULT_LLAMA_SPEC)
    assert axes(_args("--spec", "off,auto", "--llama-spec", "none,ngram-mod", "--modes", "continuous,serial"), code) == (
        ("continuous", "serial"), ("off", "auto"), ("off", "ngram-mod"))
    # --spec none: no axis, the runners start as they always did.
    assert axes(_args("--spec", "none"), code) == (("continuous",), (), ())
    household = load_scenario("household")
    assert axes(_args(), household) == (("continuous", "serial", "static"), (), ())
    assert axes(_args("--spec", "off,auto"), household)[1:] == (("off", "auto"), DEFAULT_LLAMA_SPEC)
