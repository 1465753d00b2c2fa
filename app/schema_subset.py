"""What constrained output can honour, checked at the door: the JSON Schema subset, and bounds on what a request builds.

A schema arrives in a request (response_format, a tool's parameters, Ollama's format) and is
checked here, with no engine and no HTTP, so a request naming a keyword the grammar converter would
silently ignore is refused as it is read. `normalise_schema` returns the checked copy the engine's
grammar converter (app.engine.grammar) renders.

Every keyword that makes the converter build more (lengths, counts, ranges, patterns, nesting) has
an upper bound here, and so has a client's own GBNF text (`check_gbnf` measures what llama.cpp's
parser would build from it, without building it): a request past one is refused by name before
anything is compiled, in the gateway and again in the runner, which clients may call directly.
"""

from __future__ import annotations

import copy
import math
import re
from collections import defaultdict
from dataclasses import dataclass

# Keywords the converter turns into grammar rules.
HONOURED = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
    "maxItems", "enum", "const", "anyOf", "oneOf", "$ref", "$defs", "definitions", "pattern",
    "format", "minLength", "maxLength", "minimum", "maximum",
})

# Keywords that say nothing about which values are valid.
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
    "readOnly", "writeOnly", "strict", "nullable",
})
FORMATS = frozenset({"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"})
TYPES = frozenset({"string", "number", "integer", "boolean", "null", "object", "array"})

# -- bounds on a schema ---------------------------------------------------------------------
# Where OpenAI's structured outputs publish a limit, it is theirs: a schema written for OpenAI fits.
# Subschemas within subschemas: OpenAI allows 10 levels of object nesting; each level may also be
# wrapped in an anyOf (Optional) and an array's items, so three nodes a level, rounded up.
MAX_SCHEMA_DEPTH = 32
MAX_SCHEMA_PROPERTIES = 5000  # OpenAI: 5000 object properties in a schema
MAX_ENUM_VALUES = 1000  # OpenAI: 1000 enum values in a schema
# OpenAI: 120,000 characters of property names, definition names, enum and const values in a schema.
MAX_SCHEMA_CHARS = 120_000
# anyOf/oneOf alternatives of one keyword: as many as enum values, since a documented enum is an
# anyOf of consts (one description each).
MAX_ALTERNATIVES = MAX_ENUM_VALUES
# minLength/maxLength/minItems/maxItems and a pattern's {m,n}: the converter writes "up to n" as n
# nested optional groups, two llama.cpp rules each, and llama.cpp's parser refuses a repetition over
# MAX_REPETITION_THRESHOLD (2000) rules; 1000 is the most it parses.
MAX_REPETITIONS = 1000
# minimum/maximum of an integer: within ±10^18 (int64's range, 19 digits), so its digit-wise range
# rule stays a few kilobytes.
MAX_INTEGER = 10**18
MAX_PATTERN_CHARS = 1000  # the longest published email or URL regexes are a few hundred characters
MAX_PATTERN_REPETITIONS = 2000  # all of a pattern's {m,n} together: each copies its item n times
MAX_PATTERN_NESTING = 32  # groups within groups of a pattern

# -- bounds on GBNF text (a client's own grammar) --------------------------------------------
# llama.cpp's grammars/ are all under 10 KB; a grammar this size is past anything hand-written.
MAX_GRAMMAR_CHARS = 64 * 1024
# What llama.cpp's parser builds from the text ({m,n} and groups become rules of their own): 65,536
# rules and 2^20 elements parse in well under 100 ms and 50 MB.
MAX_GRAMMAR_RULES = 1 << 16
MAX_GRAMMAR_ELEMENTS = 1 << 20
# Parentheses within parentheses: llama.cpp's parser recurses once per level and overflows an 8 MiB
# thread stack near 30,000 levels; the converter's own output for maxLength 1000 nests 1000 deep.
MAX_GRAMMAR_NESTING = 2 * MAX_REPETITIONS
# Rules that begin with another rule, in a chain: llama.cpp's first stacks hold the whole chain, copied
# once a level (a chain of 2000 takes 31 MB, of 10,000 600 MB and 2 s).
MAX_GRAMMAR_LEFT_DEPTH = 1000
# Alternatives open at once (after '{' of an object, every optional property; an enum's values):
# llama.cpp deduplicates its stacks by a linear search each time it expands them, so n of them cost
# n² (10,000 took 270 ms to expand once, 65,000 nine seconds); 2048 take about 10 ms.
MAX_GRAMMAR_WIDTH = 2048
LLAMA_MAX_REPETITIONS = 2000  # llama.cpp's MAX_REPETITION_THRESHOLD (src/llama-grammar.cpp)


