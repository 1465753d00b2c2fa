"""The relay against a loopback stand-in runner: Retry-After on streamed errors, typed failure flags,
the first token found by content, connections reused from the shared pool."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from app.gateway import relay
from app.gateway.context import services
from app.gateway.tokens import create_token
from app.policy import slo_header
from tests.helpers import dashboard_app, query, wait_until

ROLE = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
TOKEN = {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}
TOOL = {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": "on"}}]}}]}


class StandIn(BaseHTTPRequestHandler):
    """Answers per path: /busy 503 with Retry-After, /failed 500 generation_failed, /crash 500, /stream SSE."""

    protocol_version = "HTTP/1.1"
    connections: set = set()
    slo_headers: list = []  # each request's X-Hearth-Slo (the class's targets for the runner's scheduler)

    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        StandIn.connections.add(self.client_address)
        StandIn.slo_headers.append(self.headers.get("X-Hearth-Slo"))
        for name in ("/busy", "/failed", "/crash"):
            if self.path.startswith(name + "/"):  # the gateway's path under a lease's URL
                self.path = name
        if self.path == "/stream":
            body = b"".join(b"data: " + json.dumps(ev).encode() + b"\n\n" for ev in (ROLE, TOKEN)) + b"data: [DONE]\n\n"
            self._send(200, body, {"Content-Type": "text/event-stream"})
            return
        status, code, extra = {"/busy": (503, "queue_full", {"Retry-After": "7"}),
                               "/failed": (500, "generation_failed", {}),
                               "/crash": (500, None, {})}[self.path]
        self._send(status, json.dumps({"error": {"message": "no", "code": code}}).encode(),
                   {"Content-Type": "application/json", **extra})

    def _send(self, status, body, headers):
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def standin():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    StandIn.connections = set()
    StandIn.slo_headers = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    relay.close_idle()
    server.shutdown()
    server.server_close()


def test_a_streamed_error_keeps_the_runners_retry_after(standin):
    stream, outcome = relay.open_stream(standin + "/busy", {"stream": True})
    assert (stream.status_code, stream.retry_after) == (503, "7")
    relay.read_summary(json.loads(stream.read()), outcome)
    stream.close()
    assert outcome.error_code == "queue_full"


@pytest.mark.parametrize("path, fault", [("/failed", False), ("/crash", True), ("/busy", False)])
def test_runner_fault_is_a_flag_from_the_error_code(standin, path, fault):
    _, outcome = relay.post(standin + path, {})
    assert outcome.runner_fault is fault


def test_the_first_token_is_found_by_content_not_by_position(standin):
    stream, outcome = relay.open_stream(standin + "/stream", {"stream": True})
    seen = []
    for chunk in relay.stream_chunks(stream, outcome):
        seen.append((chunk, outcome.token_seen))
    assert outcome.token_seen
    assert not relay.carries_token(ROLE)
    assert relay.carries_token(TOKEN) and relay.carries_token(TOOL)
    assert relay.carries_token({"content": "x", "stop": False})  # llama-server's /infill stream


def test_kept_alive_connections_are_shared_and_reused(standin):
    for _ in range(3):
        _, outcome = relay.post(standin + "/failed", {})
        assert outcome.status == 500
    assert len(StandIn.connections) == 1


class FakeLease:
    """A lease on the stand-in runner (what the residency manager hands the gateway)."""

    def __init__(self, url: str):
        self.url, self.node_label, self.model_name, self.released = url, "standin", "standin", 0

    def release(self):
        self.released += 1


def test_the_gateway_passes_a_streamed_errors_retry_after_on_and_releases_once(standin, tmp_path, standin_model):
    with dashboard_app(tmp_path, standin_model) as app:
        svc = services(app)
        with svc.sessions() as s:
            token, _ = create_token(s, "alice", "chat")
            s.commit()
        lease = FakeLease(standin + "/busy")
        svc.router.acquire = lambda name: lease
        busy, failed = [], []
        svc.residency.report_busy = busy.append
        svc.residency.report_failure = lambda lease, error: failed.append(error)
        r = app.test_client().post("/v1/chat/completions", headers={"Authorization": f"Bearer {token}"},
                                   json={"messages": [{"role": "user", "content": "hi"}], "stream": True})
        assert (r.status_code, r.headers.get("Retry-After")) == (503, "7")
        assert lease.released == 1
        # Busy is an answer: the node is reported busy, never failed.
        assert busy == [lease] and failed == []
        # The runner was told the admitted class's targets.
        assert StandIn.slo_headers == [slo_header(svc.classes.get("chat"))]
        assert svc.admission.snapshot()["chat"]["in_flight"] == 0
        rows = wait_until(lambda: query(tmp_path / "data" / "hearth.db", "select status, http_status from requests"),
                          message="the request's row")
        assert rows == [("error", 503)]


@pytest.mark.parametrize("path, busy_reported, failure_reported", [
    ("/crash", False, True), ("/failed", False, False), ("/busy", True, False),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_runners_error_is_reported_the_same_streamed_or_not(standin, tmp_path, standin_model, stream, path,
                                                              busy_reported, failure_reported):
    with dashboard_app(tmp_path, standin_model) as app:
        svc = services(app)
        with svc.sessions() as s:
            token, _ = create_token(s, "alice", "chat")
            s.commit()
        lease = FakeLease(standin + path)
        svc.router.acquire = lambda name: lease
        busy, failed = [], []
        svc.residency.report_busy = busy.append
        svc.residency.report_failure = lambda lease, error: failed.append(error)
        r = app.test_client().post("/v1/chat/completions", headers={"Authorization": f"Bearer {token}"},
                                   json={"messages": [{"role": "user", "content": "hi"}], "stream": stream})
        assert r.status_code == (503 if path == "/busy" else 500)
        assert r.get_json()["error"]["message"] == "no"
        assert lease.released == 1
        # A crash (a 5xx of the runner's own) is a failure of the node; its generation failure and
        # its busy answer are not.
        assert busy == ([lease] if busy_reported else [])
        assert failed == (["no"] if failure_reported else [])


def test_a_native_answer_counts_its_tokens_in_llama_servers_fields():
    outcome = relay.RelayOutcome()
    relay.read_summary({"content": "x", "stop": True, "tokens_evaluated": 12, "tokens_predicted": 3,
                        "timings": {"cache_n": 8, "predicted_n": 3}}, outcome)
    assert outcome.usage == {"prompt_tokens": 12, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 8}}


class RunningTimings(StandIn):
    """A stream as the hearth runner writes it with timings_per_token: running timings last in each chunk."""

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        events = [ROLE]
        for n in range(1, 4):
            events.append({**TOKEN, "timings": {"cache_n": 2, "prompt_n": 9, "predicted_n": n, "predicted_ms": 1.5}})
        events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                       "usage": {"prompt_tokens": 11, "completion_tokens": 3}, "timings": {"predicted_n": 3}})
        head = b"".join(b"data: " + json.dumps(ev).encode() + b"\n\n" for ev in events[:-1])
        tail = b"data: " + json.dumps(events[-1]).encode() + b"\n\n" + b"data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(head) + len(tail)))
        self.end_headers()
        self.wfile.write(head)
        self.wfile.flush()
        # The usage chunk comes only when the test says: a client can leave before it.
        RunningTimings.finish.wait(10)
        try:
            self.wfile.write(tail)
        except OSError:
            pass


@pytest.fixture
def timed_runner():
    RunningTimings.finish = threading.Event()
    server = ThreadingHTTPServer(("127.0.0.1", 0), RunningTimings)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    relay.close_idle()
    server.shutdown()
    server.server_close()


def test_running_timings_the_gateway_asked_for_are_taken_out_and_a_cut_stream_is_counted(timed_runner):
    stream, outcome = relay.open_stream(timed_runner, {"stream": True})
    chunks = relay.stream_chunks(stream, outcome, strip_timings=True)
    seen = b""
    while b"Hi" not in seen or seen.count(b"Hi") < 2:
        seen += next(chunks)
    chunks.close()  # the client went away before the usage chunk
    RunningTimings.finish.set()
    payloads = [json.loads(line[6:]) for line in seen.split(b"\n") if line.startswith(b"data: {")]
    assert not any("timings" in p for p in payloads)
    assert outcome.usage == {}
    relay.count_so_far(outcome)
    # The last running count seen: the whole prompt (2 cached + 9 computed) and the tokens generated so far.
    assert outcome.usage["prompt_tokens"] == 11 and outcome.usage["completion_tokens"] >= 2
    assert outcome.usage["prompt_tokens_details"] == {"cached_tokens": 2}
    # Read to the end, the last chunk keeps its timings (the runner's final figures) and its usage wins.
    stream, outcome = relay.open_stream(timed_runner, {"stream": True})
    RunningTimings.finish.set()
    whole = b"".join(relay.stream_chunks(stream, outcome, strip_timings=True))
    assert whole.count(b'"timings"') == 1 and whole.endswith(b"data: [DONE]\n\n")
    relay.count_so_far(outcome)
    assert outcome.usage == {"prompt_tokens": 11, "completion_tokens": 3}


def test_a_native_piece_counts_itself():
    outcome = relay.RelayOutcome(counted=json.dumps({"content": "x", "tokens_predicted": 4,
                                                     "tokens_evaluated": 12}).encode())
    relay.count_so_far(outcome)
    assert outcome.usage == {"prompt_tokens": 12, "completion_tokens": 4}


class Cut:
    """A runner's stream as the relay reads it, cut where the test says (read1 returns what has arrived)."""

    def __init__(self, parts: list[bytes]):
        self.parts = parts

    def chunks(self):
        yield from self.parts

    def close(self):
        pass


