"""A runner's worker dies with its main process, mid-stream included, so its port can be reused at once."""

import os
import signal
import socket
import subprocess
import sys

import httpx
import psutil
import pytest

from tests.e2e.conftest import Runner
from tests.helpers import wait_until

pytestmark = pytest.mark.model


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_worker_dies_with_its_main_process_mid_stream(gemma_path, tmp_path):
    runner = Runner(gemma_path, tmp_path / "first.log", "-np", "1", "-c", "1024").wait_ready()
    worker = wait_until(lambda: psutil.Process(runner.proc.pid).children(), message="gunicorn forked no worker")[0]
    body = {"prompt": "Tell me a very long story.", "n_predict": 2000, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(base_url=runner.url, timeout=60) as client, client.stream("POST", "/completion",
                                                                                    json=body) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # the stream is under way
            os.kill(runner.proc.pid, signal.SIGKILL)
            runner.proc.wait(10)
            wait_until(lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE, timeout_s=10,
                       message=f"worker {worker.pid} outlived its main process")
        wait_until(lambda: _port_free(runner.port), timeout_s=10, message=f"port {runner.port} still held")
    finally:
        runner.stop()

    # A new runner starts on the same port.
    log = open(tmp_path / "second.log", "wb")
    second = subprocess.Popen([sys.executable, "-m", "app.cli", "runner", "--model", str(gemma_path),
                               "--port", str(runner.port), "--threads", "2", "-np", "1", "-c", "1024"],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        def healthy() -> bool:
            assert second.poll() is None, (tmp_path / "second.log").read_text()
            try:
                return httpx.get(f"{runner.url}/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, timeout_s=120, message="the second runner did not come up on the freed port")
    finally:
        second.terminate()
        second.wait(15)
        log.close()