class UnsupportedSchema(ValueError):
    """A JSON Schema keyword (or value) that constrained decoding cannot honour."""

    code = "unsupported_schema"

    def __init__(self, keyword: str, path: str):
        where = path or "the schema's root"
        super().__init__(f"JSON Schema keyword '{keyword}' (at {where}) is not supported for constrained output; "
                         f"supported: {', '.join(sorted(HONOURED))}")
        self.keyword = keyword
        self.path = path


class SchemaTooLarge(UnsupportedSchema):
    """A schema past one of the bounds on what it may make the grammar converter build."""

    code = "schema_too_large"

    def __init__(self, what: str, found: int, limit: int, path: str, fix: str):
        where = path or "the schema's root"
        ValueError.__init__(self, f"{what} (at {where}) is {_figure(found)}, over Hearth's limit of {_figure(limit)}; {fix}")
        self.keyword = what
        self.path = path
        self.limit = limit


def _figure(n: int) -> str:
    """A count as a message shows it: with thousands separators, or as a power of ten past a trillion."""
    if abs(n) < 10**12:
        return f"{n:,}"
    digits = len(str(abs(n))) - 1
    return f"10^{digits}" if abs(n) == 10**digits else f"{float(n):.3g}"


class GrammarTooLarge(ValueError):
    """A grammar (a client's GBNF, or one converted from a schema) past a bound on what llama.cpp would build."""

    code = "grammar_too_large"

    def __init__(self, what: str, found: int, limit: int, fix: str):
        super().__init__(f"{what} is {found:,}, over Hearth's limit of {limit:,}; {fix}")
        self.limit = limit


class InvalidGrammar(ValueError):
    """GBNF text llama.cpp's parser would refuse, found without running it."""

    code = "invalid_grammar"


@dataclass
class SchemaSize:
    """What a schema holds that the bounds count: properties, enum values, characters of names and values."""

    properties: int = 0
    enum_values: int = 0
    chars: int = 0

    def add(self, other: SchemaSize) -> None:
        """Count other's contents into this one."""
        self.properties += other.properties
        self.enum_values += other.enum_values
        self.chars += other.chars


# The JSON type each structural keyword must have; anything else is a malformed schema.
_SHAPES = {"properties": dict, "$defs": dict, "definitions": dict, "required": list, "enum": list,
           "anyOf": list, "oneOf": list, "prefixItems": list, "items": (dict, bool),
           "additionalProperties": (dict, bool), "minItems": int, "maxItems": int, "minLength": int,
           "maxLength": int, "pattern": str, "format": str, "$ref": str}
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems")


def normalise_schema(schema, path: str = "") -> dict:
    """A checked copy of schema that the converter renders faithfully; raises UnsupportedSchema (or SchemaTooLarge)."""
    return _inline_root_ref(_Walk(schema).normalise(path))


def _inline_root_ref(schema):
    """A root that is a $ref into its own definitions, as that definition with the definitions beside it: the
    converter loses the root's definitions while it resolves a $ref at the root (a KeyError, once a 500)."""
    seen = set()
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and schema["$ref"] not in seen:
        ref = schema["$ref"]
        seen.add(ref)
        kind, _, name = ref.removeprefix("#/").partition("/")
        defs = schema.get(kind) if kind in ("$defs", "definitions") and "/" not in name else None
        target = defs.get(name) if isinstance(defs, dict) else None
        if not isinstance(target, dict):
            break
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        schema = {**rest, **target}
    return schema


def measure_schema(schema, path: str = "") -> SchemaSize:
    """normalise_schema's checks, answering what the schema holds (a body's schemas are bounded together too)."""
    walk = _Walk(schema)
    walk.normalise(path)
    return walk.size


def check_schema_total(size: SchemaSize, path: str) -> None:
    """Refuse several schemas built into one grammar (a body's tools) whose sum is past a schema's bounds."""
    if size.properties > MAX_SCHEMA_PROPERTIES:
        raise SchemaTooLarge("the number of properties, all schemas together", size.properties, MAX_SCHEMA_PROPERTIES,
                             path, "offer fewer tools or smaller parameter schemas")
    if size.chars > MAX_SCHEMA_CHARS:
        raise SchemaTooLarge("the characters of names, enum and const values, all schemas together", size.chars,
                             MAX_SCHEMA_CHARS, path, "offer fewer tools or smaller parameter schemas")


