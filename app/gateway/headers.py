"""Hearth's own response headers (X-Hearth-Model, X-Hearth-Node): values any model file or node label can fill.

HTTP header values are bytes read as Latin-1, and gunicorn refuses anything else, so a model file
named in Cyrillic or CJK turned every answer it served into a 500. Characters outside printable
ASCII (and `%` itself) are percent-encoded as UTF-8, RFC 3986 style: an ASCII name reads as before,
and `urllib.parse.unquote` gives any name back.
"""

from __future__ import annotations

from urllib.parse import quote


def header_value(text: str) -> str:
    """`text` with every character outside printable ASCII, and `%`, percent-encoded (UTF-8)."""
    return "".join(c if " " <= c <= "~" and c != "%" else quote(c, safe="") for c in text)