def test_token_events_pass_as_bytes_cut_anywhere_with_their_timings_out():
    events = [ROLE] + [{**TOKEN, "timings": {"cache_n": 0, "prompt_n": 3, "predicted_n": n}} for n in (1, 2, 3)]
    events.append(TOKEN)  # a parsed answer's second delta of one token: no count of its own
    body = b"".join(b"data: " + json.dumps(ev).encode() + b"\n\n" for ev in events)
    # The role and the first token whole, then a burst of two token events cut inside the second, CRLF lines.
    first = body.index(b"\n\n", body.index(b'"Hi"')) + 2
    rest = body[first:].replace(b"\n", b"\r\n")
    outcome = relay.RelayOutcome()
    # The last read ends the third token's event and holds the fourth, which has no count.
    cut = rest.rindex(b'"timings"') - 10
    out = list(relay.stream_chunks(Cut([body[:first], rest[:cut], rest[cut:]]), outcome, strip_timings=True))
    whole = b"".join(out)
    assert b'"timings"' not in whole and b"\r" not in whole
    assert [json.loads(line[6:]) for line in whole.split(b"\n") if line.startswith(b"data: ")] == [
        ROLE, TOKEN, TOKEN, TOKEN, TOKEN]
    # The cut event went out once it was whole, and the last running count is the third token's.
    assert len(out) == 3 and outcome.token_seen
    relay.count_so_far(outcome)
    assert outcome.usage["completion_tokens"] == 3