class _Walk:
    """One schema's check: the tally of what it holds so far, and its root for $ref targets."""

    def __init__(self, schema):
        self.root = schema
        self.size = SchemaSize()
        # How many alternatives a normalised subschema opens where it begins, by id (the tree keeps them alive).
        self._fan: dict[int, int] = {}

    def normalise(self, path: str) -> dict:
        try:
            return self._normalise(self.root, path, 0)
        except UnsupportedSchema:
            raise
        except (TypeError, AttributeError, ValueError, KeyError, OverflowError) as exc:
            raise UnsupportedSchema(f"malformed schema ({type(exc).__name__}: {exc})", path) from exc

    def _count(self, what: str, n: int, path: str) -> None:
        size = self.size
        size.properties += n if what == "properties" else 0
        size.enum_values += n if what == "enum" else 0
        size.chars += n if what == "chars" else 0
        if size.properties > MAX_SCHEMA_PROPERTIES:
            raise SchemaTooLarge("the number of properties", size.properties, MAX_SCHEMA_PROPERTIES, path,
                                 "split the schema or leave some properties out")
        if size.enum_values > MAX_ENUM_VALUES:
            raise SchemaTooLarge("the number of enum values", size.enum_values, MAX_ENUM_VALUES, path,
                                 "use fewer values, or a plain string described in 'description'")
        if size.chars > MAX_SCHEMA_CHARS:
            raise SchemaTooLarge("the characters of property names, enum and const values", size.chars,
                                 MAX_SCHEMA_CHARS, path, "use shorter names and values")

    def _normalise(self, schema, path: str, depth: int) -> dict:
        if depth > MAX_SCHEMA_DEPTH:
            raise SchemaTooLarge("the nesting depth", depth, MAX_SCHEMA_DEPTH, path,
                                 "flatten the schema (subschemas within subschemas)")
        if schema is True or schema == {}:
            return {}
        if not isinstance(schema, dict):
            raise UnsupportedSchema(type(schema).__name__, path)
        if isinstance(schema.get("items"), list) and "prefixItems" not in schema:
            # Draft 4's tuple form (items as a list) is today's prefixItems, as llama-server reads it.
            schema = {**{k: v for k, v in schema.items() if k != "items"}, "prefixItems": schema["items"]}
        out: dict = {}
        down = depth + 1
        for key, value in schema.items():
            here = f"{path}.{key}" if path else key
            if key in ANNOTATIONS:
                continue
            if key not in HONOURED:
                raise UnsupportedSchema(key, path)
            shape = _SHAPES.get(key)
            if shape is not None and (not isinstance(value, shape) or (shape is int and isinstance(value, bool))):
                raise UnsupportedSchema(f"{key} of the wrong type", path)
            if key in ("properties", "$defs", "definitions"):
                if key == "properties":
                    self._count("properties", len(value), here)
                self._count("chars", sum(len(name) for name in value), here)
                out[key] = {name: self._normalise(sub, f"{here}.{name}", down) for name, sub in value.items()}
            elif key in ("anyOf", "oneOf", "prefixItems"):
                if len(value) > MAX_ALTERNATIVES:
                    raise SchemaTooLarge(f"the number of '{key}' entries", len(value), MAX_ALTERNATIVES, path,
                                         "use fewer alternatives")
                out[key] = [self._normalise(sub, f"{here}[{i}]", down) for i, sub in enumerate(value)]
            elif key in ("items", "additionalProperties") and isinstance(value, dict):
                out[key] = self._normalise(value, here, down)
            elif key == "required" and not all(isinstance(v, str) for v in value):
                raise UnsupportedSchema("required of the wrong type", path)
            elif key == "format" and value not in FORMATS:
                raise UnsupportedSchema(f"format: {value}", path)
            elif key == "type":
                types = value if isinstance(value, list) else [value]
                bad = next((t for t in types if t not in TYPES), None)
                if bad is not None:
                    raise UnsupportedSchema(f"type: {bad}", path)
                out[key] = value
            elif key == "$ref":
                self._check_ref(value, path)
                out[key] = value
            elif key in ("enum", "const"):
                values = value if key == "enum" else [value]
                self._count("enum", len(values) if key == "enum" else 0, here)
                for v in values:
                    self._count("chars", _value_chars(v, here, depth), here)
                out[key] = copy.deepcopy(value)
            elif key in _COUNTS:
                if value < 0:
                    # JSON Schema wants a non-negative count; a negative minItems made the converter's "up to
                    # max - min" repetitions unbounded (found by the hostile-input suite).
                    raise UnsupportedSchema(f"{key} of a negative value", path)
                if value > MAX_REPETITIONS:
                    raise SchemaTooLarge(f"'{key}'", value, MAX_REPETITIONS, path,
                                         f"lower it to {MAX_REPETITIONS:,} or leave it out")
                out[key] = value
            elif key == "pattern":
                _check_pattern(value, here)
                out[key] = value
            else:
                out[key] = copy.deepcopy(value)
        if "minimum" in out or "maximum" in out:
            out = _integer_range(out, path)
        if "oneOf" in out:
            # Alternatives that overlap would need "exactly one"; as a grammar oneOf is anyOf.
            out["anyOf"] = out.pop("oneOf")
        if "enum" in out or "const" in out:
            # The converter checks a list type before enum/const and would drop the values.
            out.pop("type", None)
        elif isinstance(out.get("type"), list):
            # ["string", "null"] with minLength etc.: one alternative per type, each with the keywords
            # that apply to it, so none is lost.
            rest = {k: v for k, v in out.items() if k != "type"}
            out = {"anyOf": [{**rest, "type": t} if t != "null" else {"type": "null"} for t in out["type"]]}
        if "anyOf" in out:
            # The converter renders anyOf alone and would ignore keywords beside it.
            beside = next((k for k in ("type", "properties", "required", "items", "additionalProperties") if k in out), None)
            if beside is not None:
                raise UnsupportedSchema(f"{beside} beside anyOf", path)
        self._check_width(out, path)
        return out

    def _check_width(self, out: dict, path: str) -> None:
        """Refuse a subschema that opens too many alternatives at one point (see MAX_ALTERNATIVES)."""
        if "anyOf" in out:
            fan = sum(self._fan.get(id(a), 1) for a in out["anyOf"])
            what = "the alternatives an anyOf opens (those of anyOfs within it included)"
        elif "enum" in out:
            fan, what = len(out["enum"]), "the number of enum values"
        else:
            fan, what = 1, ""
        props = out.get("properties") or {}
        optional = len(props) - len(set(out.get("required", ())) & set(props)) + ("additionalProperties" in out)
        if optional >= MAX_ALTERNATIVES:
            # After '{' every optional property may come first.
            fan, what = optional + 1, "the number of optional properties of one object"
        if fan > MAX_ALTERNATIVES:
            raise SchemaTooLarge(what, fan, MAX_ALTERNATIVES, path,
                                 "use fewer alternatives (or make some properties required)")
        self._fan[id(out)] = fan if "anyOf" in out or "enum" in out else 1

    def _check_ref(self, ref: str, path: str) -> None:
        """A $ref names a subschema of this schema ('#/$defs/name'); the converter resolves it the same way."""
        if not ref.startswith("#/"):
            raise UnsupportedSchema(f"$ref: {ref}", path)
        target = self.root
        for part in ref[2:].split("/"):
            if not isinstance(target, dict) or part not in target:
                raise UnsupportedSchema(f"$ref: {ref} (nothing there)", path)
            target = target[part]
        if not isinstance(target, dict | bool):
            raise UnsupportedSchema(f"$ref: {ref} (not a schema)", path)


