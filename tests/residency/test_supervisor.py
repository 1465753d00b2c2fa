"""Runner processes on the real Gemma GGUF: start, health, stop, crashes, parent death; remote nodes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import psutil
import pytest

from app.residency.remote import RemoteNode, parse_load
from app.residency.runner_spec import RunnerSpec
from app.residency.supervisor import LOG_LINES, RunnerProcess, RunnerStartFailed, free_port
from tests.helpers import wait_until

LLAMA_SERVER = Path.home() / ".cache/hearth/llama-tools/0.3.36/bin/llama-server"
needs_llama_server = pytest.mark.skipif(not LLAMA_SERVER.is_file(),
                                        reason=f"stock llama-server not built at {LLAMA_SERVER} "
                                               "(scripts/build_llama_tools.sh)")


def small_spec(path, name: str = "gemma", **kw) -> RunnerSpec:
    """A runner small enough to start in seconds on two cores."""
    return RunnerSpec(model_name=name, model_path=str(path), n_ctx=512, parallel=2, n_batch=512, threads=2, **kw)


def gone(pid: int) -> bool:
    """No such process, or only a zombie nobody has reaped yet."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still running after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [p for p in pids if not gone(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


class Exits:
    """Records on_exit calls."""

    def __init__(self):
        self.calls: list[tuple[int, bool]] = []
        self.event = threading.Event()

    def __call__(self, runner, returncode, expected):
        self.calls.append((returncode, expected))
        self.event.set()


def test_start_health_stop_leaves_no_process(gemma_path):
    exits = Exits()
    runner = RunnerProcess(small_spec(gemma_path), on_exit=exits)
    try:
        runner.start(timeout_s=120)
        assert runner.alive and runner.url.startswith("http://127.0.0.1:")
        assert httpx.get(f"{runner.url}/health").status_code == 200
        pids = runner.pids()
        assert pids[0] == runner.pid and len(pids) == 2  # gunicorn arbiter + its one worker
        assert runner.cold_start_ms > 0
        assert runner.rss_bytes() > 100 * 2**20
        assert any("hearth runner" in line for line in runner.log_tail(50))
        node = RemoteNode(runner.url, "same box")
        assert node.healthy() and node.load() == 0
    finally:
        runner.stop(timeout_s=10)
    assert wait_gone(pids, 1) == []
    assert not runner.alive and runner.rss_bytes() == 0
    assert exits.event.wait(5) and exits.calls == [(0, True)]
    assert not node.healthy() and node.load() is None


@pytest.mark.parametrize("victim", ["worker", "arbiter"])
def test_killed_runner_reports_an_unexpected_exit_and_leaves_nothing(gemma_path, victim):
    exits = Exits()
    runner = RunnerProcess(small_spec(gemma_path), on_exit=exits).start()
    pids = runner.pids()
    try:
        os.kill(pids[1] if victim == "worker" else pids[0], signal.SIGKILL)
        assert exits.event.wait(10), runner.log_tail(20)
    finally:
        runner.stop()
    [(returncode, expected)] = exits.calls
    assert expected is False
    # A supervised arbiter exits 70 when its worker dies instead of silently reloading the model.
    assert returncode == (70 if victim == "worker" else -signal.SIGKILL)
    assert wait_gone(pids, 3) == []


