"""JSON Schema checks and conversion: what is honoured, what is refused by name, caching."""

import json
import re

import pytest

from app.engine import grammar
from app.engine.grammar import (
    GrammarTooLarge,
    UnsupportedSchema,
    integer_range_rule,
    llama_pattern,
    normalise_schema,
    schema_grammar,
    tool_call_grammar,
)
from app.schema_subset import MAX_ALTERNATIVES, MAX_GRAMMAR_WIDTH, check_gbnf

HA_TASK = {
    "type": "object",
    "properties": {"room": {"type": ["string", "null"], "maxLength": 20},
                   "level": {"type": "string", "enum": ["low", "high"]},
                   "count": {"type": ["integer", "null"]}},
    "required": ["room", "level", "count"],
    "additionalProperties": False,
}


def test_nullable_type_lists_keep_their_other_keywords():
    out = normalise_schema(HA_TASK)
    assert out["properties"]["room"] == {"anyOf": [{"maxLength": 20, "type": "string"}, {"type": "null"}]}
    gbnf = schema_grammar(HA_TASK).gbnf
    assert '"\\"room\\""' in gbnf and "null" in gbnf and '"\\"low\\""' in gbnf


def test_enum_beside_a_type_list_is_not_dropped():
    assert normalise_schema({"type": ["string", "null"], "enum": ["a", None]}) == {"enum": ["a", None]}


def _as_regex(rule: str) -> re.Pattern:
    """The GBNF of integer_range_rule as a Python regex (its only parts: literals, classes, |)."""
    return re.compile(rule.replace('"', "").replace(" ", ""))


@pytest.mark.parametrize("low,high", [(0, 100), (0, 1000), (1, 9), (-15, 7), (-100, -3), (7, 7), (19, 2341), (0, 0)])
def test_integer_ranges_match_exactly_their_values(low, high):
    pattern = _as_regex(integer_range_rule(low, high))
    for n in range(low - 30, high + 31):
        assert bool(pattern.fullmatch(str(n))) == (low <= n <= high), n
    assert not pattern.fullmatch("00")


def test_ranges_are_honoured_and_open_or_float_ones_refused():
    gbnf = schema_grammar({"type": "object", "properties": {"b": {"type": "integer", "minimum": 0, "maximum": 100}},
                           "required": ["b"]}).gbnf
    assert '"1" "0" "0"' in gbnf and "__hearth" not in gbnf
    with pytest.raises(UnsupportedSchema, match="'minimum"):
        normalise_schema({"type": "integer", "minimum": 5})
    with pytest.raises(UnsupportedSchema, match="'maximum"):
        normalise_schema({"type": "number", "maximum": 1.5})


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "properties": {"a": {"type": "string", "format": "email"}}}, "format: email"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "object", "patternProperties": {"^x": {}}}, "patternProperties"),
    ({"$ref": "https://example.com/s.json"}, "$ref: https://example.com/s.json"),
    ({"type": "integer", "multipleOf": 2}, "multipleOf"),
    ({"allOf": [{"type": "string"}]}, "allOf"),
])
def test_unsupported_keywords_are_named(schema, keyword):
    with pytest.raises(UnsupportedSchema) as exc:
        normalise_schema(schema)
    assert exc.value.keyword == keyword
    assert keyword in str(exc.value)


def test_annotations_and_pydantic_refs_pass():
    schema = {"$defs": {"Item": {"type": "object", "title": "Item", "properties": {"n": {"type": "integer"}},
                                 "required": ["n"], "additionalProperties": False}},
              "type": "object", "title": "Order", "description": "x",
              "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}}},
              "required": ["items"], "additionalProperties": False}
    assert "items" in schema_grammar(schema).gbnf


def test_grammars_are_cached_per_schema():
    assert schema_grammar(HA_TASK).gbnf is schema_grammar(dict(HA_TASK)).gbnf


def test_tool_call_grammar_bounds_unbounded_arrays():
    g = tool_call_grammar([("f", {"type": "object", "properties": {"d": {"type": "array", "items": {"type": "string"}}},
                                  "required": ["d"]})], "generic", parallel=False)
    assert '"\\"f\\""' in g.gbnf and "{0,3}" not in g.gbnf
    assert "tool0-args-d" in g.gbnf


