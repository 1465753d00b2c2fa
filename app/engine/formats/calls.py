"""Finding a family's calls in streamed visible text: content passes on at once, a call region is held.

A family's `CallSyntax` names the markers that open a call region and makes a `Region` for each.
The scanner holds back only what could still begin a marker (and whitespace that would be dropped
before a call); a region is decided once, when it is whole: valid calls, or its text as content.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from app.engine.formats.base import Call, JsonEnd, Tools, first_marker, held_prefix, new_call_id

_SPACE = " \t\n\r\v\f"  # what C's isspace calls whitespace, as llama.cpp trims
# A region malformed from its start is content up to just past its first character; scanning resumes there.
_RESUME = 1


class Region:
    """One call region from its opening marker on; `feed` answers once the region is decided.

    The answer is (calls, end): the calls the region holds (None when it is malformed: then its
    text up to end is content; [] for markup that is dropped) and where the region ends in the text.
    A region of several calls (a JSON array, a calls section) may hand each call over as soon as it is
    whole, and a call's name as soon as it is known: it appends ("start", id, name) and ("call", Call)
    events to its `events` list, which the scanner drains after each feed; its answer then holds only the
    calls not handed over yet.
    """

    events: list | None = None

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


class _Elements:
    """What the multi-call regions share: calls handed over as they close, the started call's id and name."""

    __slots__ = ("events", "num_calls", "started")

    def __init__(self):
        self.events: list = []
        self.num_calls = 0
        self.started: tuple[str, str] | None = None  # (id, name) of the call whose name went out

    def start(self, name: str | None, tools: Tools, call_id: str | None = None) -> None:
        """The next call's name, once known: a ("start", id, name) event (only for an offered tool's name)."""
        if self.started is None and name is not None and name in tools:
            self.started = (call_id or new_call_id(), name)
            self.events.append(("start", *self.started))

    def call(self, call: Call) -> None:
        """A whole call: a ("call", Call) event (the scanner gives it the id its name went out with, if it did)."""
        self.started = None
        self.events.append(("call", call))
        self.num_calls += 1


_ARRAY_GAP = " \t\n\r,"  # what may stand between a JSON array's call objects (the grammar writes ", ")


class _CallsRegion(Region):
    """What a region of several calls (an array, a section) does when cut or malformed: the calls that went out stand,
    the cut or broken one is no content; malformed before any call, the `fallback()` region decides the whole text.
    Subclasses set `fallback`, `calls` (_Elements), `events` and `pos` (where the text after the last whole call
    starts)."""

    def finish(self, text):
        if isinstance(self.fallback, Region):
            return self.fallback.finish(text)
        # Cut inside the region: the calls that went out stand; the cut one is no content.
        return ([] if self.calls.num_calls else None), len(text)

    def _give_up(self, text):
        """Malformed: after calls, the rest is scanned again; before any, the whole-text region decides."""
        if self.calls.num_calls:
            return [], self.pos
        self.events.clear()  # a name that went out stays the scanner's to settle
        self.fallback = self.fallback()
        return self.fallback.feed(text)


class ArrayRegion(_CallsRegion):
    """A region that holds a JSON array of calls (the generic envelope, Granite's and Mistral's lists, Command-R's
    action): each call goes out as soon as its object closes, and its name as soon as it is written.

    `header(text)` answers where the array's first element may start (just past "["; -1 while unknown,
    -2 when the region is not of this shape: then `fallback()`, a region that takes the text whole, decides
    it); `element(value, tools)` makes a call of one object (None: malformed); `name(text)` reads the tool's
    name (and the call's id, if the model writes one) from an object's start (None while unknown); `tail(text, pos)` where the region ends after the
    array's "]" at pos (-1 while unknown, -2 when malformed). A region malformed after calls went out keeps
    them: the rest is scanned again.
    """

    __slots__ = ("header", "element", "name", "tail", "fallback", "tools", "pos", "closed", "json_end", "calls")

    def __init__(self, tools: Tools, header: Callable[[str], int], element: Callable[[object, Tools], Call | None],
                 tail: Callable[[str, int], int], fallback: Callable[[], Region],
                 name: Callable[[str], tuple[str, str | None] | None]):
        self.tools, self.header, self.element, self.tail, self.name = tools, header, element, tail, name
        self.fallback: Callable[[], Region] | Region = fallback
        self.pos = -1
        self.closed = -1  # just past the array's "]", once seen
        self.json_end: JsonEnd | None = None  # the open element's scanner
        self.calls = _Elements()
        self.events = self.calls.events

    def feed(self, text):
        if isinstance(self.fallback, Region):
            return self.fallback.feed(text)
        if self.pos < 0:
            start = self.header(text)
            if start == -1:
                return None
            if start == -2:
                return self._give_up(text)
            self.pos = start
        while self.closed < 0:
            if self.json_end is None:
                pos = self.pos
                while pos < len(text) and text[pos] in _ARRAY_GAP:
                    pos += 1
                self.pos = pos
                if pos == len(text):
                    return None
                if text[pos] == "]":
                    self.closed = pos + 1
                    break
                if text[pos] != "{":
                    return self._give_up(text)
                self.json_end = JsonEnd(pos)
            named = self.name(text[self.pos:]) if self.calls.started is None else None
            if named is not None:
                self.calls.start(named[0], self.tools, named[1])
            end = self.json_end.scan(text)
            if end == -1:
                return None
            try:
                call = self.element(json.loads(text[self.pos:end]), self.tools)
            except ValueError:
                call = None
            if call is None:
                return self._give_up(text)
            self.calls.call(call)
            self.pos, self.json_end = end, None
        end = self.tail(text, self.closed)
        if end == -1:
            return None
        return [], (self.closed if end == -2 else end)


