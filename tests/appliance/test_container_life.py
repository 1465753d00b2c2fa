"""A container's life without a container engine: started as root with PUID/PGID through the
entrypoint, first run, a model loaded by a request, a backup taken while requests are written,
SIGTERM within the compose stop_grace_period, restore, restart with the same secrets."""

import os
import signal
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from app.residency.supervisor import free_port
from tests.helpers import wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown and setuid need root")
REPO = Path(__file__).resolve().parents[2]


def stop_grace_period_s() -> float:
    """docker-compose.yml's stop_grace_period in seconds (a "30s" / "1m" / "1m30s" duration)."""
    text = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["hearth"]["stop_grace_period"]
    seconds, number = 0.0, ""
    for ch in text:
        if ch.isdigit() or ch == ".":
            number += ch
        else:
            seconds += float(number) * {"h": 3600, "m": 60, "s": 1}[ch]
            number = ""
    return seconds


class Container:
    """`python -m app.entrypoint` as the image's ENTRYPOINT runs it, with its log in a file."""

    def __init__(self, env: dict, log_path: Path):
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(["python", "-m", "app.entrypoint"], env=env, cwd="/",
                                         stdout=log, stderr=subprocess.STDOUT)
        self.client = httpx.Client(base_url=f"http://{env['HEARTH_BIND']}", timeout=120)
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, self.log()
            try:
                if self.client.get("/healthz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"not healthy in 120 s:\n{self.log()}"
            time.sleep(0.2)

    def wait_default_model(self, timeout_s: float = 300) -> None:
        """Waits until /healthz no longer reports the default model's background assembly."""
        deadline = time.monotonic() + timeout_s
        while "default_model" in (health := self.client.get("/healthz").json()):
            assert health["default_model"]["state"] != "failed", health
            assert time.monotonic() < deadline, f"default model not ready in {timeout_s} s:\n{self.log()}"
            time.sleep(0.2)

    def log(self) -> str:
        """Everything the container printed so far."""
        return self.log_path.read_text(errors="replace")

    def runners(self) -> list[psutil.Process]:
        """The runner processes below the serve process."""
        kids = psutil.Process(self.proc.pid).children(recursive=True)
        return [p for p in kids if "runner" in " ".join(p.cmdline())]

    def sigterm(self, grace_s: float) -> float:
        """`docker stop`: SIGTERM, then the seconds until the process exited (fails past grace_s)."""
        self.client.close()
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"still running {grace_s} s after SIGTERM (docker would SIGKILL it):\n{self.log()}")
        return time.monotonic() - started


def entrypoint_command(args, env):
    """`docker exec hearth python -m app.entrypoint ARGS`: runs as PUID:PGID like the server."""
    return subprocess.run(["python", "-m", "app.entrypoint", *args], check=False, env=env, cwd="/",
                          capture_output=True, text=True, timeout=120)


# embedded_chunks: the first run assembles the embedded model from them, as a fresh container does.
def test_container_life(open_tmp, throwaway_ids, unprivileged_env, embedded_chunks):
    uid, gid = throwaway_ids
    grace_s = stop_grace_period_s()
    data, models = open_tmp / "data", open_tmp / "models"  # data does not exist yet
    models.mkdir()
    env = {**unprivileged_env, "PUID": str(uid), "PGID": str(gid), "HEARTH_DATA": str(data),
           "HEARTH_MODELS_DIR": str(models), "HEARTH_BIND": f"127.0.0.1:{free_port()}", "PYTHONUNBUFFERED": "1"}
    box = Container(env, open_tmp / "container.log")
    try:
        # First run: the data folder created for the user, the store created and migrated, the server
        # up while it assembles the model in the background, the secrets generated privately, the
        # admin sent to /setup.
        box.wait_default_model()
        log = box.log()
        assert "store created and migrated" in log and "assembles it in the background" in log
        assert "default model ready" in log
        assert psutil.Process(box.proc.pid).uids().real == uid
        for path in [data, data / "hearth.db", data / "models" / "gemma-3-270m-q4_k_m.gguf"]:
            assert (path.stat().st_uid, path.stat().st_gid) == (uid, gid), path
        key = data / "secrets" / "session_key"
        assert key.stat().st_uid == uid and key.stat().st_mode & 0o777 == 0o600
        first_key = key.read_bytes()
        assert box.client.get("/").headers["location"].endswith("/setup")
        # The log says where to go, and gives the one-time setup code kept privately in the data folder.
        code_file = data / "secrets" / "setup_code"
        assert code_file.stat().st_uid == uid and code_file.stat().st_mode & 0o777 == 0o600
        assert f"/setup in a browser and enter the setup code {code_file.read_text().strip()}" in log
        assert entrypoint_command(["healthcheck"], env).returncode == 0
        created = entrypoint_command(["hearth", "token", "create", "--member", "alice", "--class", "chat"], env)
        assert created.returncode == 0, created.stderr
        token = created.stdout.split()[0]

        # A model loaded through a request, then requests written while a backup is taken.
        hdr = {"Authorization": f"Bearer {token}"}
        body = {"prompt": "Hi", "max_tokens": 2}
        assert box.client.post("/v1/completions", headers=hdr, json=body).status_code == 200
        runners = box.runners()
        assert runners and all(p.uids().real == uid for p in runners)
        stop, answered = threading.Event(), []

        def keep_writing():
            with httpx.Client(base_url=str(box.client.base_url), timeout=120) as client:
                while not stop.is_set():
                    answered.append(client.post("/v1/completions", headers=hdr, json=body).status_code)

        writers = [threading.Thread(target=keep_writing) for _ in range(2)]
        for t in writers:
            t.start()
        wait_until(lambda: len(answered) >= 4, 60, "the writers got no answers")
        backup = data / "hearth-backup.db"
        done = entrypoint_command(["hearth", "backup", str(backup)], env)
        # Rows kept arriving after the backup, so the live store outgrows the copy.
        after_backup = len(answered)
        wait_until(lambda: len(answered) >= after_backup + 2, 60, "no answer after the backup")
        stop.set()
        for t in writers:
            t.join()
        assert done.returncode == 0, done.stderr
        assert answered and set(answered) == {200}
        assert backup.stat().st_uid == uid

        elapsed_s = box.sigterm(grace_s)
        assert box.proc.returncode == 0, box.log()
        assert elapsed_s < grace_s
        _, alive = psutil.wait_procs(runners, timeout=0.5)
        assert not alive, [p.cmdline() for p in alive]

        with sqlite3.connect(f"file:{backup}?mode=ro", uri=True) as db:
            assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            backed_up = db.execute("select count(*) from requests").fetchone()[0]
        with sqlite3.connect(data / "hearth.db") as db:
            live = db.execute("select count(*) from requests").fetchone()[0]
            assert ("unload",) in db.execute("select event from residency_events").fetchall()
        assert 1 <= backed_up <= live

        restored = open_tmp / "restored"
        done = entrypoint_command(["hearth", "restore", str(backup)], {**env, "HEARTH_DATA": str(restored)})
        assert done.returncode == 0, done.stderr
        with sqlite3.connect(restored / "hearth.db") as db:
            assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            assert db.execute("select count(*) from requests").fetchone()[0] == backed_up

        # Restart: nothing re-assembled, nothing to chown, the same secrets.
        box = Container(env, open_tmp / "container-2.log")
        log = box.log()
        assert "entries changed" not in log and "assembling" not in log
        assert key.read_bytes() == first_key
        assert box.sigterm(grace_s) < grace_s and box.proc.returncode == 0
    finally:
        if box.proc.poll() is None:
            box.proc.kill()
            box.proc.wait()