def test_draft_4_tuple_items_are_prefix_items():
    # {"items": [...]}: llama-server reads the list form as a tuple, exactly those items in order.
    g = schema_grammar({"items": [{"type": "integer"}, {"type": "string"}]})
    root = next(line for line in g.gbnf.splitlines() if line.startswith("root ::="))
    assert "integer" in root and "string" in root and "," in root
    assert normalise_schema({"items": [{"type": "integer"}]}) == {"prefixItems": [{"type": "integer"}]}


# -- bounds: the converter's budget, its linear object rule, the caches, check_gbnf -------------------


def _upstream_rules(schema: dict) -> dict:
    """The rules llama-cpp-python's own converter makes of a normalised schema."""
    from llama_cpp.llama_grammar import SchemaConverter

    converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    converter.visit(converter.resolve_refs(json.loads(json.dumps(normalise_schema(schema))), "input"), "")
    return converter._rules


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}, "c": {"type": "boolean"}},
     "required": ["b"]},
    {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}, "c": {"type": "null"}}},
    {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a"],
     "additionalProperties": {"type": "number"}},
    {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True},
    {"type": "object", "additionalProperties": {"type": "string"}},
    {"type": "object", "properties": {"x": {"type": "object", "properties": {"y": {"type": "string"}}}}},
])
def test_the_linear_object_rule_makes_the_converters_own_rules(schema):
    converter = grammar._converter()
    grammar._visit(converter, json.loads(json.dumps(normalise_schema(schema))), "")
    assert converter._rules == _upstream_rules(schema)


def test_many_optional_properties_convert_within_every_bound():
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(MAX_ALTERNATIVES - 1)}}
    g = schema_grammar(schema)
    size = check_gbnf(g.gbnf, max_chars=grammar.MAX_GENERATED_GRAMMAR_CHARS)
    # After '{': every property, a space or the closing brace.
    assert size.width == MAX_ALTERNATIVES - 1 + 2 <= MAX_GRAMMAR_WIDTH and size.elements == g.elements


def _wide_ranges(n: int) -> dict:
    """A schema every door bound accepts whose grammar is big: n integer fields with irregular 18-digit bounds."""
    names = [f"n{i}" for i in range(n)]
    return {"type": "object", "required": names, "properties": {
        name: {"type": "integer", "minimum": -123456789012345678, "maximum": 987654321098765432} for name in names}}


def test_a_schema_past_the_converters_budget_is_refused_and_the_refusal_kept(monkeypatch):
    normalise_schema(_wide_ranges(400))  # the door lets it through: only the conversion shows its size
    grammar._schema_gbnf.cache_clear()  # another test's body may have been this very schema
    made = []
    real = grammar._converter
    monkeypatch.setattr(grammar, "_converter", lambda: made.append(1) or real())
    for _ in range(2):
        with pytest.raises(GrammarTooLarge, match="converted from the schema") as exc:
            schema_grammar(_wide_ranges(400))
        assert f"{grammar.MAX_GENERATED_GRAMMAR_CHARS:,}" in str(exc.value)
    assert len(made) == 1  # the second refusal came from the cache


def test_the_converted_grammar_cache_is_bounded_by_characters(monkeypatch):
    monkeypatch.setattr(grammar, "MAX_CACHED_GRAMMAR_CHARS", 100_000)
    grammar._schema_gbnf.cache_clear()
    sizes = []
    for i in range(12):
        g = schema_grammar({"type": "object", "properties": {f"f{i}-{j}": {"type": "string", "maxLength": 900 + i}
                                                             for j in range(4)}, "required": [f"f{i}-0"]})
        sizes.append(len(g.gbnf))
        assert grammar._schema_gbnf.cache_chars() <= 100_000
    assert sum(sizes) > 2 * 100_000  # more was made than is kept
    grammar._schema_gbnf.cache_clear()