def _value_chars(value, path: str, depth: int) -> int:
    """Characters of an enum/const value's strings and keys, walked without recursion; refuses one nested too deep."""
    chars = 0
    todo = [(value, depth)]
    while todo:
        v, d = todo.pop()
        if d > MAX_SCHEMA_DEPTH:
            raise SchemaTooLarge("the nesting depth of an enum or const value", d, MAX_SCHEMA_DEPTH, path,
                                 "use flatter values")
        if isinstance(v, str):
            chars += len(v)
        elif isinstance(v, list):
            todo.extend((x, d + 1) for x in v)
        elif isinstance(v, dict):
            chars += sum(len(k) for k in v)
            todo.extend((x, d + 1) for x in v.values())
        else:
            chars += 1
    return chars


_QUANTIFIER = re.compile(r"\{\s*(\d*)\s*(?:(,)\s*(\d*)\s*)?\}")


def _check_pattern(pattern: str, path: str) -> None:
    """Refuse a pattern whose grammar would be huge: too long, too nested, or repeating too much."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise SchemaTooLarge("the length of 'pattern'", len(pattern), MAX_PATTERN_CHARS, path, "use a shorter regex")
    if not (pattern.startswith("^") and pattern.endswith("$")):
        raise UnsupportedSchema("pattern (anchor it: ^...$)", path)
    depth = total = i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            # A class ends at the first unescaped ']' (as the converter reads it).
            i += 1
            while i < len(pattern) and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
        elif c == "(":
            depth += 1
            if depth > MAX_PATTERN_NESTING:
                raise SchemaTooLarge("the nesting of groups in 'pattern'", depth, MAX_PATTERN_NESTING, path,
                                     "use fewer groups within groups")
        elif c == ")":
            depth = max(0, depth - 1)
        elif c == "{" and (m := _QUANTIFIER.match(pattern, i)):
            low, high = (int(g) if g else 0 for g in (m.group(1), m.group(3)))
            count = max(low, high)
            if count > MAX_REPETITIONS:
                raise SchemaTooLarge(f"the repetition {m.group(0)} in 'pattern'", count, MAX_REPETITIONS, path,
                                     f"repeat at most {MAX_REPETITIONS:,} times")
            total += count
            if total > MAX_PATTERN_REPETITIONS:
                raise SchemaTooLarge("the repetitions {m,n} of 'pattern' together", total, MAX_PATTERN_REPETITIONS,
                                     path, "use fewer or smaller repetitions")
            i = m.end()
            continue
        i += 1


_RANGE_MARK = "__hearth_integer_range_{}_{}__"
RANGE_LITERAL = re.compile(r'"\\"__hearth_integer_range_(-?\d+)_(-?\d+)__\\""')


def _integer_range(schema: dict, path: str) -> dict:
    """An integer schema with bounds as a placeholder the GBNF gets a digit-wise range rule for."""
    low, high = schema.get("minimum"), schema.get("maximum")
    keyword = "minimum" if low is not None else "maximum"
    if schema.get("type") != "integer" or not all(isinstance(v, int | float) and not isinstance(v, bool)
                                                   for v in (low, high) if v is not None):
        raise UnsupportedSchema(keyword, path)
    for name, v in (("minimum", low), ("maximum", high)):
        if v is not None and not (math.isfinite(v) and abs(v) <= MAX_INTEGER):
            raise SchemaTooLarge(f"the magnitude of '{name}'", int(abs(v)) if math.isfinite(v) else 10**308,
                                 MAX_INTEGER, path, "keep integer bounds within ±10^18")
    if high is None:
        if low is None or low < 0 or low > 1:
            raise UnsupportedSchema(f"{keyword} (open ranges only from 0 or 1)", path)
        high = 10**15 - 1
    if low is None:
        raise UnsupportedSchema("maximum (without minimum)", path)
    low, high = math.ceil(low), math.floor(high)
    if low > high:
        raise UnsupportedSchema("minimum above maximum", path)
    return {"const": _RANGE_MARK.format(low, high)}


# -- GBNF ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GrammarSize:
    """What llama.cpp's parser would build from a GBNF text: rules, elements, nesting, left-chain depth, width."""

    chars: int
    rules: int
    elements: int
    nesting: int
    left_depth: int
    width: int


