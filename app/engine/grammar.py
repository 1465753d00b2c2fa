"""Grammars for constrained decoding: JSON Schema → GBNF, JSON mode, tool-call envelopes.

The conversion is llama-cpp-python's own port of llama.cpp's json-schema-to-grammar (pure Python,
no model needed), run once per distinct schema and cached. Before converting, a schema is checked:
a keyword the converter would silently ignore (minimum, uniqueItems, ...) is refused by name, since
an answer "valid against the schema" that breaks it would be a lie, and so is one past a bound
(app.schema_subset). The conversion itself has a budget: it stops as soon as its output passes
MAX_GENERATED_GRAMMAR_CHARS, and what it made is measured as llama.cpp would build it (check_gbnf)
before anyone parses it. The result is a `Grammar`, the value the engine's sampler is built from;
llama.cpp parses it (and the model layer caches that too, by size).
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from app.schema_subset import (
    RANGE_LITERAL,
    GrammarTooLarge,
    InvalidGrammar,
    SchemaTooLarge,
    UnsupportedSchema,
    check_gbnf,
    normalise_schema,
)

__all__ = ["Grammar", "GrammarTooLarge", "InvalidGrammar", "SchemaTooLarge", "UnsupportedSchema", "client_grammar",
           "integer_range_rule", "json_object_grammar", "llama_pattern", "normalise_schema", "schema_grammar",
           "tool_call_grammar"]

# Arrays in tool-call arguments without maxItems get this bound: a small model copying an enum from
# the prompt would otherwise list every value until max_tokens and never close the call.
MAX_CALL_ARRAY_ITEMS = 4
# Likewise for parallel calls: a household request rarely needs more, a small model may not stop.
MAX_PARALLEL_CALLS = 3
# The converter's output: a schema at OpenAI's 5000 properties (all required) makes about 330 KB.
# llama.cpp parses this much in tens of milliseconds; converting and measuring it (check_gbnf) take
# up to 0.6 s on a busy 2-core machine (`hearth bench hostile`), under a third of the 2 s target.
MAX_GENERATED_GRAMMAR_CHARS = 384 << 10
# Converted grammars (and refusals) kept, by count and by characters of keys and grammars together:
# without the second, 256 grammars of a megabyte each would be a quarter of a gigabyte.
MAX_CACHED_GRAMMARS = 256
MAX_CACHED_GRAMMAR_CHARS = 16 << 20


# JSON forbids raw control characters inside strings; the converter's `char` rule allows them.
_JSON_CHAR = r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'
# At most one space between tokens: a small model given free whitespace can fill max_tokens with it.
_SPACE = '" "?'


@dataclass(frozen=True)
class Grammar:
    """A GBNF grammar for one sequence's sampler; lazy ones engage when a trigger appears in the output."""

    gbnf: str
    root: str = "root"
    lazy: bool = False
    # Regexes matched against the whole output so far (llama.cpp's lazy grammar); the grammar
    # constrains from the first capturing group on.
    trigger_patterns: tuple[str, ...] = ()
    trigger_tokens: tuple[int, ...] = ()
    kind: str = "json_schema"  # json_schema | json_object | tools | grammar, for logs and counters
    # What llama.cpp builds from it (check_gbnf's count): the model layer's cache of parsed grammars is bounded by it.
    elements: int = 0


def _same_length(a: str, b: str) -> list[str]:
    """GBNF alternatives for the integers a..b written with the same number of digits."""
    if a == b:
        return [" ".join(f'"{c}"' for c in a)]
    if len(a) == 1:
        return [f"[{a}-{b}]"]
    tail = len(a) - 1
    if a[1:] == "0" * tail and b[1:] == "9" * tail:
        return [f"[{a[0]}-{b[0]}]" + " [0-9]" * tail]
    if a[0] == b[0]:
        return [f'"{a[0]}" {x}' for x in _same_length(a[1:], b[1:])]
    out = [f'"{a[0]}" {x}' for x in _same_length(a[1:], "9" * tail)]
    if int(b[0]) - int(a[0]) > 1:
        out.append(f"[{int(a[0]) + 1}-{int(b[0]) - 1}]" + " [0-9]" * tail)
    out += [f'"{b[0]}" {x}' for x in _same_length("0" * tail, b[1:])]
    return out


