"""gpt-oss's harmony messages: `<|channel|>analysis` thoughts, `final` content, `commentary to=functions.X` calls.

The prompt ends with `<|start|>assistant`, so the answer starts with a header (`<|channel|>...`,
or ` to=functions.X<|channel|>...`), then `<|message|>` and the body up to `<|end|>`, `<|call|>`,
`<|return|>` or the next message's `<|start|>`. A call names its tool in the header (in the role
part or the channel part); a recipient that is not a function (`container.exec`, `python`) is not
ours to run and its message is dropped, as llama-server does.
"""

from __future__ import annotations

import re

from app.engine.formats.base import Tools, first_marker, held_prefix, make_call

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_BODY_ENDS = (*ENDS, START, CHANNEL)
_OPENERS = (START, CHANNEL)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_MAX_HEADER = 512

_OUTSIDE, _HEADER, _BODY = 0, 1, 2
THOUGHT, CONTENT, CALL, DROPPED = "analysis", "final", "call", "dropped"


class HarmonyScanner:
    """Harmony text into ("r", thought), ("c", content) and ("call", Call) events, streamed."""

    __slots__ = ("tools", "split", "state", "held", "header", "kind", "name", "body", "out", "at_start")

    def __init__(self, tools: Tools, *, split: bool, in_thought: bool):
        self.tools, self.split = tools, split
        self.state = _BODY if in_thought else _OUTSIDE
        self.kind = THOUGHT if in_thought else CONTENT
        self.held = ""
        self.header = CHANNEL + "analysis" if in_thought else ""
        self.name = ""
        self.body: list[str] = []
        self.out: list = []
        self.at_start = not in_thought

    def push(self, text: str) -> list:
        """Events for this chunk."""
        self.out = []
        text, self.held = self.held + text, ""
        self._scan(text)
        return self.out

    def finish(self) -> list:
        """Events for what is held at the end: a cut thought stays thought, a cut call is content."""
        self.out = []
        text, self.held = self.held, ""
        if self.state == _BODY:
            self._emit_body(text)
            self._end_message("")
        elif self.state == _OUTSIDE and text:
            self._event("c", text)
        return self.out

    def _event(self, kind: str, text: str) -> None:
        if self.out and self.out[-1][0] == kind:
            self.out[-1] = (kind, self.out[-1][1] + text)
        else:
            self.out.append((kind, text))

    def _scan(self, text: str) -> None:
        while text:
            if self.state == _OUTSIDE:
                text = self._outside(text)
            elif self.state == _HEADER:
                text = self._header(text)
            else:
                text = self._body(text)

    def _outside(self, text: str) -> str:
        if self.at_start:
            lead = text.lstrip()
            if "to=".startswith(lead):  # a recipient in the role header may open the answer
                self.held = text
                return ""
            self.at_start = False
            if lead.startswith("to="):
                self.state, self.header = _HEADER, ""
                return lead
        at, _ = first_marker(text, _OPENERS)
        if at == -1:
            hold = held_prefix(text, _OPENERS)
            if len(text) > hold:
                self._event("c", text[: len(text) - hold])
            self.held = text[len(text) - hold:]
            return ""
        if at:
            self._event("c", text[:at])
        self.state, self.header = _HEADER, ""
        return text[at:]

    def _header(self, text: str) -> str:
        text = self.header + text
        at = text.find(MESSAGE)
        if at == -1:
            if len(text) > _MAX_HEADER:  # not a header after all
                self.state, self.header = _OUTSIDE, ""
                self._event("c", text)
            else:
                self.header = text
            return ""
        self._open_message(text[:at])
        return text[at + len(MESSAGE):]

    def _open_message(self, header: str) -> None:
        self.header, self.body, self.state = header, [], _BODY
        recipients = [r for r in _RECIPIENT.findall(header) if r != "assistant"]
        channels = _CHANNEL_NAME.findall(header)
        channel = channels[-1] if channels else ""
        if recipients:
            recipient = recipients[-1]
            is_function = recipient.startswith("functions.") and self.tools
            self.kind, self.name = (CALL, recipient[len("functions."):]) if is_function else (DROPPED, "")
        else:
            self.kind = THOUGHT if channel == "analysis" else CONTENT
            if self.kind == THOUGHT and not self.split:
                self._event("c", CHANNEL + "analysis" + MESSAGE)

    def _body(self, text: str) -> str:
        at, marker = first_marker(text, _BODY_ENDS)
        if at == -1:
            hold = held_prefix(text, _BODY_ENDS)
            self._emit_body(text[: len(text) - hold])
            self.held = text[len(text) - hold:]
            return ""
        self._emit_body(text[:at])
        self._end_message(marker if marker in ENDS else "")
        return text[at + len(marker):] if marker in ENDS else text[at:]

    def _emit_body(self, text: str) -> None:
        if not text:
            return
        if self.kind == THOUGHT:
            self._event("r" if self.split else "c", text)
        elif self.kind == CONTENT:
            self._event("c", text)
        elif self.kind == CALL:
            self.body.append(text)

    def _end_message(self, marker: str) -> None:
        if self.kind == CALL:
            body = "".join(self.body)
            call = make_call(self.tools, self.name, body.strip() or "{}") if marker != "" or body.strip() else None
            if call is not None:
                self.out.append(("call", call))
            else:
                self._event("c", self.header + MESSAGE + body + marker)
        elif self.kind == THOUGHT and not self.split:
            self._event("c", marker or "")
        self.state, self.kind, self.body, self.header = _OUTSIDE, CONTENT, [], ""
        self.at_start = False
