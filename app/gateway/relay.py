"""Relaying a validated request to a runner over loopback HTTP, chunk by chunk when streaming.

The standard library's http.client, one keep-alive connection per gateway thread and runner:
on this hop every request pays the client's own overhead, and http.client's is about half a
millisecond less than a general-purpose client's (measured against a runner's /health).
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from flask import has_app_context

from app.gateway.context import services
from app.policy import SLO_HEADER, slo_header

READ_TIMEOUT_S = 600.0  # a long generation may take minutes between bytes only in pathological cases
STREAM_READ_BYTES = 65536

_local = threading.local()


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


@dataclass
class RunnerResponse:
    """A runner's complete (non-streamed) answer."""

    status_code: int
    headers: dict[str, str]
    content: bytes

    @property
    def text(self) -> str:
        """The body as text."""
        return self.content.decode("utf-8", "replace")


def read_summary(payload: dict, outcome: RelayOutcome) -> None:
    """Note usage, timings, finish reason and error from one JSON payload of the runner."""
    if not isinstance(payload, dict):
        return
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


def _connection(host: str, port: int, fresh: bool) -> http.client.HTTPConnection:
    pool = getattr(_local, "pool", None)
    if pool is None:
        pool = _local.pool = {}
    conn = pool.get((host, port))
    if conn is not None and not fresh:
        return conn
    if conn is not None:
        conn.close()
    conn = http.client.HTTPConnection(host, port, timeout=READ_TIMEOUT_S)
    conn.connect()
    # A streamed token is one small write; Nagle's algorithm would hold it for an ACK.
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    pool[(host, port)] = conn
    return conn


def _discard(host: str, port: int) -> None:
    conn = getattr(_local, "pool", {}).pop((host, port), None)
    if conn is not None:
        conn.close()


def _slo_headers(body: dict) -> dict[str, str]:
    """The class's targets for the runner's scheduler (app.policy.SLO_HEADER), when the class is known."""
    if not has_app_context():  # relayed from outside a gateway app (tests, tools)
        return {}
    policy = services().classes.get(body.get("hearth_class") or "")
    return {SLO_HEADER: slo_header(policy)} if policy else {}


def _send(url: str, body: dict) -> tuple[http.client.HTTPResponse, str, int]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    payload = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Content-Length": str(len(payload)), **_slo_headers(body)}
    # A kept-alive connection may have been closed by the runner meanwhile: one retry on a fresh one.
    for fresh in (False, True):
        try:
            conn = _connection(host, port, fresh)
            conn.request("POST", parts.path, body=payload, headers=headers)
            return conn.getresponse(), host, port
        except (OSError, http.client.HTTPException) as exc:
            _discard(host, port)
            if fresh:
                raise RunnerUnreachable(f"{type(exc).__name__}: {exc}") from exc
    raise AssertionError("unreachable")


def post(url: str, body: dict) -> tuple[RunnerResponse, RelayOutcome]:
    """A non-streamed request: the runner's whole answer."""
    outcome = RelayOutcome()
    resp, host, port = _send(url, body)
    try:
        content = resp.read()
    except (OSError, http.client.HTTPException) as exc:
        _discard(host, port)
        raise RunnerUnreachable(f"the runner stopped while answering: {exc}") from exc
    if resp.will_close:
        _discard(host, port)
    outcome.status = resp.status
    outcome.first_byte_s = time.monotonic()
    try:
        read_summary(json.loads(content), outcome)
    except ValueError:
        outcome.error = content[:500].decode("utf-8", "replace")
    headers = {k.lower(): v for k, v in resp.getheaders()}
    return RunnerResponse(resp.status, headers, content), outcome


class RunnerStream:
    """A streamed answer being read; close() it whether or not it was read to the end."""

    def __init__(self, resp: http.client.HTTPResponse, host: str, port: int):
        self._resp = resp
        self._host, self._port = host, port
        self.status_code = resp.status
        self._done = False

    def read(self) -> bytes:
        """The whole remaining body (for error answers)."""
        data = self._resp.read()
        self._done = True
        return data

    def chunks(self) -> Iterator[bytes]:
        """The body as it arrives."""
        while True:
            data = self._resp.read1(STREAM_READ_BYTES)
            if not data:
                self._done = True
                return
            yield data

    def close(self) -> None:
        """Release the connection: reusable after a complete body, closed otherwise (the runner
        then sees its client gone and cancels the sequence)."""
        if self._resp is None:
            return
        if not self._done or self._resp.will_close:
            _discard(self._host, self._port)
        self._resp.close()
        self._resp = None


def open_stream(url: str, body: dict) -> tuple[RunnerStream, RelayOutcome]:
    """Start a streamed request; read it with `stream_chunks`, which closes it."""
    outcome = RelayOutcome()
    resp, host, port = _send(url, body)
    outcome.status = resp.status
    return RunnerStream(resp, host, port), outcome


def stream_chunks(stream: RunnerStream, outcome: RelayOutcome) -> Iterator[bytes]:
    """Pass the runner's SSE bytes through as they arrive, noting usage and timings on the way."""
    tail = b""
    try:
        for chunk in stream.chunks():
            if outcome.first_byte_s is None:
                outcome.first_byte_s = time.monotonic()
            yield chunk
            # Only whole events that carry a summary are parsed; content chunks pass untouched.
            tail += chunk
            *events, tail = tail.split(b"\n\n")
            for ev in events:
                if b'"usage"' in ev or b'"error"' in ev:
                    try:
                        read_summary(json.loads(ev.partition(b"data: ")[2]), outcome)
                    except ValueError:
                        pass
    except (OSError, http.client.HTTPException) as exc:
        outcome.error = f"the runner stopped mid-stream: {exc or type(exc).__name__}"
        # The client is told what happened and what to do; the request log keeps the raw cause.
        message = f"{outcome.error}; the answer is incomplete, retry: the model is restarted on the next request"
        err = {"error": {"message": message, "type": "server_error", "param": None, "code": "runner_failed"}}
        yield b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"
    finally:
        stream.close()
