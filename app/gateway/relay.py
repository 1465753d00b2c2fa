"""Relaying a validated request to a runner over loopback HTTP (or a remote node over HTTP or HTTPS),
chunk by chunk when streaming.

The standard library's http.client over a shared pool of idle keep-alive connections per runner:
on this hop every request pays the client's own overhead, and http.client's is about half a
millisecond less than a general-purpose client's (measured against a runner's /health). The pool
is shared, not per thread: under serve's gevent worker every connection is its own greenlet.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from app.protocols import sse
from app.residency.remote import node_tls_context
from app.residency.supervisor import runner_headers

READ_TIMEOUT_S = 600.0  # a long generation may take minutes between bytes only in pathological cases
STREAM_READ_BYTES = 65536
MAX_CHUNK_LINE = 1024  # a chunk size line (with extensions) or a trailer line longer than this is no runner's
MAX_IDLE_PER_RUNNER = 64
# The runner's own error code for a request it could not generate (a bad grammar, say): the
# runner itself is fine, so it is not reported as failed.
GENERATION_FAILED = "generation_failed"

# Where a connection goes: (scheme, host, port). Local runners are http://; a remote node may be https://.
Origin = tuple[str, str, int]

_idle: dict[Origin, list[http.client.HTTPConnection]] = {}
_idle_lock = threading.Lock()


class RunnerUnreachable(Exception):
    """The runner did not answer (crashed, stopped, or the network failed)."""


@dataclass
class RelayOutcome:
    """What the runner said about a finished request, for the request log; failures are flags, not strings."""

    status: int = 0
    usage: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    finish_reason: str | None = None
    error: str | None = None
    error_code: str | None = None  # the runner's error code ("generation_failed", ...)
    lost_mid_stream: bool = False  # the runner's connection broke while streaming
    # A content or tool-call delta has been passed on (not the role chunk a runner sends at once).
    token_seen: bool = False
    # The last streamed event that counted the tokens so far (llama-server's running timings, or a native
    # piece's tokens_predicted): what a stream cut before its usage chunk is charged (count_so_far).
    counted: bytes | None = None

    @property
    def runner_fault(self) -> bool:
        """The runner itself failed (crash, lost stream, 5xx other than its own generation failure or a
        503: busy or loading is an answer, not a failure of the node)."""
        return self.lost_mid_stream or (self.status >= 500 and self.status != 503
                                        and self.error_code != GENERATION_FAILED)


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
    elif "tokens_predicted" in payload:
        # llama-server's native answer (/infill, /completion) counts tokens in its own fields, no usage.
        outcome.usage = {"prompt_tokens": payload.get("tokens_evaluated"),
                         "completion_tokens": payload.get("tokens_predicted")}
        cached = (payload.get("timings") or {}).get("cache_n")
        if cached is not None:
            outcome.usage["prompt_tokens_details"] = {"cached_tokens": cached}
    if payload.get("timings"):
        outcome.timings = payload["timings"]
    for choice in payload.get("choices") or []:
        if choice.get("finish_reason"):
            outcome.finish_reason = choice["finish_reason"]
    if payload.get("error"):
        err = payload["error"]
        outcome.error = err.get("message") if isinstance(err, dict) else str(err)
        outcome.error_code = err.get("code") if isinstance(err, dict) else None


def count_so_far(outcome: RelayOutcome) -> None:
    """A stream cut before its usage: its usage from the last running count the runner sent, when it sent one."""
    if outcome.usage or outcome.counted is None:
        return
    try:
        payload = json.loads(outcome.counted)
    except ValueError:
        return
    if not isinstance(payload, dict):
        return
    if "tokens_predicted" in payload:
        outcome.usage = {"prompt_tokens": _int(payload.get("tokens_evaluated")),
                         "completion_tokens": _int(payload.get("tokens_predicted"))}
        return
    t = payload.get("timings")
    if isinstance(t, dict):
        cached = _int(t.get("cache_n"))
        outcome.usage = {"prompt_tokens": cached + _int(t.get("prompt_n")),
                         "completion_tokens": _int(t.get("predicted_n")),
                         "prompt_tokens_details": {"cached_tokens": cached}}


def _int(value) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


# A running timings object as the last field of a chunk (hearth runner and llama-server write it there): flat
# numbers only, so it ends at the first closing brace.
_TRAILING_TIMINGS = re.compile(rb',\s*"timings"\s*:\s*\{[^{}]*\}\s*\}\s*$')


def without_timings(data: bytes) -> bytes:
    """A chunk's JSON without its running timings (asked for by the gateway, not by the client)."""
    stripped, n = _TRAILING_TIMINGS.subn(b"}", data)
    if n:
        return stripped
    try:
        payload = json.loads(data)
    except ValueError:
        return data
    if isinstance(payload, dict) and payload.pop("timings", None) is not None:
        return json.dumps(payload, ensure_ascii=False).encode()
    return data