def check_gbnf(text: str, max_chars: int = MAX_GRAMMAR_CHARS) -> GrammarSize:
    """Measure GBNF text as llama.cpp's parser reads it; raises GrammarTooLarge or InvalidGrammar."""
    if len(text) > max_chars:
        raise GrammarTooLarge("the grammar's length in characters", len(text), max_chars,
                              "send a smaller grammar (or a JSON schema, which Hearth converts)")
    return _Gbnf(text).measure()


# llama.cpp's syntax (src/llama-grammar.cpp): spaces and # comments (newlines too where allowed),
# names, escapes in literals and classes, tokens <...>, !<...>, <[id]>.
_SPACE_NL = re.compile(r"(?:[ \t\r\n]|#[^\r\n]*)*")
_SPACE = re.compile(r"(?:[ \t]|#[^\r\n]*)*")
_NAME = re.compile(r"[a-zA-Z0-9-]+")
_ESCAPE = r'\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[trn\\"\[\]-])'
_ONE_ESCAPE = re.compile(_ESCAPE)
# One symbol of a sequence and the spaces after it (newlines are a symbol of their own: they end a
# rule, except inside parentheses). One match a symbol keeps the measuring loop short.
_SYMBOL = re.compile(
    rf'(?:"(?P<lit>(?:[^"\\]|{_ESCAPE})*)"'
    rf"|\[\^?(?P<cls>(?:[^\]\\]|{_ESCAPE})*)\]"
    r"|(?P<tok>!?<(?:\[[0-9]+\]|[^>]*)>)"
    r"|(?P<name>[a-zA-Z0-9-]+)"
    r"|\{\s*(?P<low>[0-9]+)\s*(?:(?P<comma>,)\s*(?P<high>[0-9]*)\s*)?\}"
    r"|(?P<op>[().*+?|])"
    r"|(?P<nl>[\r\n]))"
    r"(?:[ \t]|#[^\r\n]*)*"
)
_REPEATS = {"*": (0, None), "+": (1, None), "?": (0, 1)}
_TERMINAL = -1  # a symbol that matches characters (a literal, a class, a token, '.')


def _number(digits: str) -> int:
    """A repetition count; one too long for int() is a billion (past every bound anyway)."""
    return int(digits) if len(digits) <= 9 else 10**9


