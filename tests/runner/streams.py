"""Reading a runner's answers in tests: JSON bodies and event streams."""

from __future__ import annotations

import json

from app.protocols.sse import events


def sse_events(resp) -> list[tuple[str | None, object]]:
    """(event name, payload) of each server-sent event of a streamed answer ([DONE] kept as the string)."""
    return [(ev.event, "[DONE]" if ev.done else ev.json()) for ev in events([resp.get_data()])]


def payloads(resp) -> list:
    """The payloads of an unnamed event stream."""
    return [data for _, data in sse_events(resp)]


def loads(resp) -> dict:
    """A JSON answer, after checking it is one."""
    assert resp.status_code == 200, resp.get_data(as_text=True)
    assert resp.mimetype == "application/json"
    return json.loads(resp.get_data())