def _frame(event: str | None, data: bytes) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"".join(b"data: " + line + b"\n" for line in data.split(b"\n")) + b"\n"


def carries_token(payload: dict) -> bool:
    """Whether one streamed event holds generated output: content, reasoning, text or a tool-call delta.

    Decided by content, never by position: a runner may or may not send an empty role chunk first.
    """
    if not isinstance(payload, dict):
        return False
    if isinstance(payload.get("content"), str) and payload["content"]:  # llama-server's /infill, /completion
        return True
    for choice in payload.get("choices") or []:
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
            return True
    return False


def close_idle() -> None:
    """Close every pooled idle connection (a runner stopped for good, tests)."""
    with _idle_lock:
        conns = [c for pool in _idle.values() for c in pool]
        _idle.clear()
    for conn in conns:
        conn.close()


def _origin(url: str) -> tuple[Origin, str]:
    """The connection key of `url` and the path (with query) to request there."""
    parts = urlsplit(url)
    scheme = parts.scheme or "http"
    port = parts.port or (443 if scheme == "https" else 80)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    return (scheme, parts.hostname or "127.0.0.1", port), path


def _take(origin: Origin) -> http.client.HTTPConnection | None:
    with _idle_lock:
        conns = _idle.get(origin)
        return conns.pop() if conns else None


def _give_back(origin: Origin, conn: http.client.HTTPConnection) -> None:
    with _idle_lock:
        conns = _idle.setdefault(origin, [])
        if len(conns) < MAX_IDLE_PER_RUNNER:
            conns.append(conn)
            return
    conn.close()


def _connect(origin: Origin) -> http.client.HTTPConnection:
    scheme, host, port = origin
    if scheme == "https":
        # Verified against the system's CAs plus the household's own (see node_tls_context).
        conn = http.client.HTTPSConnection(host, port, timeout=READ_TIMEOUT_S, context=node_tls_context())
    else:
        conn = http.client.HTTPConnection(host, port, timeout=READ_TIMEOUT_S)
    conn.connect()
    # A streamed token is one small write; Nagle's algorithm would hold it for an ACK.
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _send(url: str, body: dict, extra_headers: dict[str, str] | None
          ) -> tuple[http.client.HTTPResponse, http.client.HTTPConnection, Origin]:
    origin, path = _origin(url)
    payload = json.dumps(body).encode()
    # A runner serve started asks for its key; a remote node is sent none it was not given.
    headers = {"Content-Type": "application/json", "Content-Length": str(len(payload)), **runner_headers(url),
               **(extra_headers or {})}
    # A kept-alive connection may have been closed by the runner meanwhile: one retry on a fresh one.
    for fresh in (False, True):
        conn = None if fresh else _take(origin)
        try:
            if conn is None:
                fresh = True
                conn = _connect(origin)
            conn.request("POST", path, body=payload, headers=headers)
            return conn.getresponse(), conn, origin
        except (OSError, http.client.HTTPException) as exc:
            if conn is not None:
                conn.close()
            if fresh:
                raise RunnerUnreachable(f"{type(exc).__name__}: {exc}") from exc
    raise AssertionError("unreachable")


