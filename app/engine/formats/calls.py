"""Finding a family's calls in streamed visible text: content passes on at once, a call region is held.

A family's `CallSyntax` names the markers that open a call region and makes a `Region` for each.
The scanner holds back only what could still begin a marker (and whitespace that would be dropped
before a call); a region is decided once, when it is whole: valid calls, or its text as content.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from app.engine.formats.base import Call, JsonEnd, Tools, first_marker, held_prefix

_SPACE = " \t\n\r\v\f"  # what C's isspace calls whitespace, as llama.cpp trims
# A region malformed from its start is content up to just past its first character; scanning resumes there.
_RESUME = 1


class Region:
    """One call region from its opening marker on; `feed` answers once the region is decided.

    The answer is (calls, end): the calls the region holds (None when it is malformed: then its
    text up to end is content; [] for markup that is dropped) and where the region ends in the text.
    """

    def feed(self, text: str) -> tuple[list[Call] | None, int] | None:
        """text: the whole region so far. None while undecided."""
        raise NotImplementedError

    def finish(self, text: str) -> tuple[list[Call] | None, int]:
        """The decision at the end of the answer (a cut call is malformed)."""
        return None, len(text)


class EndMarkerRegion(Region):
    """A region closed by an end marker (Hermes `</tool_call>`); its text is parsed once, whole."""

    __slots__ = ("open_len", "end", "parse", "searched", "lenient")

    def __init__(self, open_len: int, end: str, parse: Callable[[str], list[Call] | None], lenient: bool = True):
        self.open_len, self.end, self.parse = open_len, end, parse
        self.searched = open_len
        self.lenient = lenient  # at the end of the answer, a missing end marker is forgiven

    def feed(self, text):
        at = text.find(self.end, max(self.open_len, self.searched - len(self.end)))
        if at == -1:
            self.searched = len(text)
            return None
        return self.parse(text[self.open_len: at]), at + len(self.end)

    def finish(self, text):
        if self.lenient:
            calls = self.parse(text[self.open_len:])
            if calls:
                return calls, len(text)
        return None, len(text)


class ToEndRegion(Region):
    """A region that runs to the end of the answer (Llama 3.x `<|python_tag|>`)."""

    __slots__ = ("open_len", "parse")

    def __init__(self, open_len: int, parse: Callable[[str], list[Call] | None]):
        self.open_len, self.parse = open_len, parse

    def feed(self, text):
        return None

    def finish(self, text):
        return self.parse(text[self.open_len:]), len(text)


class JsonRegion(Region):
    """A region whose last part is a JSON value: a header (e.g. `[TOOL_CALLS]name[ARGS]`) then the value.

    `header(text)` answers where the value starts (or -1 while unknown, -2 if malformed) and
    `parse(header_text, value)` the calls.
    """

    __slots__ = ("header", "parse", "start", "json_end")

    def __init__(self, header: Callable[[str], int], parse: Callable[[str, object], list[Call] | None]):
        self.header, self.parse = header, parse
        self.start = -1
        self.json_end: JsonEnd | None = None

    def feed(self, text):
        if self.start < 0:
            start = self.header(text)
            if start == -2:
                return None, _RESUME
            if start == -1:
                return None
            self.start, self.json_end = start, JsonEnd(start)
        end = self.json_end.scan(text)
        if end == -1:
            return None
        if end == -2:
            return None, _RESUME
        try:
            value = json.loads(text[self.start:end])
        except ValueError:
            return None, end
        return self.parse(text[: self.start], value), end


@dataclass(frozen=True)
class CallSyntax:
    """A family's call markup: the markers that open a region, and the region each one makes.

    `anchored` regions may open only at the start of the content (bare JSON calls); `dropped`
    markers are removed from content (wrappers such as `<|START_RESPONSE|>`).
    """

    markers: tuple[str, ...] = ()
    open_region: Callable[[str, Tools], Region] | None = None
    anchored: Callable[[str], int] | None = None  # -1 unknown yet, -2 no, else where the region starts
    open_anchored: Callable[[Tools], Region] | None = None
    dropped: tuple[str, ...] = ()
    after_call: Callable[[str], int] | None = None  # how much text after a call to drop (-1: not known yet)
    # The anchored region opens without tools too (Functionary v3.2's leading "all\n" recipient is markup).
    anchored_always: bool = False
    all_markers: tuple[str, ...] = field(default=(), init=False)

    def __post_init__(self):
        object.__setattr__(self, "all_markers", self.markers + self.dropped)


class CallScanner:
    """Turns visible text into content and calls for one family, decided as early as possible."""

    __slots__ = ("syntax", "tools", "pending", "region", "region_text", "space_before", "at_start", "after_call",
                 "gap", "out")

    def __init__(self, syntax: CallSyntax, tools: Tools):
        self.syntax, self.tools = syntax, tools
        self.pending = ""  # undecided text: a possible marker's beginning, or whitespace before a call
        self.region: Region | None = None
        self.region_text = ""
        self.space_before = ""  # whitespace before the open region, content again if it is malformed
        self.at_start = syntax.anchored is not None and (bool(tools) or syntax.anchored_always)
        self.after_call = False
        self.gap = ""  # whitespace before a run of calls: between content before and content after them
        self.out: list = []  # ("c", text) and ("call", Call) events

    def push(self, text: str) -> list:
        """Events for this chunk: ("c", content text) and ("call", Call)."""
        self.out = []
        if self.region is not None:
            self.region_text += text
            decided = self.region.feed(self.region_text)
            if decided is not None:
                self._close(decided)
        else:
            self._scan(self.pending + text)
        return self.out

    def finish(self) -> list:
        """Events for what is still held at the end of the answer."""
        self.out = []
        rescanned = False
        while True:
            if self.region is not None:
                self._close(self.region.finish(self.region_text), final=True)
                continue
            if self.pending and not rescanned:
                # What was held for what might follow is decided now that nothing follows.
                text, self.pending, rescanned = self.pending, "", True
                self._scan(text, final=True)
                continue
            break
        text, self.pending = self.pending, ""
        if self.after_call:
            text = self._drop_after_call(text, final=True)
        if text:
            self._content(text)
        return self.out

    def _resume(self, text: str) -> str:
        """Content after a run of calls: the whitespace that stood before them separates it again."""
        self.after_call = False
        if text:
            text, self.gap = self.gap + text, ""
        return text

    def _content(self, text: str) -> None:
        if self.out and self.out[-1][0] == "c":
            self.out[-1] = ("c", self.out[-1][1] + text)
        else:
            self.out.append(("c", text))

    def _scan(self, text: str, final: bool = False) -> None:
        syntax = self.syntax
        if self.after_call:
            text = self._drop_after_call(text, final)
            if self.after_call:
                return
        if self.at_start:
            stripped = text.lstrip(_SPACE)
            start = syntax.anchored(stripped) if stripped else -1
            if start == -1 and not final:
                self.pending = text
                return
            self.at_start = False
            if start >= 0:
                self.pending = ""
                self._open(syntax.open_anchored(self.tools), stripped, text[: len(text) - len(stripped)])
                return
        if not self.tools and not syntax.dropped:
            self.pending = ""
            if text:
                self._content(text)
            return
        markers = syntax.all_markers if self.tools else syntax.dropped
        at, marker = first_marker(text, markers)
        if at == -1:
            hold = held_prefix(text, markers) if markers else 0
            body = text[: len(text) - hold]
            if markers is syntax.all_markers and syntax.markers:
                kept = body.rstrip(_SPACE)
                hold += len(body) - len(kept)
                body = kept
            self.pending = text[len(text) - hold:]
            if body:
                self._content(body)
            return
        if not final and any(len(m) > len(marker) and m.startswith(text[at:]) for m in markers):
            # A longer marker may still be what this one begins (Gemma's empty thought and its "<|channel>").
            if text[:at]:
                self._content(text[:at])
            self.pending = text[at:]
            return
        self.pending = ""
        before = text[:at]
        if marker in syntax.dropped:
            if before:
                self._content(before)
            self._scan(text[at + len(marker):], final)
            return
        kept = before.rstrip(_SPACE)
        if kept:
            self._content(kept)
        self._open(syntax.open_region(marker, self.tools), text[at:], before[len(kept):])

    def _open(self, region: Region, text: str, space_before: str) -> None:
        self.region, self.region_text, self.space_before = region, "", space_before
        self.region_text = text
        decided = region.feed(text)
        if decided is not None:
            self._close(decided)

    def _close(self, decided: tuple[list[Call] | None, int], final: bool = False) -> None:
        calls, end = decided
        text, self.region, self.region_text = self.region_text, None, ""
        if calls:
            for call in calls:
                self.out.append(("call", call))
            self.after_call = True
            self.gap = self.gap or self.space_before
        elif calls is None:
            self._content(self.space_before + text[:end])
        elif self.space_before:  # a wrapper without calls (Functionary's `>>>all`): only its markup goes
            self._content(self.space_before)
        self.space_before = ""
        rest = text[end:]
        if rest or final:
            self._scan(rest, final)
        else:
            self.pending = ""

    def _drop_after_call(self, text: str, final: bool) -> str:
        """Drops the whitespace (and a family's closing text, e.g. a fence) after a call."""
        drop = self.syntax.after_call(text) if self.syntax.after_call else len(text) - len(text.lstrip(_SPACE))
        if self.syntax.after_call is None:
            if drop == len(text) and not final:
                self.pending = ""
                return ""
            return self._resume(text[drop:])
        if drop == -1 and not final:
            self.pending = text
            return ""
        return self._resume(text[drop:] if drop >= 0 else "")
