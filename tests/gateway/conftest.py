"""A real `hearth serve` on loopback with real runners on the real Gemma GGUF, plus tokens."""

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from sqlalchemy import update

from app.gateway.tokens import create_token
from app.settings import set_setting
from app.telemetry.models import RequestClass
from app.telemetry.store import open_store


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    """A running `hearth serve` with its data folder and an httpx client."""

    def __init__(self, data: Path, models: Path, default_model: Path, log_path: Path):
        self.data = data
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        env = {**os.environ, "HEARTH_DATA": str(data), "HEARTH_MODELS_DIR": str(models),
               "HEARTH_DEFAULT_MODEL": str(default_model), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--bind", f"127.0.0.1:{self.port}"],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.client = httpx.Client(base_url=self.url, timeout=300)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"hearth serve exited:\n{log_path.read_text()}")
            try:
                if self.client.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)

    def runner_processes(self) -> list[psutil.Process]:
        """Runner processes started by this serve (arbiters and workers)."""
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        return [p for p in kids if "runner" in " ".join(p.cmdline())]

    def runner_arbiters(self) -> list[psutil.Process]:
        """One process per running runner (its gunicorn arbiter, not the worker forked from it)."""
        runners = self.runner_processes()
        pids = {p.pid for p in runners}
        return [p for p in runners if p.ppid() not in pids]

    def stop(self) -> None:
        """SIGTERM and wait; the runners go with it."""
        self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def prepare_data(data: Path, classes: dict[str, dict] | None = None, settings: dict | None = None,
                 tokens: list[tuple[str, str, list[str]]] = ()) -> dict[str, str]:
    """Migrate and seed the store, apply class edits and settings, create tokens; returns member → token."""
    engine, sessions = open_store(data)
    out = {}
    with sessions() as s:
        for name, values in (classes or {}).items():
            s.execute(update(RequestClass).where(RequestClass.name == name).values(**values))
        for key, value in (settings or {}).items():
            set_setting(s, key, value)
        s.commit()
        for member, default_class, allow in tokens:
            out[member], _ = create_token(s, member, default_class, allow)
    engine.dispose()
    return out


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory, gemma_path):
    """A models folder holding a second model (a copy of Gemma under another name) and a broken file."""
    d = tmp_path_factory.mktemp("models")
    # A copy, not a link: the catalog lists one file once, however many names it has.
    shutil.copyfile(gemma_path, d / "gemma-b.gguf")
    (d / "notes.gguf").write_bytes(b"not a model at all" * 10)
    return d


@pytest.fixture(scope="session")
def serve(tmp_path_factory, gemma_path, models_dir):
    """The shared serve: small runners, a tight 'coding' class for queue tests, tokens."""
    data = tmp_path_factory.mktemp("serve-data")
    tokens = prepare_data(
        data,
        classes={"coding": {"max_concurrent": 1, "max_queue": 1, "queue_timeout_s": 60},
                 "documents": {"max_concurrent": 1, "max_queue": 4, "queue_timeout_s": 0.5}},
        settings={"runner_ctx": 1024, "runner_parallel": 4, "runner_threads": 2},
        tokens=[("alice", "chat", ["voice", "coding", "documents"]), ("kid", "voice", [])],
    )
    s = Serve(data, models_dir, gemma_path, data / "serve.log")
    s.tokens = tokens
    yield s
    s.stop()