def post(url: str, body: dict, headers: dict[str, str] | None = None) -> tuple[RunnerResponse, RelayOutcome]:
    """A non-streamed request: the runner's whole answer."""
    outcome = RelayOutcome()
    resp, conn, origin = _send(url, body, headers)
    try:
        content = resp.read()
    except (OSError, http.client.HTTPException) as exc:
        conn.close()
        raise RunnerUnreachable(f"the runner stopped while answering: {exc}") from exc
    if resp.will_close:
        conn.close()
    else:
        _give_back(origin, conn)
    outcome.status = resp.status
    try:
        read_summary(json.loads(content), outcome)
    except ValueError:
        outcome.error = content[:500].decode("utf-8", "replace")
    headers = {k.lower(): v for k, v in resp.getheaders()}
    return RunnerResponse(resp.status, headers, content), outcome


class Dechunker:
    """HTTP/1.1's chunked transfer coding undone as bytes arrive, cut anywhere: feed() answers the data they complete."""

    _SIZE, _DATA, _DATA_END, _TRAILER = range(4)  # what comes next: a size line, data, its CRLF, trailer lines

    def __init__(self) -> None:
        self._buf = b""
        self._state = self._SIZE
        self._left = 0  # data bytes still due in the current chunk
        self.done = False  # the last chunk and the trailers' empty line have been read

    def feed(self, data: bytes) -> bytes:
        """The body bytes this read completes (b"" when it held only framing or a part of it)."""
        buf = self._buf + data if self._buf else data
        pos, out = 0, []
        while not self.done:
            if self._state == self._DATA:
                piece = buf[pos:pos + self._left]
                out.append(piece)
                pos += len(piece)
                self._left -= len(piece)
                if self._left:
                    break
                self._state = self._DATA_END
            if self._state == self._DATA_END:
                if len(buf) - pos < 2:
                    break
                if buf[pos:pos + 2] != b"\r\n":
                    raise http.client.HTTPException("a chunk's data is not followed by CRLF")
                pos += 2
                self._state = self._SIZE
            end = buf.find(b"\r\n", pos)
            if end < 0:
                if len(buf) - pos > MAX_CHUNK_LINE:
                    raise http.client.LineTooLong("chunk size")
                break
            line, pos = buf[pos:end], end + 2
            if self._state == self._TRAILER:
                self.done = not line  # an empty line ends the trailers, and the body
                continue
            try:
                size = int(line.split(b";", 1)[0], 16)
            except ValueError:
                size = -1
            if size < 0:
                raise http.client.HTTPException(f"a chunk size that is not hex: {line[:40]!r}")
            self._state, self._left = (self._TRAILER, 0) if size == 0 else (self._DATA, size)
        self._buf = buf[pos:]
        return b"".join(out)


class RunnerStream:
    """A streamed answer being read; close() it whether or not it was read to the end."""

    def __init__(self, resp: http.client.HTTPResponse, conn: http.client.HTTPConnection, origin: Origin):
        self._resp = resp
        self._conn = conn
        self._origin = origin
        self.status_code = resp.status
        self.retry_after = resp.getheader("Retry-After")
        self._done = False

    def read(self) -> bytes:
        """The whole remaining body (for error answers)."""
        data = self._resp.read()
        self._done = True
        return data

    def chunks(self) -> Iterator[bytes]:
        """The body as it arrives: what one read of the socket brought, as one piece.

        A chunked body (every runner's stream) is decoded here, not by http.client, whose read1 answers one HTTP
        chunk per call: a runner writes a chunk per token, so a relay behind by 15 tokens read them in one recv and
        still wrote them to the client in 15 sends, each a greenlet's turn on the hub (issue 44).
        """
        if not self._resp.chunked:  # a Content-Length or close-delimited body (a remote server's)
            while True:
                data = self._resp.read1(STREAM_READ_BYTES)
                if not data:
                    self._done = True
                    return
                yield data
        body = Dechunker()
        while not body.done:
            data = self._resp.fp.read1(STREAM_READ_BYTES)
            if not data:
                raise http.client.IncompleteRead(b"", None)
            data = body.feed(data)
            if data:
                yield data
        self._done = True

    def close(self) -> None:
        """Release the connection: reusable after a complete body, closed otherwise (the runner
        then sees its client gone and cancels the sequence, freeing its KV cells)."""
        if self._resp is None:
            return
        reusable = self._done and not self._resp.will_close
        self._resp.close()
        if reusable:
            _give_back(self._origin, self._conn)
        else:
            self._conn.close()
        self._resp = None


