"""Server-sent events, the one encoder and decoder: OpenAI's, llama-server's, Anthropic's and the Responses API's streams.

An event is `event: <name>` (optional) and `data: <payload>` lines ended by a blank line. OpenAI
and llama-server send unnamed events and end with `data: [DONE]`; Anthropic's and the Responses
API's SDKs dispatch on the event name. The decoder is incremental: bytes go in as they arrive from
a socket, whole events come out, a partial one waits for the rest.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

DONE = b"data: [DONE]\n\n"
_DONE_DATA = b"[DONE]"


def encode(data: dict | list, event: str | None = None) -> bytes:
    """One event: its JSON payload, and its name where the API names events."""
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


@dataclass(frozen=True)
class Event:
    """One decoded event: its name (None when unnamed) and its data bytes, lines joined by newlines."""

    event: str | None
    data: bytes

    @property
    def done(self) -> bool:
        """True for OpenAI's end-of-stream marker."""
        return self.data == _DONE_DATA

    def json(self):
        """The data as JSON (ValueError when it is not)."""
        return json.loads(self.data)


class Decoder:
    """Whole events out of a byte stream cut anywhere."""

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, chunk: bytes) -> list[Event]:
        """The events completed by this chunk, in order (comments and empty blocks are left out)."""
        self._tail += chunk
        if b"\r" in self._tail:
            self._tail = self._tail.replace(b"\r\n", b"\n")
        *blocks, self._tail = self._tail.split(b"\n\n")
        return [ev for ev in map(_parse_block, blocks) if ev is not None]


def _parse_block(block: bytes) -> Event | None:
    name: str | None = None
    data: list[bytes] = []
    for line in block.split(b"\n"):
        field, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if field == b"data":
            data.append(value)
        elif field == b"event":
            name = value.decode("utf-8", "replace")
    if not data:
        return None
    return Event(name, b"\n".join(data))


def events(chunks: Iterable[bytes]) -> Iterator[Event]:
    """Every event of a stream, [DONE] included, as the chunks arrive."""
    decoder = Decoder()
    for chunk in chunks:
        yield from decoder.feed(chunk)


def payloads(chunks: Iterable[bytes]) -> Iterator[dict]:
    """The JSON payloads of an OpenAI-style stream, up to its [DONE]; data that is not JSON is skipped."""
    for ev in events(chunks):
        if ev.done:
            return
        try:
            payload = ev.json()
        except ValueError:
            continue
        if isinstance(payload, dict):
            yield payload
