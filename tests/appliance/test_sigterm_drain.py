"""`docker stop` while an answer is streaming: serve stops its runners itself, before gunicorn's
arbiter would SIGKILL the worker, and well inside the compose stop_grace_period."""

import inspect
import signal
import sqlite3
import threading
import time

import httpx
import psutil

from app.devtools.serve_process import ServeProcess, prepare_data
from app.residency.supervisor import RunnerProcess
from app.serve import DRAIN_S, GRACEFUL_TIMEOUT_S


def test_drain_and_runner_stop_fit_inside_the_kill_deadline():
    runner_stop_s = inspect.signature(RunnerProcess.stop).parameters["timeout_s"].default
    assert DRAIN_S + runner_stop_s < GRACEFUL_TIMEOUT_S


def test_sigterm_during_a_long_stream_leaves_no_runner(tmp_path, gemma_path):
    data, models = tmp_path / "data", tmp_path / "models"
    models.mkdir()
    tokens = prepare_data(data, settings={"runner_ctx": 4096, "runner_parallel": 2, "runner_threads": 2},
                          tokens=[("alice", "chat", [])])
    serve = ServeProcess(data, models, gemma_path, tmp_path / "serve.log")
    lines, ended = [], []
    try:
        def stream():
            body = {"prompt": "Tell a long story.", "max_tokens": 2000, "ignore_eos": True, "stream": True}
            try:
                with httpx.Client(base_url=serve.url, timeout=60) as client, client.stream(
                        "POST", "/v1/completions", headers={"Authorization": f"Bearer {tokens['alice']}"},
                        json=body) as response:
                    lines.extend(line for line in response.iter_lines() if line.startswith("data: "))
            except httpx.HTTPError as exc:
                ended.append(exc)
            ended.append("end")

        reader = threading.Thread(target=stream)
        reader.start()
        deadline = time.monotonic() + 120
        while len(lines) < 3 and not ended:
            assert time.monotonic() < deadline, serve.log_path.read_text()
            time.sleep(0.05)
        # 2000 tokens take far longer than the drain: the answer is still streaming at SIGTERM.
        runners = serve.runner_processes()
        assert runners
        started = time.monotonic()
        serve.proc.send_signal(signal.SIGTERM)
        serve.proc.wait(60)
        elapsed_s = time.monotonic() - started
        left = [p for p in runners if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not left, [p.cmdline() for p in left]  # stopped by serve, not by their parent watchers
        assert serve.proc.returncode == 0
        assert DRAIN_S <= elapsed_s < GRACEFUL_TIMEOUT_S, serve.log_path.read_text()
        reader.join(10)
        assert ended, "the client's stream did not end"
        with sqlite3.connect(data / "hearth.db") as db:
            assert ("unload",) in db.execute("select event from residency_events").fetchall()
    finally:
        serve.stop()
