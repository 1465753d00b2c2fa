"""Real `hearth runner` processes on loopback, serving the real Gemma 3 270M GGUF."""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from app.residency.supervisor import free_port


class Runner:
    """A started runner: its base URL, process and log."""

    def __init__(self, model: Path, log_path: Path, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "runner", "--model", str(model), "--port", str(self.port),
             "--threads", "2", "--metrics", *args],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.client = httpx.Client(base_url=self.url, timeout=120)

    def wait_ready(self, timeout_s: float = 120) -> "Runner":
        """Poll /health until the model is loaded."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"runner exited early:\n{self.log_path.read_text()}")
            try:
                if self.client.get("/health").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"runner not ready in {timeout_s} s:\n{self.log_path.read_text()}")

    def metric(self, name: str) -> float:
        """One unlabelled sample from /metrics."""
        for line in self.client.get("/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def stop(self) -> None:
        """Stop the process and close the client."""
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture(scope="session")
def start_runner(gemma_path, tmp_path_factory):
    """Factory: start a runner with extra CLI arguments; every runner is stopped at the end."""
    started: list[Runner] = []

    def start(*args: str) -> Runner:
        log_path = tmp_path_factory.mktemp("runner") / "runner.log"
        runner = Runner(gemma_path, log_path, *args).wait_ready()
        started.append(runner)
        return runner

    yield start
    for r in started:
        r.stop()


@pytest.fixture(scope="session")
def runner_class():
    """The Runner wrapper, for tests that start a runner their own way."""
    return Runner


@pytest.fixture(scope="session")
def runner(start_runner):
    """The shared runner: continuous mode, 4 slots, 2048 cells."""
    return start_runner("--ctx", "2048", "--parallel", "4")
