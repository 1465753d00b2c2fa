"""Hostile input to the schema and grammar paths, generated (hypothesis): within bounds or a 4xx, nothing else.

Property: every generated schema (deep, wide, huge numbers, patterns with big repetitions), GBNF
text, logit_bias map and stop list is either refused as the body is read (an ApiError 4xx naming
the field) or turns into a grammar / sampling settings within every bound; the conversion itself
ends in a grammar under MAX_GENERATED_GRAMMAR_CHARS that check_gbnf measures within its bounds, or
in a refusal the runner answers 400. Never another exception, never an over-budget grammar.
Example counts are small enough for a 2-core CI machine (the whole file runs in seconds).
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from app.engine.grammar import (
    MAX_GENERATED_GRAMMAR_CHARS,
    GrammarTooLarge,
    InvalidGrammar,
    UnsupportedSchema,
    schema_grammar,
    tool_call_grammar,
)
from app.protocols.openai import ApiError, ChatBody, CompletionBody, parse_body
from app.runner.sampling import logit_bias, sampling_params
from app.schema_subset import (
    MAX_GRAMMAR_ELEMENTS,
    MAX_GRAMMAR_LEFT_DEPTH,
    MAX_GRAMMAR_NESTING,
    MAX_GRAMMAR_RULES,
    MAX_GRAMMAR_WIDTH,
    check_gbnf,
)
from tests.engine.fake_model import FakeTextModel

HELLO = [{"role": "user", "content": "Hi"}]
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.data_too_large])

# Numbers at and past every bound, and the kinds of JSON numbers a client can send.
big = st.sampled_from([0, 1, 2, 999, 1000, 1001, 1999, 2000, 2001, 10**6, 10**8, 10**18, 10**19, 10**300, -1, -(10**19)])
numbers = big | st.integers(-5, 5) | st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([1e300, -1e300])
names = st.sampled_from(["a", "b", "name", "x-y", "root", "space", "char", "0", ""]) | st.text(max_size=12)
atoms = st.sampled_from(["a", "ab", ".", "[a-z]", "[^\"]", "\\d", "\\.", "(a|b)", "(", ")", "|", "[", "\\", "é"])
quantifiers = st.sampled_from(["", "*", "+", "?", "{3}", "{0,5}", "{2,}", "{1000}", "{1001}", "{0,1000}",
                               "{100000000}", "{5,3}", "{99999999999999999999}"])


@st.composite
def patterns(draw) -> str:
    """Regexes: atoms with quantifiers, groups nested a few or many levels, anchored or not."""
    body = "".join(draw(atoms) + draw(quantifiers) for _ in range(draw(st.integers(0, 6))))
    depth = draw(st.sampled_from([0, 1, 3, 40]))
    body = "(" * depth + body + ")" * depth + draw(quantifiers)
    anchored = draw(st.booleans())
    return f"^{body}$" if anchored else body


def schemas(max_leaves: int = 12):
    """JSON Schemas of every keyword the subset honours (and some it does not), values at and past the bounds."""
    leaf = st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null", "object",
                                                         "array", "date"])}),
        st.fixed_dictionaries({"type": st.just("string")}, optional={
            "minLength": big, "maxLength": big, "pattern": patterns(), "format": st.sampled_from(["date", "uuid", "email"])}),
        st.fixed_dictionaries({"type": st.just("integer")}, optional={"minimum": numbers, "maximum": numbers}),
        st.fixed_dictionaries({"enum": st.lists(st.integers() | st.text(max_size=5) | st.none(), max_size=5)
                               | st.builds(lambda n: list(range(n)), st.sampled_from([1000, 1001]))}),
        st.fixed_dictionaries({"const": st.text(max_size=20) | st.builds(lambda n: "x" * n, st.sampled_from([10, 130_000]))}),
        st.fixed_dictionaries({"$ref": st.sampled_from(["#/$defs/a", "#/$defs/missing", "#", "#/", "http://x/s.json"])}),
        st.just(True), st.just({}), st.integers(),
    )

    def wrap(inner):
        return st.one_of(
            st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(names, inner, max_size=4)},
                                  optional={"required": st.lists(names, max_size=3),
                                            "additionalProperties": st.booleans() | inner}),
            st.fixed_dictionaries({"type": st.just("array"), "items": inner},
                                  optional={"minItems": big, "maxItems": big}),
            st.fixed_dictionaries({"anyOf": st.lists(inner, max_size=4)}),
            st.fixed_dictionaries({"oneOf": st.lists(inner, max_size=3)}),
            st.fixed_dictionaries({"prefixItems": st.lists(inner, max_size=3)}),
            st.fixed_dictionaries({"$defs": st.fixed_dictionaries({"a": inner}), "$ref": st.just("#/$defs/a")}),
        )

    return st.recursive(leaf, wrap, max_leaves=max_leaves)


@st.composite
def wide_schemas(draw) -> dict:
    """Generated schemas grown past the bounds in one direction: deep, wide, or many of them."""
    inner = draw(schemas(max_leaves=4))
    shape = draw(st.sampled_from(["deep", "wide", "optional", "any-of", "any-of-any-of"]))
    n = draw(st.sampled_from([10, 31, 33, 999, 1001, 5001]))
    if shape == "deep":
        out = inner
        for _ in range(min(n, 60)):
            out = {"type": "array", "items": out}
        return out
    if shape in ("wide", "optional"):
        props = {f"p{i}": inner for i in range(n)}
        return {"type": "object", "properties": props, **({"required": list(props)} if shape == "wide" else {})}
    if shape == "any-of":
        return {"anyOf": [inner] * n}
    return {"anyOf": [{"anyOf": [inner] * 40}] * min(n, 100)}


def _within_budget(gbnf: str) -> None:
    assert len(gbnf) <= MAX_GENERATED_GRAMMAR_CHARS
    size = check_gbnf(gbnf, max_chars=MAX_GENERATED_GRAMMAR_CHARS)
    assert size.rules <= MAX_GRAMMAR_RULES and size.elements <= MAX_GRAMMAR_ELEMENTS
    assert size.nesting <= MAX_GRAMMAR_NESTING and size.left_depth <= MAX_GRAMMAR_LEFT_DEPTH
    assert size.width <= MAX_GRAMMAR_WIDTH


def _chat(**extra) -> ChatBody | None:
    """The body as the gateway and the runner read it; None when it is refused (with a 4xx naming a field)."""
    try:
        body, _ = parse_body(json.dumps({"messages": HELLO, **extra}).encode(), ChatBody)
    except ApiError as err:
        assert 400 <= err.status < 500 and err.message
        assert err.body()["error"]["message"] == err.message
        event(f"refused as read: {err.code}")
        return None
    return body


def _converts_or_is_refused(build) -> None:
    """The conversion the runner does: a grammar within budget, or a refusal it answers 400."""
    try:
        g = build()
    except (UnsupportedSchema, GrammarTooLarge, InvalidGrammar) as exc:
        assert str(exc) and exc.code in ("unsupported_schema", "schema_too_large", "grammar_too_large",
                                         "invalid_grammar")
        event(f"refused converting: {exc.code}")
        return
    event("converted")
    _within_budget(g.gbnf)


@FUZZ
@given(schemas() | wide_schemas())
def test_a_generated_response_schema_converts_within_budget_or_is_a_4xx(schema):
    body = _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    if body is not None:
        _converts_or_is_refused(lambda: schema_grammar(body.response_format.json_schema.schema_))


@FUZZ
@given(st.lists(schemas(max_leaves=6) | wide_schemas(), min_size=1, max_size=4), st.sampled_from(["generic", "hermes"]))
def test_generated_tool_schemas_convert_within_budget_or_are_a_4xx(parameters, wrapper):
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": p}} for i, p in enumerate(parameters)]
    body = _chat(tools=tools, tool_choice="required")
    if body is not None:
        specs = [(t.function.name, t.function.parameters) for t in body.tools]
        _converts_or_is_refused(lambda: tool_call_grammar(specs, wrapper, parallel=True))


symbols = st.sampled_from(['"a"', '"' + "b" * 3000 + '"', "[a-z]", "[^\\n]", ".", "x", "root", "<[5]>", "(", ")",
                           "|", "*", "+", "?", "{3}", "{0,1999}", "{2001}", "{0,2001}", "{5,3}", "{1000000}",
                           "\n", "\n  ", "# note\n", "\\", '"\\q"', "::=", "", " "])


@st.composite
def gbnf_texts(draw) -> str:
    """GBNF: a root and a few rules of random symbols, repetitions at and past llama.cpp's limits, garbage too."""
    rules = ["root", *draw(st.lists(st.sampled_from(["x", "y", "r-1"]), max_size=3, unique=True))]
    lines = []
    for name in rules:
        seq = " ".join(draw(st.lists(symbols, max_size=10)))
        repeat = draw(st.sampled_from([1, 1, 1, 50, 2100]))
        lines.append(f"{name} ::= " + " | ".join([seq or '"z"'] * repeat))
    text = "\n".join(lines)
    if draw(st.booleans()):
        depth = draw(st.sampled_from([10, 2001, 5000]))
        text += '\nx ::= ' + "(" * depth + '"a"' + ")" * depth
    return text


