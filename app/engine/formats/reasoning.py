"""Splitting a streamed answer's thought from the rest, on a family's think markers.

As llama.cpp does: the thought opens only at the start of the answer (or in the prompt), its
text is trimmed, and the whitespace after its end marker is dropped. A call marker ends a thought
the prompt opened (Qwen3.5 may call a tool without closing it).
"""

from __future__ import annotations

from app.engine.formats.base import first_marker, held_prefix

_SPACE = " \t\n\r\v\f"  # what C's isspace calls whitespace, as llama.cpp trims

# What the splitter hands on: thought text, text for the call scanner, text that is content as it is.
THOUGHT, VISIBLE, VERBATIM = 0, 1, 2

_START, _THINK, _AFTER = 0, 1, 2


class ThinkSplitter:
    """Separates thought text from visible text, one pushed chunk at a time."""

    __slots__ = ("start", "end", "split", "closers", "state", "held", "thought_began", "after_end")

    def __init__(self, think_start: str, think_end: str, *, split: bool, in_thought: bool,
                 closers: tuple[str, ...] = ()):
        self.start, self.end, self.split = think_start, think_end, split
        # Markers that end a prompt-opened thought and belong to what follows (call markers).
        self.closers = closers if in_thought else ()
        self.state = _THINK if in_thought else (_START if think_start else _AFTER)
        self.held = ""
        self.thought_began = False  # leading whitespace of the thought is dropped until then
        self.after_end = False  # just past the end marker: its whitespace is dropped (verbatim when not split)
        if in_thought and not split:
            self.held = ""
            self.thought_began = True

    def push(self, text: str) -> list[tuple[int, str]]:
        """The parts of held + text that are decided now."""
        if self.state == _AFTER and not self.after_end:
            return [(VISIBLE, text)] if text else []
        text = self.held + text
        self.held = ""
        out: list[tuple[int, str]] = []
        if self.state == _START:
            text = self._opening(text, out)
        if self.state == _THINK:
            text = self._thought(text, out, final=False)
        if self.state == _AFTER and text:
            self._visible(text, out)
        return out

    def finish(self) -> list[tuple[int, str]]:
        """What is still held, decided: an unclosed thought stays thought."""
        text, self.held = self.held, ""
        out: list[tuple[int, str]] = []
        if self.state == _START:
            self.state = _AFTER
            if text:
                out.append((VISIBLE, text))
        elif self.state == _THINK:
            if self.split:
                text = text.rstrip(_SPACE)
            if text:
                out.append((THOUGHT if self.split else VERBATIM, text))
        elif text and not self.after_end:
            out.append((VISIBLE, text))
        return out

    def _opening(self, text: str, out: list) -> str:
        stripped = text.lstrip(_SPACE)
        if stripped.startswith(self.start):
            self.state = _THINK
            if not self.split:
                out.append((VERBATIM, text[: len(text) - len(stripped) + len(self.start)]))
                self.thought_began = True
            return stripped[len(self.start):]
        if self.start.startswith(stripped):
            self.held = text  # may still be the opening marker
            return ""
        self.state = _AFTER
        return text

    def _thought(self, text: str, out: list, final: bool) -> str:
        kind = THOUGHT if self.split else VERBATIM
        if not self.thought_began:
            text = text.lstrip(_SPACE)
            if not text:
                return ""
            self.thought_began = True
        at, marker = first_marker(text, (self.end, *self.closers))
        if at == -1:
            hold = held_prefix(text, (self.end, *self.closers))
            body = text[: len(text) - hold]
            if self.split:
                kept = body.rstrip(_SPACE)
                hold += len(body) - len(kept)
                body = kept
            if body:
                out.append((kind, body))
            self.held = text[len(text) - hold:]
            return ""
        body = text[:at]
        if self.split:
            body = body.rstrip(_SPACE)
        if not self.split and marker == self.end:
            body = text[: at + len(marker)]
        if body:
            out.append((kind, body))
        self.state = _AFTER
        if marker == self.end:
            self.after_end = True
            return text[at + len(marker):]
        return text[at:]  # a call marker: the call scanner reads it

    def _visible(self, text: str, out: list) -> None:
        if self.after_end:
            stripped = text.lstrip(_SPACE)
            if not self.split and len(stripped) < len(text):
                # Left in content, the thought keeps the whitespace after it (llama-server's reasoning_format none).
                out.append((VERBATIM, text[: len(text) - len(stripped)]))
            text = stripped
            if not text:
                return
            self.after_end = False
        out.append((VISIBLE, text))
