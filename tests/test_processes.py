"""The one readiness wait of the servers benches and tests start (app.devtools.processes.wait_healthy)."""

import subprocess
import sys

import pytest

from app.devtools.processes import wait_healthy
from app.devtools.stock_server import StockServer


def test_a_server_that_dies_while_starting_fails_at_once_with_its_log(tmp_path):
    # /bin/false stands for a llama-server that exits at once: the error names the exit, not a timeout.
    s = StockServer("/bin/false", None, log_path=tmp_path / "log", timeout_s=60)
    with pytest.raises(RuntimeError, match="llama-server exited before it was ready: code 1"):
        s.start()

def test_a_server_that_never_answers_times_out(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(TimeoutError, match="was not ready in 1 s"):
            wait_healthy("http://127.0.0.1:9", lambda: None if proc.poll() is None else "gone", 1, "sleeper")
    finally:
        proc.kill()
        proc.wait()