@FUZZ
@given(gbnf_texts())
def test_a_generated_gbnf_is_within_every_bound_or_a_4xx(text):
    body = _chat(grammar=text)
    if body is not None:
        event("accepted")
        _within_budget(body.grammar)


biases = (st.floats(-100, 100) | st.just(False) | st.integers(-100, 100)
          | st.floats(allow_nan=True, allow_infinity=True) | st.booleans() | big)
bias_keys = (st.integers(-5, 300).map(str) | st.text(max_size=8) | st.integers(-5, 300_000).map(str)
             | st.builds(lambda n: "x" * n, st.sampled_from([100, 1000, 1001, 5000])))


@FUZZ
@given(st.dictionaries(bias_keys, biases, max_size=5)
       | st.builds(lambda n: {str(i): 1 for i in range(n)}, st.sampled_from([300, 301, 10_000]))
       | st.lists(st.tuples(bias_keys | st.integers(-5, 300), biases).map(list)
                  | st.lists(bias_keys | st.integers() | biases, max_size=3), max_size=5))
@example({"²": False})  # a digit to str.isdigit() that int() refuses: was a 500
def test_a_generated_logit_bias_is_applied_or_a_4xx(raw):
    body = _chat(logit_bias=raw)
    if body is None:
        return
    model = FakeTextModel()
    try:
        pairs = logit_bias(model, body.logit_bias)
    except ApiError as err:
        assert err.status == 400 and err.param == "logit_bias"
        event("refused applying")
        return
    event("applied")
    assert len(pairs) <= model.n_vocab
    assert all(0 <= t < model.n_vocab and (b == float("-inf") or -100 <= b <= 100) for t, b in pairs)


@FUZZ
@given(st.lists(st.text(max_size=5) | st.builds(lambda n: "s" * n, st.sampled_from([1000, 1001, 100_000])),
                max_size=10) | st.text(max_size=3))
def test_a_generated_stop_list_becomes_settings_or_a_4xx(stop):
    for schema in (ChatBody, CompletionBody):
        extra = {"messages": HELLO} if schema is ChatBody else {"prompt": "x"}
        try:
            body, _ = parse_body(json.dumps({**extra, "stop": stop}).encode(), schema)
        except ApiError as err:
            assert err.status == 400 and err.param == "stop"
            continue
        params = sampling_params(body, 16)
        assert len(params.stop) <= 8 and all(len(s) <= 1000 for s in params.stop)
