"""llama.cpp's built-in chat templates by name (`--chat-template chatml`, `llama3`, `command-r`, …).

llama-server takes such a name as well as Jinja text; the names are formatted by llama.cpp's own
`llama_chat_apply_template`, so a name renders here exactly as it does in the stock binary.
"""

from __future__ import annotations

import ctypes

from app.engine.chat import ChatTemplateError


def is_template_name(text: str) -> bool:
    """True for a bare template name rather than Jinja text."""
    return "{" not in text and "\n" not in text and len(text) <= 64


def _apply(name: str, messages: list[dict], add_generation_prompt: bool) -> str | None:
    import llama_cpp

    keep = [(str(m.get("role", "")).encode(), _text(m.get("content")).encode()) for m in messages]
    chat = (llama_cpp.llama_chat_message * len(keep))(*[llama_cpp.llama_chat_message(r, c) for r, c in keep])
    size = 4 * sum(len(r) + len(c) for r, c in keep) + 1024
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_chat_apply_template(name.encode(), chat, len(keep), add_generation_prompt, buf, size)
        if n < 0:
            return None
        if n <= size:
            return buf.raw[:n].decode("utf-8", "replace")
        size = n + 1
    return None


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


class NamedTemplate:
    """A llama.cpp built-in chat template, with the interface of app.engine.chat.ChatTemplate."""

    def __init__(self, name: str, bos_token: str, eos_token: str):
        if _apply(name, [{"role": "user", "content": "x"}], True) is None:
            raise ValueError(f"llama.cpp has no built-in chat template named {name!r}")
        self.name = name
        self.source = name
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.origin = f"llama.cpp:{name}"

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools=None, kwargs=None) -> str:
        """The prompt text of these messages (tools are described in the messages by the caller)."""
        normal = [{**m, "role": "system" if m.get("role") == "developer" else m.get("role")} for m in messages]
        text = _apply(self.name, normal, add_generation_prompt)
        if text is None:
            raise ChatTemplateError(f"llama.cpp's template {self.name!r} cannot render these messages")
        return text
