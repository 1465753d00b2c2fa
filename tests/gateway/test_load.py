"""The gateway under a household's worst load, through a real `hearth serve` on the embedded model:
a flood of queued streams, half-open connections, a client that stops reading, true TTFT."""

import socket
import time

import httpx
import pytest

from tests.helpers import metric, query, wait_until

CHAT = "/v1/chat/completions"
# More than the 32 threads serve used to have, fewer than the background queue holds.
FLOOD = 40


@pytest.fixture(scope="module")
def loaded(start_shared_serve, models_dir):
    """A serve whose background class runs one request at a time and queues the rest; short client timeouts."""
    s = start_shared_serve(
        models_dir,
        classes={"background": {"max_concurrent": 1, "max_queue": 64, "queue_timeout_s": 600}},
        # One member is the whole flood here: it may hold all of the class (members' shares: tests/gateway/test_refusals.py).
        settings={"runner_ctx": 4096, "runner_parallel": 4, "runner_threads": 2,
                  "header_timeout_s": 2, "client_stall_s": 3, "member_class_share": 1.0},
        tokens=[("alice", "chat", ["voice", "background"])],
    )
    yield s
    s.stop()


def raw_request(serve, token: str, body: str, rcvbuf: int | None = None) -> socket.socket:
    """Send a whole POST to /v1/chat/completions on a fresh socket and return it unread."""
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: sets the window
    sock.connect(("127.0.0.1", serve.port))
    payload = body.encode()
    sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1:{serve.port}\r\nAuthorization: Bearer {token}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def in_flight(serve, klass: str) -> float:
    """The class's requests in flight, from serve's /metrics."""
    return metric(serve.client, f'hearth:class_in_flight{{class="{klass}"}}') or 0.0


def test_healthz_and_voice_answer_while_the_background_queue_is_full(loaded):
    token = loaded.tokens["alice"]
    body = ('{"messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 200, '
            '"ignore_eos": true, "stream": true, "hearth_class": "background"}')
    socks = [raw_request(loaded, token, body) for _ in range(FLOOD)]
    try:
        wait_until(lambda: (metric(loaded.client, 'hearth:class_waiting{class="background"}') or 0) >= FLOOD - 1,
                   timeout_s=60, message="the background queue to fill")
        with httpx.Client(base_url=loaded.url, timeout=10) as fresh:
            assert fresh.get("/healthz").status_code == 200
            assert fresh.get("/login", follow_redirects=False).status_code in (200, 302)
            voice = fresh.post(CHAT, headers={"Authorization": f"Bearer {token}", "X-Hearth-Class": "voice"},
                               json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}, timeout=120)
        assert voice.status_code == 200, voice.text
        assert voice.headers["X-Hearth-Class"] == "voice"
        # The crowd is still there: voice went past it, not after it.
        assert (metric(loaded.client, 'hearth:class_waiting{class="background"}') or 0) >= FLOOD - 5
    finally:
        for s in socks:
            s.close()
    # Clients gone: each queued request is admitted in turn, finds its client closed and ends.
    wait_until(lambda: in_flight(loaded, "background") == 0
               and (metric(loaded.client, 'hearth:class_waiting{class="background"}') or 0) == 0,
               timeout_s=600, message="the abandoned background requests to drain")


def test_half_open_connections_neither_freeze_serve_nor_stay_open(loaded):
    socks = []
    for _ in range(64):
        s = socket.create_connection(("127.0.0.1", loaded.port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
        socks.append(s)
    try:
        with httpx.Client(base_url=loaded.url, timeout=10) as fresh:
            assert fresh.get("/healthz").status_code == 200
            assert fresh.get("/v1/models", headers={"Authorization": f"Bearer {loaded.tokens['alice']}"}
                             ).status_code == 200
        # header_timeout_s (2 s here): serve closes every one of them.
        for s in socks:
            s.settimeout(30)
            assert s.recv(1024) == b""
    finally:
        for s in socks:
            s.close()


def test_a_stalled_reader_is_cancelled_and_logged_as_client_stalled(loaded):
    token = loaded.tokens["alice"]
    # Enough bytes to fill both socket buffers (serve bounds its send buffer, the client's window is
    # 4 KB): with 20 alternatives per token an event is over a kilobyte.
    body = ('{"messages": [{"role": "user", "content": "Count to ten thousand."}], "max_tokens": 1500, '
            '"ignore_eos": true, "stream": true, "logprobs": true, "top_logprobs": 20, "hearth_class": "chat"}')
    started = time.time()
    sock = raw_request(loaded, token, body, rcvbuf=4096)
    try:
        sock.settimeout(120)
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
        # ... and read nothing more: the server's writes stall, client_stall_s (3 s) ends the request.
        wait_until(lambda: query(loaded.data / "hearth.db",
                                 "select status from requests where status = 'client_stalled'"),
                   timeout_s=300, message="the stalled request to be logged")
        assert time.time() - started < 300
        wait_until(lambda: in_flight(loaded, "chat") == 0, timeout_s=30, message="the chat slot to be freed")
        (error, completion), = query(loaded.data / "hearth.db",
                                     "select error, completion_tokens from requests where status = 'client_stalled'")
        assert "client_stall_s" in error
        assert (completion or 0) < 1500
        # Closing the upstream stream cancelled the runner's sequence: its KV cells are free.
        with httpx.Client(base_url=loaded.runner_url(), headers=loaded.runner_headers()) as runner:
            wait_until(lambda: metric(runner, "hearth:kv_cells_used") == 0, timeout_s=30,
                       message="the runner to free the sequence's KV cells")
    finally:
        sock.close()


def first_token_stopwatch(serve, token: str, content: str) -> float:
    """Client's ms from sending a streamed request to the first event with generated content."""
    t0 = time.perf_counter()
    with serve.client.stream("POST", CHAT, headers={"Authorization": f"Bearer {token}"},
                             json={"messages": [{"role": "user", "content": content}], "max_tokens": 4,
                                   "stream": True}) as r:
        assert r.status_code == 200
        first = None
        for line in r.iter_lines():
            if first is None and '"content": "' in line and '"content": ""' not in line:
                first = (time.perf_counter() - t0) * 1000
    assert first is not None
    return first


def test_long_prompt_streamed_ttft_is_stored_as_the_client_saw_it(loaded):
    token = loaded.tokens["alice"]
    prompt = " ".join(f"item{i % 97} is on shelf {i % 13}." for i in range(170)) + " Where is item5?"
    client_ms = first_token_stopwatch(loaded, token, prompt)

    def stored():
        rows = query(loaded.data / "hearth.db", "select ttft_ms, ttft_kind, prompt_tokens from requests "
                     "where stream = 1 and class_name = 'chat' and prompt_tokens > 1000 order by id desc limit 1")
        return rows[0] if rows else None

    ttft_ms, kind, prompt_tokens = wait_until(stored, timeout_s=30, message="the request's row")
    assert kind == "delivered"
    # The role chunk comes at once; the first token only after the whole prompt's prefill.
    assert abs(ttft_ms - client_ms) <= 0.05 * client_ms, (ttft_ms, client_ms, prompt_tokens)