def _non_negative_range(low: int, high: int) -> list[str]:
    out = []
    for digits in range(len(str(low)), len(str(high)) + 1):
        a = max(low, 10 ** (digits - 1) if digits > 1 else 0)
        b = min(high, 10**digits - 1)
        if a <= b:
            out += _same_length(str(a), str(b))
    return out


def integer_range_rule(low: int, high: int) -> str:
    """A GBNF expression matching exactly the integers low..high in JSON (no leading zeros)."""
    alternatives = []
    if low < 0:
        alternatives += [f'"-" {x}' for x in _non_negative_range(max(1, -high), -low)]
    if high >= 0:
        alternatives += _non_negative_range(max(0, low), high)
    return "(" + " | ".join(alternatives) + ")"


def _bound_arrays(schema):
    """A copy of schema whose arrays without maxItems hold at most MAX_CALL_ARRAY_ITEMS."""
    if isinstance(schema, list):
        return [_bound_arrays(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _bound_arrays(v) if k not in ("enum", "const") else v for k, v in schema.items()}
    if out.get("type") == "array" and "maxItems" not in out and "prefixItems" not in out:
        out["maxItems"] = max(MAX_CALL_ARRAY_ITEMS, out.get("minItems", 0))
    return out


def _too_long(chars: int) -> GrammarTooLarge:
    return GrammarTooLarge("the grammar converted from the schema, in characters, already", chars,
                           MAX_GENERATED_GRAMMAR_CHARS, "use a smaller schema (fewer properties, shorter limits)")


@functools.cache
def _converter_class():
    # Imported here: the gateway validates schemas with this module and never loads llama.cpp.
    from llama_cpp.llama_grammar import SchemaConverter

    class BoundedConverter(SchemaConverter):
        """llama-cpp-python's converter with a budget on what it writes, and a linear object rule."""

        chars = 0

        def _add_rule(self, name, rule):
            key = super()._add_rule(name, rule)
            if self._counted.get(key) is not rule:
                self._counted[key] = rule
                self.chars += len(key) + len(rule) + 5
                if self.chars > MAX_GENERATED_GRAMMAR_CHARS:
                    raise _too_long(self.chars)
            return key

        def _build_object_rule(self, properties, required, name, additional_properties):
            return _object_rule(self, properties, required, name, additional_properties)

        def _visit_pattern(self, pattern, name):
            return super()._visit_pattern(llama_pattern(pattern), name)

    return BoundedConverter


# Class escapes as GBNF character-class contents; the converter copies a regex's escapes into GBNF,
# where llama.cpp knows only \x.. \u.... \t \r \n and a few more, and refuses the grammar.
_CLASS_ESCAPES = {"d": "0-9", "w": "a-zA-Z0-9_", "s": " \\t\\n\\r\\x0B\\x0C"}
# Punctuation the converter itself unescapes, and what a GBNF literal escapes the same way.
_KEPT_ESCAPES = set('[]()|{}*+?"\\')


def llama_pattern(pattern: str) -> str:
    """A regex with the escapes llama.cpp's GBNF lacks written as classes: \\d, \\w, \\s (and negations), \\. etc.

    Anything else after a backslash (\\b, a letter) is left for llama.cpp to refuse, as before.
    """
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        nxt = pattern[i + 1] if i + 1 < len(pattern) else ""
        if c == "\\" and nxt:
            low = nxt.lower()
            if low in _CLASS_ESCAPES and not (in_class and nxt.isupper()):
                body = _CLASS_ESCAPES[low]
                out.append(body if in_class else f"[{'^' if nxt.isupper() else ''}{body}]")
            elif not nxt.isalnum() and ord(nxt) < 128 and (in_class or nxt not in _KEPT_ESCAPES):
                hexed = f"\\x{ord(nxt):02X}"
                out.append(hexed if in_class else f"[{hexed}]")
            else:
                out.append(c + nxt)
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
        elif c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


def _converter():
    converter = _converter_class()(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    converter._counted = {}
    return converter


def _object_rule(converter, properties, required, name: str, additional_properties) -> str:
    """An object's rule as the converter writes it, each optional property's continuation made once.

    The converter's own rebuilds the chain of optional properties after each of them (quadratic in
    their number: 900 optional properties took 1.8 s); this builds the same rules from the last one back.
    """
    prefix = f"{name}-" if name else ""
    kv = {}
    for prop_name, prop_schema in properties:
        value = converter.visit(prop_schema, f"{prefix}{prop_name}")
        kv[prop_name] = converter._add_rule(
            f"{prefix}{prop_name}-kv", f'{converter._format_literal(json.dumps(prop_name))} space ":" space {value}')
    names = [p for p, _ in properties]
    required_kvs = [kv[p] for p in names if p in required]
    optional = [p for p in names if p not in required]
    if additional_properties is True or isinstance(additional_properties, dict):
        value = converter.visit({} if additional_properties is True else additional_properties,
                                f"{prefix}additional-value")
        string = converter._add_primitive("string", _primitive("string"))
        kv["*"] = converter._add_rule(f"{prefix}additional-kv", f'{string} ":" space {value}')
        optional.append("*")
    rule = '"{" space ' + ' "," space '.join(required_kvs)
    if optional:
        # rest[i]: what may follow optional property i, itself optional and in order.
        rest: list[str | None] = [None] * len(optional)
        for i in range(len(optional) - 1, -1, -1):
            if i + 1 < len(optional):
                rest[i] = converter._add_rule(f"{prefix}{optional[i]}-rest", _link(converter, kv, optional, i + 1,
                                                                                    True, rest, prefix))
        alternatives = " | ".join(_link(converter, kv, optional, i, False, rest, prefix) for i in range(len(optional)))
        rule += " (" + (' "," space ( ' if required_kvs else "") + alternatives + (" )" if required_kvs else "") + " )?"
    return rule + ' "}" space'


def _link(converter, kv: dict, optional: list[str], i: int, first_is_optional: bool, rest: list, prefix: str) -> str:
    """Optional property i (itself optional when another came before) and the rule for what may follow it."""
    key = optional[i]
    if key == "*":
        text = converter._add_rule(f"{prefix}additional-kvs", f'{kv["*"]} ( "," space {kv["*"]} )*')
    elif first_is_optional:
        text = f'( "," space {kv[key]} )?'
    else:
        text = kv[key]
    return text + (f" {rest[i]}" if rest[i] is not None else "")


def _primitive(name: str):
    from llama_cpp.llama_grammar import PRIMITIVE_RULES

    return PRIMITIVE_RULES[name]


def _finish(converter) -> str:
    rules = converter._rules
    rules["space"] = _SPACE
    if "char" in rules:
        rules["char"] = _JSON_CHAR
    text = converter.format_grammar()
    text = RANGE_LITERAL.sub(lambda m: integer_range_rule(int(m.group(1)), int(m.group(2))), text)
    if len(text) > MAX_GENERATED_GRAMMAR_CHARS:
        raise _too_long(len(text))
    return text


def _visit(converter, schema: dict, name: str) -> str:
    """Adds schema's rules to the converter; returns the name of its top rule."""
    try:
        return converter.visit(converter.resolve_refs(schema, "input"), name)
    except (AssertionError, KeyError, ValueError, TypeError, AttributeError, RecursionError) as exc:
        if isinstance(exc, GrammarTooLarge):
            raise
        raise UnsupportedSchema(f"not convertible ({type(exc).__name__}: {exc})", name) from exc


def _bounded_cache(fn: Callable[..., tuple[str, int]]) -> Callable[..., tuple[str, int]]:
    """fn's answers (grammar texts, or the refusal it raised) kept by MAX_CACHED_GRAMMARS and MAX_CACHED_GRAMMAR_CHARS.

    A refusal is kept too: the same hostile body sent again costs a lookup, not another conversion.
    """
    entries: OrderedDict[tuple, tuple[tuple[str, int] | Exception, int]] = OrderedDict()
    lock = threading.Lock()
    total = [0]

    @functools.wraps(fn)
    def cached(*key: str):
        with lock:
            hit = entries.get(key)
            if hit is not None:
                entries.move_to_end(key)
        if hit is None:
            try:
                value: tuple[str, int] | Exception = fn(*key)
            except (UnsupportedSchema, GrammarTooLarge, InvalidGrammar) as exc:
                value = exc
            size = sum(len(k) for k in key) + (256 if isinstance(value, Exception) else len(value[0]))
            with lock:
                if key not in entries and size <= MAX_CACHED_GRAMMAR_CHARS:
                    entries[key] = (value, size)
                    total[0] += size
                    while len(entries) > MAX_CACHED_GRAMMARS or total[0] > MAX_CACHED_GRAMMAR_CHARS:
                        total[0] -= entries.popitem(last=False)[1][1]
            hit = (value, size)
        if isinstance(hit[0], Exception):
            # Raised afresh each time: a kept traceback would grow with every raise.
            raise hit[0].with_traceback(None) from None
        return hit[0]

    def cache_clear() -> None:
        with lock:
            entries.clear()
            total[0] = 0

    def cache_chars() -> int:
        return total[0]

    cached.cache_clear = cache_clear
    cached.cache_chars = cache_chars
    return cached


@_bounded_cache
def _schema_gbnf(canonical: str) -> tuple[str, int]:
    converter = _converter()
    _visit(converter, json.loads(canonical), "")
    return _checked(_finish(converter))


def _checked(text: str) -> tuple[str, int]:
    """A converted grammar and the elements llama.cpp will build from it, once check_gbnf has measured it."""
    return text, check_gbnf(text, max_chars=MAX_GENERATED_GRAMMAR_CHARS).elements


def schema_grammar(schema: dict) -> Grammar:
    """The grammar of JSON values valid against schema (cached per schema); raises UnsupportedSchema or GrammarTooLarge."""
    normalised = normalise_schema(schema)
    return _sized(_schema_gbnf(json.dumps(normalised)), "json_schema")


def json_object_grammar() -> Grammar:
    """Any JSON object (OpenAI's JSON mode)."""
    return _sized(_schema_gbnf(json.dumps({"type": "object"})), "json_object")


def client_grammar(gbnf: str) -> Grammar:
    """A client's own GBNF text (llama-server's `grammar`), measured first; raises GrammarTooLarge or InvalidGrammar."""
    return Grammar(gbnf, root="root", kind="grammar", elements=check_gbnf(gbnf).elements)


def _sized(converted: tuple[str, int], kind: str, **extra) -> Grammar:
    return Grammar(converted[0], kind=kind, elements=converted[1], **extra)


@_bounded_cache
def _calls_gbnf(canonical: str, wrapper: str) -> tuple[str, int]:
    spec = json.loads(canonical)
    converter = _converter()
    alternatives = []
    for i, (name, parameters) in enumerate(spec["tools"]):
        args = _visit(converter, parameters, f"tool{i}-args")
        key = spec["args_key"]
        alternatives.append(converter._add_rule(
            f"tool{i}-call",
            rf'"{{" space "\"name\"" space ":" space {converter._format_literal(json.dumps(name))} space "," space '
            rf'"\"{key}\"" space ":" space {args} "}}" space'))
    converter._add_rule("call", " | ".join(alternatives))

    def more(separator: str) -> str:
        return f" ({separator}){{0,{MAX_PARALLEL_CALLS - 1}}}" if spec["parallel"] else ""

    calls = "call" + more('"," space call')
    if wrapper == "generic":
        root = rf'"{{" space "\"tool_calls\"" space ":" space "[" space {calls} "]" space "}}" space'
    elif wrapper == "hermes":
        one = r'"<tool_call>" "\n"? space call "\n"? "</tool_call>" "\n"?'
        root = one + more(one)
    elif wrapper == "mistral":
        root = f'"[TOOL_CALLS]" space "[" space {calls} "]"'
    else:  # llama3: one bare JSON object per call, `;`-separated
        root = "call" + more('";" space call')
    converter._rules["root"] = root
    return _checked(_finish(converter))


def tool_call_grammar(tools: list[tuple[str, dict]], wrapper: str, parallel: bool, args_key: str = "arguments",
                      lazy: bool = False, trigger_patterns: tuple[str, ...] = (),
                      trigger_tokens: tuple[int, ...] = ()) -> Grammar:
    """A grammar admitting only calls to these (name, parameters schema) tools in a format's envelope."""
    checked = [(name, _bound_arrays(normalise_schema(params or {"type": "object"}, f"tools[{name}].parameters")))
               for name, params in tools]
    # An empty parameters schema means "no arguments" in OpenAI's tool format, not "anything".
    checked = [(n, p if p else {"type": "object"}) for n, p in checked]
    canonical = json.dumps({"tools": checked, "parallel": parallel, "args_key": args_key})
    return _sized(_calls_gbnf(canonical, wrapper), "tools", lazy=lazy, trigger_patterns=trigger_patterns,
                  trigger_tokens=trigger_tokens)


# -- calls laid out in a family's own syntax (app.engine.formats.grammars) ----------------------------

@dataclass(frozen=True)
class CallLayout:
    """How one family writes calls, as GBNF around each tool's name and arguments.

    `calls` maps a rule name to its body for one tool, in which `{name}` is the tool's name as a
    GBNF literal, `{name_json}` the same as a JSON string, `{args}` its arguments' rule (a JSON
    object), `{params}` its parameters as XML elements (Qwen3-Coder) and `{gemma}` its arguments
    in Gemma 4's dict syntax. Each rule becomes the
    alternatives over the tools. `rules` are further rules (a thought, separators); `root`
    combines them.
    """

    calls: tuple[tuple[str, str], ...]
    root: str
    rules: tuple[tuple[str, str], ...] = ()


# Text of an XML parameter or a thought: anything but a "<" that starts a closing tag.
XML_TEXT = r'( [^<] | "<" [^/] )*'


def _xml_value(converter, schema: dict, name: str) -> str:
    """A parameter's value as Qwen3-Coder writes it: a string raw, an enum one of its values, else JSON."""
    kind = schema.get("type")
    if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        return "(" + " | ".join(converter._format_literal(v) for v in schema["enum"]) + ")"
    if kind == "string" and not ({"pattern", "format", "const", "minLength", "maxLength"} & set(schema)):
        return "xml-text"
    return _visit(converter, schema, name)


def _xml_parameters(converter, parameters: dict, prefix: str) -> str:
    """The `<parameter=P>\\nVALUE\\n</parameter>\\n` elements of one tool: required ones always, in schema order."""
    required = set(parameters.get("required") or ())
    parts = []
    for j, (name, schema) in enumerate((parameters.get("properties") or {}).items()):
        value = _xml_value(converter, schema if isinstance(schema, dict) else {}, f"{prefix}-p{j}")
        item = rf'"<parameter=" {converter._format_literal(name)} ">\n" {value} "\n</parameter>\n"'
        parts.append(item if name in required else f"( {item} )?")
    return converter._add_rule(f"{prefix}-params", " ".join(parts) if parts else '""')


# Gemma 4's dict syntax: bare keys, strings between <|"|> quotes, JSON's numbers, booleans and null.
GEMMA_RULES = {
    "gemma-value": "gemma-string | gemma-number | \"true\" | \"false\" | \"null\" | gemma-object | gemma-array",
    "gemma-string": r'"<|\"|>" ( [^<] | "<" [^|] )* "<|\"|>"',
    "gemma-number": '"-"? [0-9]+ ("." [0-9]+)? ([eE] [-+]? [0-9]+)?',
    "gemma-key": "[A-Za-z_] [A-Za-z0-9_-]*",
    "gemma-object": '"{" ( gemma-key ":" gemma-value ( "," gemma-key ":" gemma-value )* )? "}"',
    "gemma-array": '"[" ( gemma-value ( "," gemma-value )* )? "]"',
}
_GEMMA_BY_TYPE = {"string": "gemma-string", "integer": "gemma-number", "number": "gemma-number",
                  "boolean": '( "true" | "false" )', "null": '"null"', "array": "gemma-array", "object": "gemma-object"}


def _gemma_value(converter, schema: dict) -> str:
    """A value in Gemma 4's dict syntax, typed by the schema's type (its inner structure left free)."""
    if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        return r'"<|\"|>" (' + " | ".join(converter._format_literal(v) for v in schema["enum"]) + r') "<|\"|>"'
    kind = schema.get("type")
    return _GEMMA_BY_TYPE.get(kind, "gemma-value") if isinstance(kind, str) else "gemma-value"


def _gemma_arguments(converter, parameters: dict, prefix: str) -> str:
    """One tool's `{key:value,...}`: its required properties first, in schema order, then any optional ones."""
    required = set(parameters.get("required") or ())
    items = {name: f"{converter._format_literal(name)} \":\" {_gemma_value(converter, schema or {})}"
             for name, schema in (parameters.get("properties") or {}).items()}
    needed = [item for name, item in items.items() if name in required]
    optional = [item for name, item in items.items() if name not in required]
    parts = ['"{"', ' "," '.join(needed)] if needed else ['"{"']
    if optional:
        any_optional = converter._add_rule(f"{prefix}-gemma-optional", " | ".join(optional))
        more = f'( "," {any_optional} )*'
        parts.append(more if needed else f"( {any_optional} {more} )?")
    parts.append('"}"')
    return converter._add_rule(f"{prefix}-gemma", " ".join(p for p in parts if p))


@_bounded_cache
def _layout_gbnf(canonical: str) -> tuple[str, int]:
    spec = json.loads(canonical)
    converter = _converter()
    uses_params = any("{params}" in body for _, body in spec["calls"])
    uses_gemma = any("{gemma}" in body for _, body in spec["calls"])
    alternatives: dict[str, list[str]] = {rule: [] for rule, _ in spec["calls"]}
    for i, (name, parameters) in enumerate(spec["tools"]):
        args = _visit(converter, parameters, f"tool{i}-args") if any("{args}" in b for _, b in spec["calls"]) else ""
        params = _xml_parameters(converter, parameters, f"tool{i}") if uses_params else ""
        gemma = _gemma_arguments(converter, parameters, f"tool{i}") if uses_gemma else ""
        for rule, body in spec["calls"]:
            text = (body.replace("{name_json}", converter._format_literal(json.dumps(name)))
                    .replace("{name}", converter._format_literal(name)).replace("{args}", args)
                    .replace("{params}", params).replace("{gemma}", gemma))
            alternatives[rule].append(converter._add_rule(f"tool{i}-{rule}", text))
    for rule, names in alternatives.items():
        converter._rules[rule] = " | ".join(names)
    for rule, body in spec["rules"]:
        converter._rules[rule] = body
    if uses_params:
        converter._rules["xml-text"] = XML_TEXT
    if uses_gemma:
        converter._rules.update(GEMMA_RULES)
    converter._rules["root"] = spec["root"]
    return _checked(_finish(converter))


def layout_grammar(tools: list[tuple[str, dict]], layout: CallLayout, *, lazy: bool = False,
                   trigger_patterns: tuple[str, ...] = (), trigger_tokens: tuple[int, ...] = ()) -> Grammar:
    """A grammar admitting only calls to these (name, parameters schema) tools, laid out as the family writes them."""
    checked = [(name, _bound_arrays(normalise_schema(params or {"type": "object"}, f"tools[{name}].parameters")))
               for name, params in tools]
    checked = [(n, p if p else {"type": "object"}) for n, p in checked]
    canonical = json.dumps({"tools": checked, "calls": layout.calls, "rules": layout.rules, "root": layout.root})
    return _sized(_layout_gbnf(canonical), "tools", lazy=lazy, trigger_patterns=trigger_patterns,
                  trigger_tokens=trigger_tokens)
