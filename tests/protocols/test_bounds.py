"""Bounds on what a body can make a runner build, checked as the body is read: one table of hostile bodies.

Each hostile body is refused with a 400 in OpenAI's error shape that names the bound and its limit,
before anything is converted or compiled; each body just inside a bound is accepted. The same checks
run in the gateway and in the runner (both read bodies with these schemas), and the Ollama,
Anthropic and Responses bodies are checked as the OpenAI chat bodies they become.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from app.protocols import anthropic, ollama, responses
from app.protocols.openai import (
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_TOOLS,
    ApiError,
    ChatBody,
    CompletionBody,
    NativeCompletionBody,
    parse_body,
    validation_error,
)
from app.schema_subset import (
    LLAMA_MAX_REPETITIONS,
    MAX_ENUM_VALUES,
    MAX_GRAMMAR_CHARS,
    MAX_GRAMMAR_LEFT_DEPTH,
    MAX_GRAMMAR_NESTING,
    MAX_PATTERN_CHARS,
    MAX_PATTERN_NESTING,
    MAX_REPETITIONS,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_PROPERTIES,
)

HELLO = [{"role": "user", "content": "Hi"}]

# The issue's body: ~150 bytes of response_format that made the runner build gigabytes of grammar.
ISSUE_FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
    "type": "object", "properties": {"a": {"type": "string", "maxLength": 100000000}}, "required": ["a"]}}}


def rf(schema: dict) -> dict:
    """A chat body's response_format constraining to schema."""
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}}


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


def props(n: int, required: bool = True, **value) -> dict:
    names = [f"p{i}" for i in range(n)]
    return {"type": "object", "properties": {p: {"type": "string", **value} for p in names},
            **({"required": names} if required else {})}


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def chain(n: int) -> str:
    """A GBNF where rule i begins with rule i+1, n deep (llama.cpp's first stacks hold the whole chain)."""
    return "root ::= r0\n" + "".join(f'r{i} ::= r{i + 1} "a"\n' for i in range(n)) + f'r{n} ::= "b"'


@dataclass(frozen=True)
class Case:
    """A hostile chat body and its refusal: the param, the code and words the message must hold."""

    id: str
    extra: dict
    param: str
    code: str | None
    fragments: tuple[str, ...]


