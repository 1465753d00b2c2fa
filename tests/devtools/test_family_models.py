"""The families' doubles: real vocabularies with their markup as single tokens, and grammars that spell a script."""

import json

import gguf
import pytest
from gguf.constants import GGUFValueType

from app.devtools import family_models
from app.devtools.family_models import FAMILIES, SCRIPTS_DIR, Script, load_scripts, script_gbnf, split_specials
from app.devtools.serving.families_bench import Got, Outcome, judge, stream_mismatch
from app.gguf_meta import read_typed_fields
from app.schema_subset import check_gbnf


@pytest.fixture(scope="module")
def vendored():
    try:
        return family_models.vendored_models_dir()
    except RuntimeError as exc:
        pytest.skip(str(exc))


def test_every_family_has_its_template_vocabulary_and_scripts(vendored):
    for f in FAMILIES.values():
        assert (vendored / "templates" / f.template).is_file(), f.name
        assert (vendored / f"ggml-vocab-{f.vocab}.gguf").is_file(), f.name
        scripts = load_scripts(f.name)
        assert {"content_only", "malformed_call"} & {s.name for s in scripts}, f.name
        assert any(s.expect["calls"] for s in scripts), f.name
        if f.reasoning:
            assert any(s.expect["reasoning"] and not s.cut for s in scripts), f.name
    assert {p.stem for p in SCRIPTS_DIR.glob("*.json")} == set(FAMILIES)


def test_a_double_holds_the_real_vocabulary_with_the_markup_as_single_tokens(vendored):
    double = family_models.family_model("gpt_oss")
    fields = {key: value for key, (value, _, _) in read_typed_fields(double.path).items()}
    tokens, types = list(fields["tokenizer.ggml.tokens"]), fields["tokenizer.ggml.token_type"]
    vocab = list(read_typed_fields(vendored / "ggml-vocab-gpt-2.gguf")["tokenizer.ggml.tokens"][0])
    assert tokens[:len(vocab)] == vocab
    for text in ("<|channel|>", "<|message|>", "<|return|>", "<|call|>"):
        assert types[tokens.index(text)] == gguf.TokenType.CONTROL
        assert double.special_ids[text] == tokens.index(text)
    assert fields["tokenizer.ggml.eos_token_id"] == tokens.index("<|return|>")
    template = fields["tokenizer.chat_template"]
    assert template == (vendored / "templates" / "openai-gpt-oss-120b.jinja").read_text()


def test_a_placeholder_slot_takes_the_markup_where_the_vocabulary_has_one(vendored):
    tok, ids = family_models.family_tokenizer(FAMILIES["qwen3"])
    assert tok.tokens[ids["<think>"]] == "<think>" and ids["<think>"] < 151936
    assert tok.types[ids["<tool_call>"]] == gguf.TokenType.USER_DEFINED


def test_the_grammar_spells_text_and_special_tokens_in_order():
    ids = {"<think>": 7, "</think>": 8}
    assert split_specials('<think>\nhm "ok"</think>x', ids) == [7, '\nhm "ok"', 8, "x"]
    text = script_gbnf('<think>\nhm "ok"</think>x', ids)
    assert text == 'root ::= <[7]> "\\nhm \\"ok\\"" <[8]> "x"\n'
    check_gbnf(text)


def test_every_script_becomes_a_grammar_the_door_accepts():
    ids = {f"<m{i}>": i for i in range(3)}
    for name in FAMILIES:
        for s in load_scripts(name):
            check_gbnf(script_gbnf(s.raw, ids))


def _script(**expect) -> Script:
    full = {"reasoning": "", "content": "", "calls": [], **expect}
    return Script("f", "s", "raw", full, cut=full.pop("cut", False))


def test_judge_names_what_landed_where():
    s = _script(reasoning="Paris?", content="Sunny in Paris.")
    assert judge(s, Got("Paris?", " Sunny in Paris.\n")) == []
    problems = judge(s, Got("", "Paris?Sunny in Paris."))
    assert any("reasoning" in p for p in problems) and any("content" in p for p in problems)
    call = _script(calls=[{"name": "get_weather", "arguments": {"city": "Paris"}}])
    assert judge(call, Got(calls=[{"name": "get_weather", "arguments": '{"city": "Paris"}'}])) == []
    assert any(p.startswith("calls") for p in judge(call, Got(content='{"city": "Paris"}')))


def test_a_cut_thought_must_be_the_start_of_the_thought_and_nothing_else():
    s = _script(reasoning="Let me think about Paris", cut=True)
    assert judge(s, Got("Let me think")) == []
    assert judge(s, Got("Let me think", "about")) != []


def test_an_answer_the_grammar_did_not_force_is_named_so():
    assert judge(_script(content="Sunny in Paris."), Got(content="\n" * 50))[0].startswith("not forced")


def test_a_stream_differing_from_the_whole_answer_is_shown():
    whole = Got("Paris", "ok", [{"name": "f", "arguments": '{"a": 1}'}])
    assert stream_mismatch(whole, Got("Paris", "ok", [{"name": "f", "arguments": {"a": 1}}])) is None
    assert "content" in stream_mismatch(whole, Got("Paris", "ok!", whole.calls))


def test_an_outcome_line_says_right_or_what_was_wrong():
    assert Outcome("hearth", "qwen3", "s", "ollama", True, [], "").line().endswith("right")
    assert "WRONG: x" in Outcome("hearth", "qwen3", "s", "ollama", False, ["x"], "").line()
    json.dumps(Outcome("hearth", "q", "s", "a", False, [], "").__dict__)


def test_read_typed_fields_reads_every_key_as_gguf_s_own_reader_does(vendored):
    # The vocabulary of a real family (strings, token types, float scores, merges): what the doubles copy.
    path = vendored / "ggml-vocab-phi-3.gguf"
    mine = read_typed_fields(path)
    reader = gguf.GGUFReader(str(path))
    assert set(mine) == {k for k in reader.fields if not k.startswith("GGUF.")}
    for key, (value, value_type, item_type) in mine.items():
        field = reader.fields[key]
        assert value_type == field.types[0]
        assert item_type == (field.types[1] if value_type == GGUFValueType.ARRAY else None)
        theirs = field.contents()
        assert (list(value) if value_type == GGUFValueType.ARRAY else value) == theirs, key