class _Sequence:
    """A rule being read (llama.cpp's parse_alternates/parse_sequence state), one per open group."""

    __slots__ = ("rule", "alts", "seq", "last", "last_elements", "prev_rules", "nested", "ids_before")

    def __init__(self, rule: int, nested: bool, ids_before: int = 0):
        self.rule = rule
        self.alts: list[list[int]] = []
        self.seq: list[int] = []
        self.last: int | None = None  # where the symbol a repetition applies to starts in seq
        self.last_elements = 0
        self.prev_rules = 1  # llama.cpp's n_prev_rules: rules a repetition of the last symbol copies
        self.nested = nested
        self.ids_before = ids_before

    def symbol(self, sym: int, elements: int) -> None:
        self.last, self.last_elements, self.prev_rules = len(self.seq), elements, 1
        self.seq.append(sym)

    def next_alternative(self) -> None:
        self.alts.append(self.seq)
        self.seq, self.last, self.last_elements, self.prev_rules = [], None, 0, 1


class _Gbnf:
    """One GBNF text measured: the rules llama.cpp would build, as symbol lists, counted as they are made."""

    def __init__(self, text: str):
        self.text = text
        self.ids: dict[str, int] = {}
        self.names: list[str] = []  # a generated rule's name is its rule's, as llama.cpp names it
        self.rules: dict[int, list[list[int]]] = {}
        self.extra_rules = 0  # rules a repetition makes beyond the one that stands for them
        self.copies: dict[int, int] = {}  # such a rule: how many it stands for
        self.elements = 0
        self.nesting = 0

    def fail(self, what: str, pos: int) -> InvalidGrammar:
        line = self.text.count("\n", 0, pos) + 1
        column = pos - (self.text.rfind("\n", 0, pos) + 1) + 1
        return InvalidGrammar(f"not a grammar llama.cpp can parse: {what} at line {line}, column {column}")

    def symbol_id(self, name: str) -> int:
        sid = self.ids.get(name)
        if sid is None:
            sid = self.ids[name] = len(self.names)
            self.names.append(name)
            self.check_rules()
        return sid

    def rule_count(self) -> int:
        """Rules llama.cpp would make so far (its symbol ids)."""
        return len(self.names) + self.extra_rules

    def check_rules(self) -> None:
        if self.rule_count() > MAX_GRAMMAR_RULES:
            raise GrammarTooLarge("the number of rules the grammar expands to", self.rule_count(),
                                  MAX_GRAMMAR_RULES, "use fewer or smaller repetitions ({m,n}, or a schema's "
                                  "maxLength and maxItems) and groups")

    def new_rule(self, base: str) -> int:
        """A rule llama.cpp generates (a group, a repetition): named after its rule, never referenced by name."""
        self.names.append(base)
        self.check_rules()
        return len(self.names) - 1

    def add_elements(self, n: int) -> None:
        self.elements += n
        if self.elements > MAX_GRAMMAR_ELEMENTS:
            raise GrammarTooLarge("the number of elements the grammar expands to", self.elements,
                                  MAX_GRAMMAR_ELEMENTS, "use fewer or smaller repetitions ({m,n}, or a schema's "
                                  "maxLength and maxItems) and literals")

    def measure(self) -> GrammarSize:
        text = self.text
        pos = _SPACE_NL.match(text, 0).end()
        while pos < len(text):
            pos = self.rule(pos)
        missing = next((n for i, n in enumerate(self.names) if i not in self.rules), None)
        if missing is not None:
            raise InvalidGrammar(f"not a grammar llama.cpp can parse: rule '{missing}' is used but never defined")
        if "root" not in self.ids:
            raise InvalidGrammar("not a grammar llama.cpp can parse: it has no 'root' rule")
        left_depth, width = self.shape()
        if left_depth > MAX_GRAMMAR_LEFT_DEPTH:
            raise GrammarTooLarge("the longest chain of rules that begin with another rule", left_depth,
                                  MAX_GRAMMAR_LEFT_DEPTH, "begin rules with text more often")
        if width > MAX_GRAMMAR_WIDTH:
            raise GrammarTooLarge("the number of alternatives open at one point of the grammar", width,
                                  MAX_GRAMMAR_WIDTH, "use fewer alternatives within alternatives")
        return GrammarSize(len(text), self.rule_count(), self.elements, self.nesting, left_depth, width)

    def rule(self, pos: int) -> int:
        text = self.text
        m = _NAME.match(text, pos)
        if m is None:
            raise self.fail("expecting a rule name", pos)
        name = m.group(0)
        pos = _SPACE.match(text, m.end()).end()
        if not text.startswith("::=", pos):
            raise self.fail("expecting ::=", pos)
        pos = _SPACE_NL.match(text, pos + 3).end()
        pos = self.alternates(pos, name, self.symbol_id(name))
        if text.startswith("\r\n", pos):
            pos += 2
        elif pos < len(text) and text[pos] in "\r\n":
            pos += 1
        elif pos < len(text):
            raise self.fail("expecting a newline or the end", pos)
        return _SPACE_NL.match(text, pos).end()

    def alternates(self, pos: int, name: str, rule: int) -> int:
        """Read one rule's alternatives, groups included (without recursion: groups may nest 2000 deep)."""
        text = self.text
        open_: list[_Sequence] = [_Sequence(rule, nested=False)]
        s = open_[0]
        while True:
            m = _SYMBOL.match(text, pos)
            kind = m.lastgroup if m is not None else None
            if kind == "nl" and s.nested:
                pos = m.end()
                continue
            if kind is None or kind == "nl" or (kind == "op" and m.group("op") == ")"):
                # The end of this rule's alternatives (or of a group's).
                s.next_alternative()
                self.add_elements(1)
                self.rules[s.rule] = s.alts
                if not s.nested:
                    return pos
                if kind != "op":
                    if pos < len(text) and not text[pos].isspace():
                        raise self.fail(f"unexpected {text[pos]!r}", pos)
                    raise self.fail("expecting ')'", pos)
                open_.pop()
                parent = open_[-1]
                parent.symbol(s.rule, 1)
                # llama.cpp's n_prev_rules of a group: every symbol the group made (itself included).
                parent.prev_rules = max(1, self.rule_count() - s.ids_before)
                self.add_elements(1)
                s = parent
                pos = m.end()
                continue
            pos = m.end()
            if kind == "lit":
                body = m.group("lit")
                n = len(_ONE_ESCAPE.sub("e", body)) if "\\" in body else len(body)
                if n:
                    s.symbol(_TERMINAL, n)
                else:
                    s.last = None  # llama.cpp: "" leaves nothing for a repetition to apply to
                self.add_elements(n)
            elif kind == "cls":
                body = m.group("cls")
                n = max(1, len(_ONE_ESCAPE.sub("e", body)) if "\\" in body else len(body))
                s.symbol(_TERMINAL, n)
                self.add_elements(n)
            elif kind == "tok":
                s.symbol(_TERMINAL, 1)
                self.add_elements(1)
            elif kind == "name":
                s.symbol(self.symbol_id(m.group("name")), 1)
                self.add_elements(1)
            elif kind in ("low", "comma", "high"):  # lastgroup is the repetition's last group that matched
                low = _number(m.group("low"))
                high = (_number(m.group("high")) if m.group("high") else None) if m.group("comma") else low
                self.repeat(s, name, (low, high), m.start())
            else:
                op = m.group("op")
                if op == "(":
                    pos = _SPACE_NL.match(text, pos).end()
                    before = self.rule_count()
                    s = _Sequence(self.new_rule(name), nested=True, ids_before=before)
                    open_.append(s)
                    self.nesting = max(self.nesting, len(open_) - 1)
                    if self.nesting > MAX_GRAMMAR_NESTING:
                        raise GrammarTooLarge("the nesting of parentheses", self.nesting, MAX_GRAMMAR_NESTING,
                                              "use named rules instead of groups within groups")
                elif op == ".":
                    s.symbol(_TERMINAL, 1)
                    self.add_elements(1)
                elif op == "|":
                    s.next_alternative()
                    self.add_elements(1)
                    pos = _SPACE_NL.match(text, pos).end()
                else:
                    self.repeat(s, name, _REPEATS[op], m.start())

    def repeat(self, s: _Sequence, name: str, counts: tuple[int, int | None], pos: int) -> None:
        """Apply S{m,n} to the last symbol as llama.cpp rewrites it: S m times, then n-m rules S'(k) ::= S S'(k-1) |."""
        low, high = counts
        if s.last is None:
            raise self.fail("a repetition with nothing before it", pos)
        if high is not None and high < low:
            # llama.cpp loops without end on this (its count of optional copies wraps around).
            raise self.fail(f"the repetition {{{low},{high}}} has its minimum above its maximum", pos)
        biggest = max(low, high or 0)
        if biggest > LLAMA_MAX_REPETITIONS:
            raise GrammarTooLarge("a repetition count", biggest, LLAMA_MAX_REPETITIONS,
                                  "llama.cpp refuses (or silently drops) larger ones")
        total = high if high else (low or 1)
        # The pinned llama.cpp refuses a product over 2000 (later ones 2000 too: the converter's
        # maxLength 1000, which makes exactly 2000, parses here).
        if s.prev_rules * total > LLAMA_MAX_REPETITIONS:
            raise GrammarTooLarge("a repetition's count times the rules it repeats", s.prev_rules * total,
                                  LLAMA_MAX_REPETITIONS, "llama.cpp refuses more; repeat a smaller item")
        prev = s.seq[s.last:]
        elements = s.last_elements
        if low == 0:
            del s.seq[s.last:]
        else:
            self.add_elements(elements * (low - 1))
            s.seq.extend(prev * (low - 1))
        optional = 1 if high is None else high - low
        if optional:
            # llama.cpp makes `optional` rules S'(k) ::= S S'(k-1) | (one, S' ::= S S' |, when
            # unbounded); they are measured alike, so one stands for all: counted `optional` times,
            # and opening `optional` times S's alternatives at once when S may match nothing.
            rid = self.new_rule(name)
            self.extra_rules += optional - 1
            self.copies[rid] = optional
            self.rules[rid] = [prev + [rid], []]
            self.add_elements(optional * (elements + 3))
            self.check_rules()
            s.seq.append(rid)
            self.add_elements(1)
        s.last_elements = elements * low + (1 if optional else 0)
        s.prev_rules *= total

    def shape(self) -> tuple[int, int]:
        """(stack depth, width) of the rules' beginnings, as llama.cpp's advance_stack expands them.

        Depth: a rule beginning with another rule that is followed by more pushes that rest on the
        stack, a level per link of such a chain. Width: the stacks one position expands to (each
        alternative, through rules that may match nothing), which llama.cpp compares pairwise on
        every accepted token.
        """
        n = len(self.names)
        rules = self.rules
        nullable = self.nullable()
        first: list[list[int]] = [[] for _ in range(n)]
        for rule, alts in rules.items():
            edges = first[rule]
            for alt in alts:
                for sym in alt:
                    if sym == _TERMINAL:
                        break
                    edges.append(sym)
                    if not nullable[sym]:
                        break
        # Depth first without recursion; an edge back into the path (left recursion, which llama.cpp
        # refuses by itself) adds nothing.
        depth = [0] * n
        fan = [0] * n
        state = [0] * n  # 0 unseen, 1 on the path, 2 done
        cap = MAX_GRAMMAR_WIDTH + 1
        for start in range(n):
            if state[start]:
                continue
            state[start] = 1
            path = [start]
            cursor = [0]
            while path:
                rule = path[-1]
                edges = first[rule]
                i = cursor[-1]
                if i < len(edges):
                    cursor[-1] = i + 1
                    nxt = edges[i]
                    if state[nxt] == 0:
                        state[nxt] = 1
                        path.append(nxt)
                        cursor.append(0)
                    continue
                d = f = 0
                repeated_empty = False  # a repetition of something that may match nothing
                for alt in rules.get(rule, ()):
                    last = len(alt) - 1
                    for j, sym in enumerate(alt):
                        if sym == _TERMINAL:
                            f += 1
                            break
                        if sym == rule:
                            repeated_empty = True
                        elif state[sym] == 2:
                            here = depth[sym] + (j < last)
                            if here > d:
                                d = here
                            f += fan[sym]
                        if not nullable[sym]:
                            break
                if repeated_empty:
                    f *= self.copies.get(rule, 1)
                depth[rule] = d
                fan[rule] = f if f < cap else cap
                state[rule] = 2
                path.pop()
                cursor.pop()
        width = max(fan, default=0)  # a rule's beginning (the root's is where sampling starts)
        for alts in rules.values():
            for alt in alts:
                # Every position inside an alternative is a beginning too.
                after = 0
                for sym in reversed(alt):
                    after = 1 if sym == _TERMINAL else fan[sym] + (after if nullable[sym] else 0)
                    if after > width:
                        width = after
        return max(depth, default=0), width

    def nullable(self) -> list[bool]:
        """Which rules may match nothing (a fixpoint, counting down each alternative's symbols not yet known to)."""
        nullable = [False] * len(self.names)
        owner: list[int] = []  # per alternative without a terminal: its rule
        waiting: list[int] = []  # and how many of its symbols are not known to match nothing
        uses: dict[int, list[int]] = defaultdict(list)
        ready: list[int] = []
        for rule, alts in self.rules.items():
            for alt in alts:
                if not alt:
                    if not nullable[rule]:
                        nullable[rule] = True
                        ready.append(rule)
                elif _TERMINAL not in alt:
                    k = len(owner)
                    owner.append(rule)
                    waiting.append(len(alt))
                    for sym in alt:
                        uses[sym].append(k)
        while ready:
            for k in uses.get(ready.pop(), ()):
                waiting[k] -= 1
                if waiting[k] == 0 and not nullable[owner[k]]:
                    nullable[owner[k]] = True
                    ready.append(owner[k])
        return nullable
