"""Relaying a validated request to a runner over loopback HTTP, chunk by chunk when streaming."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field
from typing import Iterator

import httpx

# One pool for every runner: keep-alive connections save a TCP handshake per request.
_client = httpx.Client(
    timeout=httpx.Timeout(connect=5.0, read=600.0, write=30.0, pool=30.0),
    transport=httpx.HTTPTransport(
        limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
        socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
    ),
)


class RunnerUnreachable(Exception):
    """The runner did not answer (crashed, stopped, or the network failed)."""


@dataclass
class RelayOutcome:
    """What the runner said about a finished request, for the request log."""

    status: int = 0
    first_byte_s: float | None = None
    usage: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    finish_reason: str | None = None
    error: str | None = None


def _read_summary(payload: dict, outcome: RelayOutcome) -> None:
    if payload.get("usage"):
        outcome.usage = payload["usage"]
    if payload.get("timings"):
        outcome.timings = payload["timings"]
    for choice in payload.get("choices") or []:
        if choice.get("finish_reason"):
            outcome.finish_reason = choice["finish_reason"]
    if payload.get("error"):
        err = payload["error"]
        outcome.error = err.get("message") if isinstance(err, dict) else str(err)


def post(url: str, body: dict) -> tuple[httpx.Response, RelayOutcome]:
    """A non-streamed request: the runner's whole answer."""
    outcome = RelayOutcome()
    try:
        resp = _client.post(url, json=body)
    except httpx.TransportError as exc:
        raise RunnerUnreachable(str(exc)) from exc
    outcome.status = resp.status_code
    outcome.first_byte_s = time.monotonic()
    try:
        _read_summary(resp.json(), outcome)
    except ValueError:
        outcome.error = resp.text[:500]
    return resp, outcome


def open_stream(url: str, body: dict) -> tuple[httpx.Response, RelayOutcome]:
    """Start a streamed request; the caller reads it with `stream_chunks` and must close it."""
    outcome = RelayOutcome()
    request = _client.build_request("POST", url, json=body)
    try:
        resp = _client.send(request, stream=True)
    except httpx.TransportError as exc:
        raise RunnerUnreachable(str(exc)) from exc
    outcome.status = resp.status_code
    return resp, outcome


def stream_chunks(resp: httpx.Response, outcome: RelayOutcome) -> Iterator[bytes]:
    """Pass the runner's SSE bytes through as they arrive, noting usage and timings on the way."""
    tail = b""
    try:
        for chunk in resp.iter_raw():
            if outcome.first_byte_s is None:
                outcome.first_byte_s = time.monotonic()
            yield chunk
            # Only whole events that carry a summary are parsed; content chunks pass untouched.
            tail += chunk
            *events, tail = tail.split(b"\n\n")
            for ev in events:
                if b'"usage"' in ev or b'"error"' in ev:
                    data = ev.partition(b"data: ")[2]
                    try:
                        _read_summary(json.loads(data), outcome)
                    except ValueError:
                        pass
    except httpx.TransportError as exc:
        outcome.error = f"the runner stopped mid-stream: {exc}"
        err = {"error": {"message": outcome.error, "type": "server_error", "param": None, "code": "runner_failed"}}
        yield b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"
    finally:
        resp.close()
