"""The one JSON body reader of every route (gateway and runner, every API): a body is read once, here, with the
limits no caller needs beyond and Python's json module does not set, and every failure is an ApiError 400
saying what to fix (each blueprint answers it in its API's shape).

Without them, a 100,000-deep body was a RecursionError in json.loads, a 5,000-digit integer the int-digit
ValueError (Python refuses to convert over 4,300 digits), and both a 500 with a traceback.
"""

from __future__ import annotations

import json

from app.protocols.errors import ApiError

# The deepest nesting a body may have: a chat request with tools and a JSON schema nests about 12 deep; a
# schema's own nesting is bounded again, more tightly, by app.schema_subset.
MAX_DEPTH = 64
# The longest number literal a body may hold (digits, sign, point, exponent): a 64-bit seed is 20 characters.
MAX_NUMBER_CHARS = 100


def _number(kind):
    def parse(text: str):
        if len(text) > MAX_NUMBER_CHARS:
            raise ApiError(400, f"the request body holds a number of {len(text):,} characters; numbers may have at "
                                f"most {MAX_NUMBER_CHARS}", code="invalid_json")
        return kind(text)
    return parse


def _constant(name: str):
    raise ApiError(400, f"the request body holds {name}, which JSON does not allow; send a number or null",
                   code="invalid_json")


def _too_deep(data: object) -> bool:
    """Whether data nests arrays and objects deeper than MAX_DEPTH (walked without recursion)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            return True
        children = value.values() if isinstance(value, dict) else value
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


def _brackets(raw: bytes) -> int:
    return raw.count(b"[") + raw.count(b"{")


def load_json(raw: bytes) -> object:
    """The JSON value of a request body; a 400 for bytes that are not UTF-8, not JSON, nested too deeply or
    holding numbers too long or NaN/Infinity."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {exc.start})", code="invalid_utf8")
    too_deep = ApiError(400, f"the request body nests arrays and objects more than {MAX_DEPTH} deep; flatten it",
                        code="invalid_json")
    try:
        data = json.loads(text, parse_int=_number(int), parse_float=_number(float), parse_constant=_constant)
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
                       code="invalid_json")
    except RecursionError:
        raise too_deep
    # Brackets inside strings count too, so this only skips the walk for bodies that cannot be too deep.
    if _brackets(raw) > MAX_DEPTH and isinstance(data, dict | list) and _too_deep(data):
        raise too_deep
    return data


def load_object(raw: bytes, empty_is_object: bool = False) -> dict:
    """A request body's JSON object (load_json's checks); empty_is_object reads an empty body as {} (Ollama)."""
    if empty_is_object and not raw.strip():
        return {}
    data = load_json(raw)
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return data