@pytest.mark.parametrize("text,rules,elements", [
    ("root ::= [a-z]{0,1999}", 2000, None),  # llama.cpp: root, then one rule per optional copy
    ('root ::= "ab"{3}', 1, 7),  # the literal copied three times, and the rule's end
    ('root ::= ( "a" # a comment\n  | "b" )\n', 2, None),
])
def test_check_gbnf_counts_what_llama_cpp_builds(text, rules, elements):
    size = check_gbnf(text)
    assert size.rules == rules
    assert elements is None or size.elements == elements


def test_check_gbnf_measures_depth_and_width():
    chain = "root ::= r0\n" + "".join(f'r{i} ::= r{i + 1} "a"\n' for i in range(50)) + 'r50 ::= "b"'
    assert check_gbnf(chain).left_depth == 50
    tail = "root ::= r0\n" + "".join(f'r{i} ::= "a" | r{i + 1}\n' for i in range(50)) + 'r50 ::= "b"'
    size = check_gbnf(tail)
    assert size.left_depth == 0 and size.width == 51  # tail calls push nothing; every "a" is open at once


@pytest.mark.parametrize("pattern,expected", [
    (r"^\d{4}-\d{2}$", r"^[0-9]{4}-[0-9]{2}$"),
    (r"^\S+\.\w$", r"^[^ \t\n\r\x0B\x0C]+[\x2E][a-zA-Z0-9_]$"),
    (r"^[\w\-]+$", r"^[a-zA-Z0-9_\x2D]+$"),
    (r"^\+?\(a\)$", r"^\+?\(a\)$"),  # what the converter unescapes itself stays
])
def test_regex_escapes_llama_cpp_lacks_are_written_as_classes(pattern, expected):
    assert llama_pattern(pattern) == expected
    check_gbnf(schema_grammar({"type": "string", "pattern": pattern}).gbnf)  # llama.cpp's parser takes it


@pytest.mark.parametrize("key", ["minItems", "maxItems", "minLength", "maxLength"])
def test_a_negative_count_is_refused_before_the_converter_sees_it(key):
    kind = "array" if "Items" in key else "string"
    with pytest.raises(UnsupportedSchema, match="negative"):
        schema_grammar({"type": kind, key: -1})
    # In a tool's parameters a negative minItems made the converter's "up to max - min" repetition 10^19 long
    # (an OverflowError from inside llama-cpp-python, the hostile-input suite's find).
    params = {"type": "object", "properties": {"a": {"type": kind, key: -10**19}}}
    with pytest.raises(UnsupportedSchema, match="negative"):
        tool_call_grammar([("f", params)], "generic", parallel=True)


# -- calls in a family's own layout (app.engine.formats.grammars builds these) -----------------------

def test_a_call_layout_names_each_tool_and_types_xml_parameters():
    from app.engine.grammar import CallLayout, layout_grammar

    layout = CallLayout((("call", r'"<function=" {name} ">\n" {params} "</function>"'),), "call")
    g = layout_grammar([("f", {"type": "object", "properties": {"s": {"type": "string"}, "n": {"type": "integer"},
                                                                 "e": {"enum": ["a", "b"]}},
                               "required": ["s"]})], layout)
    rules = dict(line.split(" ::= ", 1) for line in g.gbnf.splitlines())
    assert rules["tool0-call"].startswith('"<function=" "f"')
    params = rules["tool0-params"]
    assert params.startswith('"<parameter=" "s" ">\\n" xml-text') and '( "<parameter=" "n"' in params
    assert '"a" | "b"' in params and rules["xml-text"]
    assert layout_grammar([("f", {"type": "object"})], layout).gbnf is layout_grammar([("f", {"type": "object"})],
                                                                                      layout).gbnf


def test_a_call_layout_bounds_unbounded_arrays_as_the_envelope_does():
    from app.engine.grammar import CallLayout, layout_grammar

    g = layout_grammar([("f", {"type": "object", "properties": {"d": {"type": "array", "items": {"type": "string"}}}})],
                       CallLayout((("call", "{name} {args}"),), "call"))
    assert "tool0-args-d" in g.gbnf and "{0,3}" not in g.gbnf.replace("{0,2}", "")