def _chunked(pieces: list[bytes], trailer: bytes = b"") -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n" + trailer + b"\r\n"


def test_a_chunked_body_is_undone_whatever_the_reads_cut():
    pieces = [b"data: " + json.dumps(ev).encode() + b"\n\n" for ev in (ROLE, TOKEN, TOKEN)] + [b"x" * 300]
    wire = _chunked(pieces, trailer=b"X-Trailer: 1\r\n").replace(b"%x\r\n" % len(pieces[1]),
                                                                  b"%x;ext=1\r\n" % len(pieces[1]), 1)
    for cut in range(1, len(wire)):
        for step in (cut, 1):  # one cut anywhere, and byte by byte from there
            body = relay.Dechunker()
            out = body.feed(wire[:cut]) + b"".join(body.feed(wire[i:i + step]) for i in range(cut, len(wire), step))
            assert out == b"".join(pieces) and body.done, (cut, step)
    for bad in (b"zz\r\nab\r\n", b"-5\r\nabcde\r\n", b"2\r\nabXX", b"9" * 2000):
        with pytest.raises(relay.http.client.HTTPException):
            relay.Dechunker().feed(bad)


class Burst(BaseHTTPRequestHandler):
    """A runner that is ahead of its relay: 20 token chunks reach the socket before the relay reads any."""

    protocol_version = "HTTP/1.1"
    events = [b"data: " + json.dumps(ev).encode() + b"\n\n" for ev in [ROLE] + [TOKEN] * 20] + [b"data: [DONE]\n\n"]

    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        self.wfile.write(head + _chunked(Burst.events))
        self.wfile.flush()


def test_what_one_read_brings_goes_on_in_one_piece_and_the_connection_is_reused():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Burst)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/chat/completions"
    try:
        for _ in range(2):
            # The stand-in writes its headers and the whole answer in one write: all of it is in once they are.
            stream, outcome = relay.open_stream(url, {"stream": True})
            out = list(relay.stream_chunks(stream, outcome))
            assert b"".join(out) == b"".join(Burst.events) and outcome.token_seen
            # Not a piece (a client write) per token: the burst goes on as it was read.
            assert len(out) <= 3
        assert sum(len(pool) for pool in relay._idle.values()) == 1  # the kept-alive connection went back, reused
    finally:
        relay.close_idle()
        server.shutdown()
        server.server_close()
