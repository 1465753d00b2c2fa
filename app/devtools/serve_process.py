"""A `hearth serve` child process on loopback, for benchmarks and end-to-end tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
from sqlalchemy import update

from app.gateway.tokens import create_token
from app.residency.supervisor import free_port
from app.store.db import open_store
from app.store.models import Model, RequestClass, utcnow
from app.store.settings import set_setting


def prepare_data(data: Path, classes: dict[str, dict] | None = None, settings: dict | None = None,
                 tokens: list[tuple[str, str, list[str]]] = (), policies: dict[str, str] | None = None) -> dict[str, str]:
    """Migrate and seed a data folder, apply class edits, settings and model policies, create tokens.

    Returns member → token.
    """
    engine, sessions = open_store(data)
    out = {}
    with sessions() as s:
        for name, values in (classes or {}).items():
            s.execute(update(RequestClass).where(RequestClass.name == name).values(**values))
        for key, value in (settings or {}).items():
            set_setting(s, key, value)
        for name, policy in (policies or {}).items():
            now = utcnow()
            s.add(Model(name=name, source="folder", policy=policy, first_seen_at=now, last_seen_at=now))
        s.commit()
        for member, default_class, allow in tokens:
            out[member], _ = create_token(s, member, default_class, allow)
    engine.dispose()
    return out


class ServeProcess:
    """A running `hearth serve` with its data folder and an httpx client."""

    def __init__(self, data: Path, models: Path, default_model: Path, log_path: Path, timeout_s: float = 120):
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
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"hearth serve exited:\n{log_path.read_text()}")
            try:
                if self.client.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"hearth serve not ready in {timeout_s} s:\n{log_path.read_text()}")
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

    def runner_url(self) -> str:
        """The loopback URL of the (single) running runner, read from its command line."""
        for p in self.runner_arbiters():
            args = p.cmdline()
            return f"http://127.0.0.1:{args[args.index('--port') + 1]}"
        raise LookupError("no runner is running")

    def serve_rss_bytes(self) -> int:
        """RSS of serve itself (arbiter + worker), runners excluded."""
        parent = psutil.Process(self.proc.pid)
        runners = {p.pid for p in self.runner_processes()}
        procs = [parent] + [p for p in parent.children(recursive=True) if p.pid not in runners]
        return sum(p.memory_info().rss for p in procs)

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
