"""A `hearth serve` child process on loopback, for benchmarks and end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
from sqlalchemy import update

from app.devtools.processes import stop_process
from app.gateway.tokens import create_token
from app.residency.supervisor import LLAMA_KEY_ENV, RUNNER_KEY_ENV, free_port
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


def runner_headers_of(pid: int) -> dict[str, str]:
    """The Authorization header for the runner process `pid`, from the key serve put in its environment.

    Only the user who runs serve (or root) can read another process's environment: the benchmarks and
    tests that call serve's runners directly run as that user.
    """
    env = psutil.Process(pid).environ()
    key = env.get(RUNNER_KEY_ENV) or env.get(LLAMA_KEY_ENV)
    return {"Authorization": f"Bearer {key}"} if key else {}


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
        self.client = httpx.Client(base_url=self.url, timeout=300)  # before the process: nothing slow between
        # A process group of its own: stop() can end whatever serve started (its worker, its runners) even
        # when serve itself was killed before it could.
        self.proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--bind", f"127.0.0.1:{self.port}"],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            self._wait_ready(timeout_s)
        except BaseException:  # not ready, or interrupted while waiting (Ctrl-C, SIGTERM): never left running
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"hearth serve exited:\n{self.log_path.read_text()}")
            try:
                if self.client.get("/healthz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"hearth serve not ready in {timeout_s} s:\n{self.log_path.read_text()}")
            time.sleep(0.05)  # a connection refused costs microseconds: look often, serve is up in ~1 s

    def runner_commands(self) -> list[tuple[psutil.Process, str]]:
        """Live runner processes started by this serve (arbiters and workers), each with its command line.

        A runner that exits while the list is read (gone, or a zombie its parent has not reaped) is left
        out instead of raising: the command line is read once, here.
        """
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        out = []
        for p in kids:
            try:
                command = " ".join(p.cmdline())
            except psutil.NoSuchProcess:  # ZombieProcess included
                continue
            if "runner" in command:
                out.append((p, command))
        return out

    def runner_processes(self) -> list[psutil.Process]:
        """Runner processes started by this serve (arbiters and workers)."""
        return [p for p, _ in self.runner_commands()]

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

    def runner_headers(self) -> dict[str, str]:
        """What a request straight to the (single) running runner must carry: the key serve gave it."""
        for p in self.runner_arbiters():
            return runner_headers_of(p.pid)
        raise LookupError("no runner is running")

    def serve_rss_bytes(self) -> int:
        """RSS of serve itself (arbiter + worker), runners excluded."""
        parent = psutil.Process(self.proc.pid)
        runners = {p.pid for p in self.runner_processes()}
        procs = [parent] + [p for p in parent.children(recursive=True) if p.pid not in runners]
        return sum(p.memory_info().rss for p in procs)

    def stop(self) -> None:
        """SIGTERM and wait; the runners go with it (any left once serve is gone are killed: a serve killed after
        its drain deadline leaves its worker and runners without their parent)."""
        self.client.close()
        if self.proc.poll() is None:
            try:
                kids = psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                kids = []
            stop_process(self.proc)
            _, alive = psutil.wait_procs(kids, timeout=10)
            for p in alive:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # anything of its group still there (started after `kids`)
            except ProcessLookupError:
                pass
        self._log.close()


class BenchServe:
    """A `hearth serve` with default settings in a data folder of its own, for `hearth bench replay --serve`.

    stop() ends it and removes the folder; runner_url() is its (one) runner, once a request loaded it.
    """

    def __init__(self, model_path: str, timeout_s: float = 180, settings: dict | None = None):
        from app.store.seed import DEFAULT_CLASSES

        self._tmp = tempfile.TemporaryDirectory(prefix="hearth-replay-serve-")
        root = Path(self._tmp.name)
        data, models = root / "data", root / "models"
        models.mkdir()
        names = [c["name"] for c in DEFAULT_CLASSES]
        # Nothing changed from the defaults but one member's share of a class: the bench's one token stands for
        # the whole household, so it may use every class, and hold all of a class's places (member_class_share 1).
        # `settings`: what one arm of the bench changes (e.g. runner_args for speculation off), before serve starts.
        self.token = prepare_data(data, settings={"member_class_share": 1.0, **(settings or {})},
                                  tokens=[("bench", names[0], names)])["bench"]
        try:
            self.serve = ServeProcess(data, models, Path(model_path), root / "serve.log", timeout_s)
        except BaseException:
            self._tmp.cleanup()
            raise
        self.headers = {"Authorization": f"Bearer {self.token}"}

    @property
    def url(self) -> str:
        return self.serve.url

    @property
    def pid(self) -> int:
        return self.serve.proc.pid

    def model_name(self) -> str:
        """The name serve lists its default model under."""
        r = httpx.get(f"{self.url}/v1/models", headers=self.headers, timeout=30)
        r.raise_for_status()
        return r.json()["data"][0]["id"]

    def runner_url(self) -> str:
        return self.serve.runner_url()

    def runner_headers(self) -> dict[str, str]:
        """The key of its runner, for the requests the bench sends straight to it."""
        return self.serve.runner_headers()

    def stop(self) -> None:
        try:
            self.serve.stop()
        finally:
            self._tmp.cleanup()


def serve_target(c, arm: str | None = None, timeout_s: float = 180):
    """bench replay's `serve` target (app.verdict.targets.Target): the gateway, a class named per request.

    arm: a speculation arm (app.verdict.spec); None or auto keeps serve's default settings."""
    from app.verdict.spec import serve_settings
    from app.verdict.targets import Target

    proc = BenchServe(c.model_path, timeout_s, settings=serve_settings(arm, c.model_name))
    try:
        model = proc.model_name()
    except BaseException:
        proc.stop()
        raise
    return Target("serve", proc.url, "serve", model, pid=proc.pid, threads=c.threads, process=proc,
                  headers=proc.headers)