class SectionRegion(_CallsRegion):
    """A calls section of marked units (DeepSeek's, Kimi K2's): each unit's call goes out as soon as the unit ends,
    its name as soon as `name(unit_text)` reads it ((name, id) or None).

    `unit(inner)` makes a call of one unit's inside (None: malformed); text that is neither a unit nor the section's
    end makes the region malformed: the `fallback()` region decides it when no call went out yet.
    """

    __slots__ = ("open_len", "end", "begin", "unit_end", "unit", "name", "fallback", "tools", "pos", "calls")

    def __init__(self, tools: Tools, open_len: int, end: str, begin: str, unit_end: str,
                 unit: Callable[[str], Call | None], name: Callable[[str], tuple[str, str | None] | None],
                 fallback: Callable[[], Region]):
        self.tools, self.open_len, self.end, self.begin, self.unit_end = tools, open_len, end, begin, unit_end
        self.unit, self.name = unit, name
        self.fallback: Callable[[], Region] | Region = fallback
        self.pos = open_len
        self.calls = _Elements()
        self.events = self.calls.events

    def feed(self, text):
        if isinstance(self.fallback, Region):
            return self.fallback.feed(text)
        while True:
            pos = self.pos
            while pos < len(text) and text[pos] in _SPACE:
                pos += 1
            rest = text[pos:]
            if rest.startswith(self.end):
                return [], pos + len(self.end)
            if not rest.startswith(self.begin):
                if self.end.startswith(rest) or self.begin.startswith(rest):
                    return None
                return self._give_up(text)
            inner_at = pos + len(self.begin)
            close = text.find(self.unit_end, inner_at)
            if close == -1:
                named = self.name(text[inner_at:]) if self.calls.started is None else None
                if named is not None:
                    self.calls.start(named[0], self.tools, named[1])
                return None
            call = self.unit(text[inner_at:close])
            if call is None:
                return self._give_up(text)
            self.calls.call(call)
            self.pos = close + len(self.unit_end)


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
    # The tool's name from the start of a one-call region's text (None while unknown): it goes out before the call.
    call_name: Callable[[str], str | None] | None = None
    all_markers: tuple[str, ...] = field(default=(), init=False)

    def __post_init__(self):
        object.__setattr__(self, "all_markers", self.markers + self.dropped)


class CallScanner:
    """Turns visible text into content and calls for one family, decided as early as possible."""

    __slots__ = ("syntax", "tools", "pending", "region", "region_text", "space_before", "at_start", "after_call",
                 "gap", "out", "early", "started", "region_calls")

    def __init__(self, syntax: CallSyntax, tools: Tools, early: bool = False):
        self.syntax, self.tools = syntax, tools
        # Names go out before their calls are whole ("start" events) only when asked: under a call grammar a
        # started call can end only whole or cut, so its name never turns out to be content.
        self.early = early
        self.started: str | None = None  # the id of the open region's call whose name went out
        self.region_calls = 0  # calls the open region handed over before it was decided
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
            self._feed()
        else:
            self._scan(self.pending + text)
        return self.out

    def finish(self, cut: bool = False) -> list:
        """Events for what is still held at the end of the answer; `cut`: max_tokens ended it.

        A cut inside a call whose tool is named already loses that call only: its text is no content."""
        self.out = []
        rescanned = False
        while True:
            if self.region is not None:
                calls, end = self.region.finish(self.region_text)
                if calls is None and cut and self._names_a_call():
                    calls = []
                self._close((calls, end), final=True)
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

    def _names_a_call(self) -> bool:
        """The open region's call has an offered tool's name (whether or not it went out)."""
        if self.started is not None:
            return True
        calls = getattr(self.region, "calls", None)
        if isinstance(calls, _Elements) and calls.started is not None:
            return True
        name = self.syntax.call_name(self.region_text) if self.syntax.call_name is not None else None
        return name is not None and name in self.tools

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
        self.region, self.region_text, self.space_before = region, text, space_before
        self.started, self.region_calls = None, 0
        self._feed()

    def _feed(self) -> None:
        """The open region fed its text so far: the calls (and names) it hands over, and its decision."""
        region = self.region
        decided = region.feed(self.region_text)
        if region.events:
            self._take(region.events)
        if self.early and self.started is None and not self.region_calls and self.syntax.call_name is not None:
            # Read even when this feed decides the region: a whole text pushed at once must split as its stream did.
            name = self.syntax.call_name(self.region_text)
            if name is not None and name in self.tools:
                self.started = new_call_id()
                self.out.append(("start", self.started, name))
        if decided is not None:
            self._close(decided)

    def _take(self, events: list) -> None:
        """A multi-call region's events: each whole call at once, names only when they go out early."""
        for event in events:
            if event[0] == "call":
                if self.region_calls == 0:
                    self.gap, self.space_before = self.gap or self.space_before, ""
                self.region_calls += 1
                if self.started is not None:
                    event = ("call", event[1]._replace(id=self.started))
                    self.started = None
                self.out.append(event)
            elif self.early:
                self.started = event[1]
                self.out.append(event)
        events.clear()

    def _close(self, decided: tuple[list[Call] | None, int], final: bool = False) -> None:
        calls, end = decided
        text, self.region, self.region_text = self.region_text, None, ""
        if self.started is not None and calls:
            # The one-call region's name went out under this id.
            calls = [calls[0]._replace(id=self.started), *calls[1:]]
        elif self.started is not None or self.region_calls:
            # A call whose name went out, or a region whose calls did, is never content: what is left is dropped.
            calls = calls or []
            self.after_call = self.after_call or bool(self.region_calls)
        self.started, self.region_calls = None, 0
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