CHILD = """
import json, sys, time
from app.residency.runner_spec import RunnerSpec
from app.residency.supervisor import RunnerProcess
spec = RunnerSpec(model_name="gemma", model_path=sys.argv[1], n_ctx=512, parallel=2, threads=2,
                  kind=sys.argv[2], binary_path=sys.argv[3] or None)
runner = RunnerProcess(spec).start(120)
print(json.dumps(runner.pids()), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("kind", ["hearth", pytest.param("llama-server", marks=needs_llama_server)])
def test_runner_dies_with_the_process_that_started_it(gemma_path, kind):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(gemma_path), kind,
                              str(LLAMA_SERVER) if kind == "llama-server" else ""],
                             stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line, "the child exited before its runner was ready"
        pids = json.loads(line)
        assert pids and all(not gone(p) for p in pids)
        child.kill()
        child.wait()
        # llama-server has no --parent-pid: only the parent-death signal stops it.
        assert wait_gone(pids, 5) == []
    finally:
        child.kill()
        child.wait()
        child.stdout.close()


def test_runner_exits_when_its_parent_pid_is_gone(gemma_path, tmp_path):
    # Started by hand, without the supervisor's parent-death signal: only the runner's watcher acts.
    parent = subprocess.Popen(["sleep", "600"])
    port = free_port()
    log_path = tmp_path / "runner.log"
    with open(log_path, "wb") as log:
        runner = subprocess.Popen([sys.executable, "-m", "app.cli", "runner", "--model", str(gemma_path),
                                   "--port", str(port), "--ctx", "512", "--parallel", "2", "--threads", "2",
                                   "--parent-pid", str(parent.pid)],
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        def ready():
            assert runner.poll() is None, log_path.read_text()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(ready, 120, lambda: f"runner not ready:\n{log_path.read_text()}", every_s=0.2)
        pids = [runner.pid] + [c.pid for c in psutil.Process(runner.pid).children(recursive=True)]
        parent.kill()
        parent.wait()
        # Nobody signals the runner: it stops itself, cleanly, because it saw its parent go.
        assert runner.wait(30) == 0
        assert f"parent process {parent.pid} is gone: shutting down" in log_path.read_text()
        assert wait_gone(pids, 5) == []
    finally:
        parent.kill()
        parent.wait()
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
            runner.wait()


def test_bad_model_file_fails_fast_with_the_reason(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a GGUF file" * 100)
    runner = RunnerProcess(small_spec(junk, name="junk"))
    with pytest.raises(RunnerStartFailed) as err:
        runner.start(timeout_s=60)
    assert "could not load" in err.value.reason
    assert err.value.log_tail and "could not load" in str(err.value)
    assert not runner.alive


def write_script(path: Path, body: str) -> str:
    """An executable Python script standing in for a runner binary."""
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)
    return str(path)


def test_log_is_a_ring_buffer_and_an_early_exit_fails_fast(tmp_path):
    binary = write_script(tmp_path / "chatty", "for i in range(1000): print('line', i)\nraise SystemExit(3)\n")
    runner = RunnerProcess(RunnerSpec("chatty", "x.gguf", kind="llama-server", binary_path=binary))
    with pytest.raises(RunnerStartFailed) as err:
        runner.start(timeout_s=60)
    # Failing fast: the exit itself ends the start (running out the start's timeout would be another reason).
    assert err.value.reason == "runner exited with code 3 while loading"
    assert len(err.value.log_tail) == LOG_LINES and err.value.log_tail[-1] == "line 999"
    assert runner.log_tail(3) == ["line 997", "line 998", "line 999"]


STUBBORN = """
import http.server, os, signal, subprocess, sys
# Ignores SIGTERM, but notes each one it gets (flushed at once) on stdout.
signal.signal(signal.SIGTERM, lambda *_: os.write(1, b"got SIGTERM\\n"))
subprocess.Popen(["sleep", "600"])  # a child in the same process group
port = int(sys.argv[sys.argv.index("--port") + 1])

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def test_stop_kills_a_runner_that_ignores_sigterm_and_its_children(tmp_path):
    binary = write_script(tmp_path / "stubborn", STUBBORN)
    runner = RunnerProcess(RunnerSpec("stubborn", "x.gguf", kind="llama-server", binary_path=binary)).start(30)
    pids = wait_until(lambda: len(runner.pids()) >= 2 and runner.pids(), 10, "the stub's child never started")
    runner.stop(timeout_s=1)
    # SIGTERM first (the runner saw it and went on), then SIGKILL for the process and its child.
    assert "got SIGTERM" in runner.log_tail(5)
    assert runner.returncode == -signal.SIGKILL
    assert wait_gone(pids, 1) == []


@needs_llama_server
def test_llama_server_kind(gemma_path):
    runner = RunnerProcess(small_spec(gemma_path, kind="llama-server", binary_path=str(LLAMA_SERVER)))
    try:
        runner.start(timeout_s=120)
        pids = runner.pids()
        assert runner.rss_bytes() > 50 * 2**20
        node = RemoteNode(runner.url, "stock")
        assert node.healthy() and node.load() == 0
        r = httpx.post(f"{runner.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        runner.stop()
    assert wait_gone(pids, 1) == []


def test_parse_load_reads_llama_server_and_vllm_names():
    llama = ("# HELP llamacpp:requests_processing Number of requests processing.\n"
             "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 2\n"
             "llamacpp:requests_deferred 3\nllamacpp:kv_cache_tokens 100\n")
    assert parse_load(llama) == 5
    vllm = ('vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0 1700000000000\n')
    assert parse_load(vllm) == 7
    assert parse_load("process_cpu_seconds_total 3\n") is None
    with pytest.raises(ValueError):
        parse_load("<html>502 Bad Gateway</html>")


class FakeVllm(BaseHTTPRequestHandler):
    """No /health, only /v1/models and vLLM's metric names, as an OpenAI-compatible server may be."""

    def do_GET(self):
        body = {"/v1/models": b'{"data": []}', "/metrics": b"vllm:num_requests_running 1\n"
                                                            b"vllm:num_requests_waiting 2\n"}.get(self.path)
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args):
        pass


def test_remote_node_without_health_endpoint():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeVllm)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        node = RemoteNode(f"http://127.0.0.1:{server.server_port}/", "vllm")
        assert node.url == f"http://127.0.0.1:{server.server_port}"
        assert node.healthy() and node.load() == 3
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert not node.healthy() and node.load() is None


class ProxyErrorPage(BaseHTTPRequestHandler):
    """A /metrics that answers 200 with the server's `body`: an HTML page, as a misconfigured reverse proxy gives."""

    def do_GET(self):
        body = self.server.body
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_remote_node_with_unreadable_metrics_warns_once_per_streak(caplog):
    server = ThreadingHTTPServer(("127.0.0.1", 0), ProxyErrorPage)
    server.body = b"<html><body>Welcome to nginx!</body></html>"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        node = RemoteNode(f"http://127.0.0.1:{server.server_port}", "proxied")
        with caplog.at_level("WARNING", logger="app.residency.remote"):
            assert node.load() is None and node.load() is None
        warnings = [r for r in caplog.records if "proxied" in r.getMessage()]
        assert len(warnings) == 1 and "unreadable" in warnings[0].getMessage()
        server.body = b"llamacpp:requests_processing 1\n"
        assert node.load() == 1
        server.body = b"<html></html>"
        with caplog.at_level("WARNING", logger="app.residency.remote"):
            assert node.load() is None
        assert len([r for r in caplog.records if "proxied" in r.getMessage()]) == 2
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