def open_stream(url: str, body: dict, headers: dict[str, str] | None = None) -> tuple[RunnerStream, RelayOutcome]:
    """Start a streamed request; read it with `stream_chunks`, which closes it."""
    outcome = RelayOutcome()
    resp, conn, origin = _send(url, body, headers)
    outcome.status = resp.status
    return RunnerStream(resp, conn, origin), outcome


# The running timings as the last field of an event, up to the event's end (flat numbers, so no inner brace).
_EVENT_TIMINGS = re.compile(rb',\s*"timings"\s*:\s*\{[^{}]*\}\s*\}\n\n')


def _plain_events(whole: bytes, outcome: RelayOutcome, strip_timings: bool) -> bytes:
    """Whole token events as bytes: the last one's running count kept, the timings taken out when asked."""
    # The last event with a count (a parsed chat answer's later deltas carry none). JSON escapes newlines and quotes
    # inside strings, so a blank line only ever ends an event and the field name only ever is the field.
    at = max(whole.rfind(b'"timings"'), whole.rfind(b'"tokens_predicted"'))
    if at >= 0:
        start = whole.rfind(b"\n\n", 0, at)
        event = whole[start + 2 if start >= 0 else 0:whole.find(b"\n\n", at)]
        if event.startswith(b"data: "):
            outcome.counted = event[6:]
    return _EVENT_TIMINGS.sub(b"}\n\n", whole) if strip_timings else whole


def _parsed_events(decoder: sse.Decoder, whole: bytes, outcome: RelayOutcome, strip_timings: bool) -> bytes:
    """Whole events parsed one by one: the first token's, the usage's and an error's (read for the request log)."""
    out: list[bytes] = []
    for ev in decoder.feed(whole):
        data = ev.data
        try:
            payload = ev.json()
        except ValueError:
            payload = None
        if payload is not None:
            read_summary(payload, outcome)
            outcome.token_seen = outcome.token_seen or carries_token(payload)
        if b'"timings"' in data or b'"tokens_predicted"' in data:
            outcome.counted = data
            if strip_timings and b'"usage"' not in data:
                data = without_timings(data)
        out.append(_frame(ev.event, data))
    return b"".join(out)


def stream_chunks(stream: RunnerStream, outcome: RelayOutcome, strip_timings: bool = False) -> Iterator[bytes]:
    """Pass the runner's SSE bytes through as they arrive, noting the first token, usage and timings.

    Each chunk is looked at before it is passed on, so `outcome.token_seen` is true once the chunk
    holding the first generated token has been handed over. The last event with a running count is kept
    (outcome.counted); `strip_timings` takes the running timings the gateway asked for out of every event
    but the last. Once the first token has gone by, a chunk of plain token events is handled as bytes (no
    event parsed, nothing framed anew): what serve spends per token is what makes its ceiling (issue 44).
    """
    decoder = sse.Decoder()
    tail = b""  # an event the last read cut short: it waits for its end
    try:
        for chunk in stream.chunks():
            data = tail + chunk
            if b"\r" in data:  # a remote server's CRLF lines, as the decoder reads them
                data = data.replace(b"\r\n", b"\n")
            end = data.rfind(b"\n\n") + 2
            if end < 2:
                tail = data
                continue
            whole, tail = data[:end], data[end:]
            if outcome.token_seen and b'"usage"' not in whole and b'"error"' not in whole:
                out = _plain_events(whole, outcome, strip_timings)
            else:
                out = _parsed_events(decoder, whole, outcome, strip_timings)
            if out:
                yield out
        if tail:
            yield tail
    except (OSError, http.client.HTTPException) as exc:
        outcome.lost_mid_stream = True
        outcome.error = f"the runner stopped mid-stream: {exc or type(exc).__name__}"
        # The client is told what happened and what to do; the request log keeps the raw cause.
        message = f"{outcome.error}; the answer is incomplete, retry: the model is restarted on the next request"
        err = {"error": {"message": message, "type": "server_error", "param": None, "code": "runner_failed"}}
        yield sse.encode(err) + sse.DONE
    finally:
        stream.close()