CASES = [
    Case("issue-150-byte-format", {"response_format": ISSUE_FORMAT}, "response_format", "schema_too_large",
         ("'maxLength'", "100,000,000", f"{MAX_REPETITIONS:,}")),
    Case("min-items", rf({"type": "array", "items": {"type": "integer"}, "minItems": 10**8}), "response_format",
         "schema_too_large", ("'minItems'", f"{MAX_REPETITIONS:,}")),
    Case("pattern-repetition", rf({"type": "string", "pattern": "^a{100000000}$"}), "response_format",
         "schema_too_large", ("{100000000}", "'pattern'", f"{MAX_REPETITIONS:,}")),
    Case("pattern-repetitions-together", rf({"type": "string", "pattern": "^" + "[a-z]{900}" * 3 + "$"}),
         "response_format", "schema_too_large", ("repetitions", "2,700", "2,000")),
    Case("pattern-nesting", rf({"type": "string", "pattern": "^" + "(" * 40 + "a" + ")" * 40 + "$"}),
         "response_format", "schema_too_large", ("nesting of groups", f"{MAX_PATTERN_NESTING:,}")),
    Case("pattern-length", rf({"type": "string", "pattern": "^" + "a" * 2000 + "$"}), "response_format",
         "schema_too_large", ("length of 'pattern'", f"{MAX_PATTERN_CHARS:,}")),
    Case("integer-range", rf({"type": "integer", "minimum": 0, "maximum": 1e300}), "response_format",
         "schema_too_large", ("'maximum'", "10^18")),
    Case("enum-values", rf({"enum": list(range(MAX_ENUM_VALUES + 1))}), "response_format", "schema_too_large",
         ("enum values", f"{MAX_ENUM_VALUES:,}")),
    Case("properties", rf(props(MAX_SCHEMA_PROPERTIES + 1)), "response_format", "schema_too_large",
         ("number of properties", f"{MAX_SCHEMA_PROPERTIES:,}")),
    Case("optional-properties", rf(props(1000, required=False)), "response_format", "schema_too_large",
         ("optional properties", "1,000")),
    Case("nesting-depth", rf(nested(MAX_SCHEMA_DEPTH + 5)), "response_format", "schema_too_large",
         ("nesting depth", f"{MAX_SCHEMA_DEPTH:,}")),
    Case("any-of-width", rf({"anyOf": [{"const": i} for i in range(1001)]}), "response_format", "schema_too_large",
         ("'anyOf' entries", "1,000")),
    Case("any-of-within-any-of", rf({"anyOf": [{"anyOf": [{"const": f"{i}.{j}"} for j in range(40)]}
                                               for i in range(40)]}),
         "response_format", "schema_too_large", ("alternatives", "1,600", "1,000")),
    Case("literal-characters", rf({"enum": ["x" * 10_000] * 13}), "response_format", "schema_too_large",
         ("characters", "120,000")),
    Case("ref-to-nothing", rf({"$ref": "#/$defs/missing"}), "response_format", "unsupported_schema",
         ("$ref: #/$defs/missing", "nothing there")),
    Case("json-schema-field", {"json_schema": {"type": "string", "maxLength": 10**9}}, "json_schema",
         "schema_too_large", ("'maxLength'",)),
    Case("tool-parameters", {"tools": [tool("f", props(1, maxLength=10**9))]}, "tools", "schema_too_large",
         ("'maxLength'", f"{MAX_REPETITIONS:,}")),
    Case("tools-together", {"tools": [tool(f"t{i}", props(1000)) for i in range(6)]}, "tools", "schema_too_large",
         ("all schemas together", "6,000", f"{MAX_SCHEMA_PROPERTIES:,}")),
    Case("grammar-length", {"grammar": "root ::= " + '"a" ' * (MAX_GRAMMAR_CHARS // 4)}, "grammar",
         "grammar_too_large", ("length in characters", f"{MAX_GRAMMAR_CHARS:,}")),
    Case("grammar-minimum-above-maximum", {"grammar": 'root ::= "a"{5,3}'}, "grammar", "invalid_grammar",
         ("{5,3}", "minimum above its maximum")),
    Case("grammar-repetition-count", {"grammar": 'root ::= "a"{100000000}'}, "grammar", "grammar_too_large",
         ("repetition count", f"{LLAMA_MAX_REPETITIONS:,}")),
    Case("grammar-repeated-literal", {"grammar": 'root ::= "' + "a" * 30_000 + '"{1999}'}, "grammar",
         "grammar_too_large", ("elements",)),
    Case("grammar-many-repetitions", {"grammar": "root ::= " + " ".join(["[a-z]{1999}"] * 2000)}, "grammar",
         "grammar_too_large", ("elements",)),
    Case("grammar-nested-repetitions", {"grammar": "root ::= ([a-z]{0,40}){0,50}"}, "grammar", "grammar_too_large",
         ("times the rules it repeats", f"{LLAMA_MAX_REPETITIONS - 1:,}")),
    Case("grammar-nesting", {"grammar": "root ::= " + "(" * 3000 + '"a"' + ")" * 3000}, "grammar",
         "grammar_too_large", ("nesting of parentheses", f"{MAX_GRAMMAR_NESTING:,}")),
    Case("grammar-left-chain", {"grammar": chain(3000)}, "grammar", "grammar_too_large",
         ("begin with another rule", f"{MAX_GRAMMAR_LEFT_DEPTH:,}")),
    Case("grammar-width", {"grammar": "root ::= " + " | ".join(f"r{i}" for i in range(2100)) + "\n"
                                      + "".join(f'r{i} ::= "{i}"\n' for i in range(2100))},
         "grammar", "grammar_too_large", ("alternatives open at one point", "2,048")),
    Case("grammar-undefined-rule", {"grammar": "root ::= value"}, "grammar", "invalid_grammar",
         ("'value' is used but never defined",)),
    Case("logit-bias-entries", {"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias", None,
         (f"at most {MAX_LOGIT_BIAS} entries",)),
    Case("logit-bias-value", {"logit_bias": {"5": 1e9}}, "logit_bias", None, ("-100 to 100",)),
    Case("logit-bias-text", {"logit_bias": [["x" * 5000, -1]]}, "logit_bias", None, ("text key", "1,000")),
    Case("stop-length", {"stop": ["x" * (MAX_STOP_CHARS + 1)]}, "stop", None, (f"{MAX_STOP_CHARS:,} characters",)),
    Case("stop-count", {"stop": [str(i) for i in range(9)]}, "stop", None, ("at most 8 stop strings",)),
    Case("choices", {"n": 100}, "n", None, ("at most 8 choices",)),
    Case("top-logprobs", {"logprobs": True, "top_logprobs": 1000}, "top_logprobs", None, ("20",)),
]


def refusal(body: dict, schema=ChatBody) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse_body(json.dumps(body).encode(), schema)
    return caught.value


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_a_hostile_body_is_refused_by_name_before_anything_is_built(case):
    err = refusal({"messages": HELLO, **case.extra})
    assert err.status == 400 and err.body()["error"]["type"] == "invalid_request_error"
    assert err.param == case.param and err.code == case.code, err.message
    for fragment in case.fragments:
        assert fragment in err.message, err.message


@pytest.mark.parametrize("extra", [
    rf({"type": "string", "maxLength": MAX_REPETITIONS}),
    rf({"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": MAX_REPETITIONS}),
    rf(props(MAX_SCHEMA_PROPERTIES)),
    rf(props(999, required=False)),
    rf({"enum": list(range(MAX_ENUM_VALUES))}),
    rf(nested(MAX_SCHEMA_DEPTH)),
    rf({"type": "string", "pattern": r"^[a-z]{1,64}(\.[a-z]{1,64})*@[a-z]{2,1000}$"}),
    rf({"type": "integer", "minimum": -(10**18), "maximum": 10**18}),
    rf({"$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"}),
    {"tools": [tool(f"t{i}", props(MAX_SCHEMA_PROPERTIES // MAX_TOOLS)) for i in range(MAX_TOOLS)]},
    {"grammar": 'root ::= [a-z]{0,1999} ("." [a-z]+)*'},
    {"grammar": chain(MAX_GRAMMAR_LEFT_DEPTH - 2)},
    {"logit_bias": {str(i): -100 for i in range(MAX_LOGIT_BIAS)}},
    {"logit_bias": [["hello", False], [15, 100]]},
    {"stop": ["x" * MAX_STOP_CHARS] * 8},
], ids=["max-length", "max-items", "properties", "optional-properties", "enum", "depth", "pattern", "integers",
        "recursive-ref", "tools", "grammar", "grammar-chain", "logit-bias", "logit-bias-pairs", "stops"])
def test_a_body_just_inside_every_bound_is_accepted(extra):
    parse_body(json.dumps({"messages": HELLO, **extra}).encode(), ChatBody)


def test_native_and_completion_bodies_have_the_same_bounds():
    err = refusal({"prompt": "x", "grammar": 'root ::= "a"{5,3}'}, NativeCompletionBody)
    assert (err.param, err.code) == ("grammar", "invalid_grammar")
    err = refusal({"prompt": "x", "json_schema": ISSUE_FORMAT["json_schema"]["schema"]}, NativeCompletionBody)
    assert (err.param, err.code) == ("json_schema", "schema_too_large")
    err = refusal({"prompt": "x", "logit_bias": {"1": float("nan")}}, CompletionBody)
    assert err.param == "logit_bias"


def test_a_body_nested_past_what_json_can_read_is_a_400():
    raw = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(ApiError) as caught:
        parse_body(raw, ChatBody)
    assert caught.value.status == 400 and caught.value.code == "invalid_json"
    assert "too deeply" in caught.value.message


def _as_chat(chat: dict) -> ApiError:
    """The refusal of a translated body, as the gateway's pipeline validates it."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as caught:
        ChatBody.model_validate(chat)
    return validation_error(caught.value)


def test_ollama_format_is_bounded_as_response_format():
    chat = ollama.chat_to_openai({"model": "m", "messages": HELLO, "format": ISSUE_FORMAT["json_schema"]["schema"]})
    err = _as_chat(chat)
    assert (err.status, err.param, err.code) == (400, "response_format", "schema_too_large")
    assert "'maxLength'" in err.message


def test_anthropic_tools_and_responses_formats_are_bounded_too():
    chat = anthropic.to_chat({"messages": HELLO, "max_tokens": 5, "tools": [
        {"name": "f", "input_schema": props(1, maxLength=10**9)}]})
    err = _as_chat(chat)
    assert (err.param, err.code) == ("tools", "schema_too_large")
    chat = responses.to_chat({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                                 "schema": {"enum": list(range(5000))}}}})
    err = _as_chat(chat)
    assert (err.param, err.code) == ("response_format", "schema_too_large")
