"""Hostile bodies, one per bound, and the refusal each must get: shared by the body-validation and runner tests."""

from __future__ import annotations

from dataclasses import dataclass

from app.protocols.openai import MAX_LOGIT_BIAS, MAX_STOP_CHARS
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
    """A string inside `levels` arrays (each a level of nesting)."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


def props(n: int, required: bool = True, **value) -> dict:
    """An object of n string properties p0.. (with `value`'s keywords), all required or none."""
    names = [f"p{i}" for i in range(n)]
    return {"type": "object", "properties": {p: {"type": "string", **value} for p in names},
            **({"required": names} if required else {})}


def tool(name: str, parameters: dict) -> dict:
    """One OpenAI tool entry."""
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
         ("times the rules it repeats", f"{LLAMA_MAX_REPETITIONS:,}")),
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
