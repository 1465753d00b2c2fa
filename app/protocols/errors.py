"""The error every API answers in its own shape (OpenAI's here; app.protocols.ollama and .anthropic map it)."""

from __future__ import annotations

import re


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        err_type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
        extra: dict | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.err_type = err_type
        self.headers = headers or {}
        # llama-server's extra fields of some error types (exceed_context_size_error: n_prompt_tokens, n_ctx).
        self.extra = dict(extra or {})

    def body(self) -> dict:
        """The JSON body of the error response."""
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code,
                          **self.extra}}


# An absolute path (POSIX, or a Windows drive's): the file name is all a caller may see of it.
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~/:-])(?:[A-Za-z]:\\|/)(?:[^\s/\\'\":]+[/\\])*([^\s/\\'\":,;)]*)")
_TRACEBACK = "Traceback (most recent call last)"
PUBLIC_TEXT_CHARS = 500


def public_text(text: str) -> str:
    """An internal error's text as a caller may see it: a Python traceback reduced to its last line (the
    exception), absolute paths to their file names, control characters dropped, at most PUBLIC_TEXT_CHARS."""
    if _TRACEBACK in text:
        before, _, trace = text.partition(_TRACEBACK)
        last = next((line.strip() for line in reversed(trace.splitlines()) if line.strip()), "")
        text = " ".join(part for part in (before.strip(), last) if part)
    text = _ABSOLUTE_PATH.sub(lambda m: m.group(1) or "…", text)
    text = "".join(c if c.isprintable() else " " for c in text)
    return text if len(text) <= PUBLIC_TEXT_CHARS else text[:PUBLIC_TEXT_CHARS - 1] + "…"
