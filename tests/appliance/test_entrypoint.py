"""The container entrypoint without a container: PUID/PGID, privilege drop, writability, first run."""

import http.server
import os
import subprocess
import threading

import pytest

from app import entrypoint
from app.entrypoint import (
    EntrypointError,
    first_run,
    ids_from_env,
)
from app.residency import default_model
from app.residency.supervisor import free_port

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown and setuid need root")


def run_entrypoint(args, env, **popen):
    """`python -m app.entrypoint ARGS` in a subprocess (env must hold unprivileged_env); returns it done."""
    return subprocess.run(["python", "-m", "app.entrypoint", *args], check=False, env=env, cwd="/",
                          capture_output=True, text=True, timeout=60, **popen)


def test_ids_default_to_the_image_user_and_refuse_names():
    assert ids_from_env({}) == (1000, 1000)
    assert ids_from_env({"PUID": "99", "PGID": " 100 "}) == (99, 100)
    with pytest.raises(EntrypointError, match="PUID='nobody' is not a numeric id"):
        ids_from_env({"PUID": "nobody"})
    with pytest.raises(EntrypointError, match="PGID"):
        ids_from_env({"PUID": "1", "PGID": "-5"})


@needs_root
def test_root_start_gives_data_to_puid_and_runs_the_command_as_that_user(open_tmp, throwaway_ids, unprivileged_env):
    uid, gid = throwaway_ids
    data = open_tmp / "data"
    (data / "models").mkdir(parents=True)
    (data / "hearth.db").write_bytes(b"x")
    outside = open_tmp / "outside.txt"
    outside.write_text("root's")
    (data / "link").symlink_to(outside)
    probe = (f"import os; print(os.getuid(), os.getgid(), sorted(os.getgroups())); "
             f"open('{data}/written-by-child', 'w').write('ok')")
    done = run_entrypoint(["python", "-c", probe],
                          {**unprivileged_env, "PUID": str(uid), "PGID": str(gid), "HEARTH_DATA": str(data),
                           "HEARTH_MODELS_DIR": str(open_tmp / "models")})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == f"{uid} {gid} [{gid}]"
    for path in [data, data / "models", data / "hearth.db", data / "written-by-child"]:
        st = path.lstat()
        assert (st.st_uid, st.st_gid) == (uid, gid), path
    assert (data / "link").lstat().st_uid == uid
    assert outside.stat().st_uid == 0  # a symlink is not followed out of the data folder
    assert "entries changed" in done.stderr

    again = run_entrypoint(["python", "-c", "pass"],
                           {**unprivileged_env, "PUID": str(uid), "PGID": str(gid), "HEARTH_DATA": str(data)})
    assert again.returncode == 0, again.stderr
    assert "entries changed" not in again.stderr  # a restart only stats


@needs_root
def test_root_start_creates_a_missing_data_folder_with_the_right_owner(open_tmp, throwaway_ids, unprivileged_env):
    uid, gid = throwaway_ids
    data = open_tmp / "fresh" / "data"
    done = run_entrypoint(["python", "-c", "import os; print(os.geteuid())"],
                          {**unprivileged_env, "PUID": str(uid), "PGID": str(gid), "HEARTH_DATA": str(data)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(uid)
    assert (data.stat().st_uid, data.stat().st_gid) == (uid, gid)


@needs_root
def test_a_platform_that_starts_it_unprivileged_gets_a_clear_error_for_an_unwritable_folder(open_tmp, throwaway_ids, unprivileged_env):
    uid, gid = throwaway_ids
    data = open_tmp / "data"
    data.mkdir()  # root's, 755: what a fresh host path looks like to TrueNAS's 568
    done = run_entrypoint(["python", "-c", "print('must not run')"],
                          {**unprivileged_env, "HEARTH_DATA": str(data), "PUID": "1000"}, user=uid, group=gid, extra_groups=[])
    assert done.returncode == entrypoint.EXIT_CONFIG
    assert "must not run" not in done.stdout
    assert f"not writable by uid {uid} gid {gid}" in done.stderr
    assert "owned by 0:0" in done.stderr and f"chown -R {uid}:{gid}" in done.stderr


@needs_root
def test_a_platform_that_starts_it_unprivileged_runs_without_chown(open_tmp, throwaway_ids, unprivileged_env):
    uid, gid = throwaway_ids
    data = open_tmp / "data"
    data.mkdir()
    os.chown(data, uid, gid)
    done = run_entrypoint(["python", "-c", "import os; print(os.getuid())"],
                          {**unprivileged_env, "HEARTH_DATA": str(data), "PUID": "1000", "PGID": "1000"},
                          user=uid, group=gid, extra_groups=[])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(uid)
    assert "PUID/PGID are ignored" in done.stderr


def test_first_run_migrates_and_leaves_the_default_model_to_serve(tmp_path, monkeypatch):
    data = tmp_path / "data"
    lines = []
    first_run(data, {}, lines.append)
    assert lines[0].startswith("store created and migrated")
    assert "assembles it in the background" in lines[-1]
    assert not (data / "models").exists()  # the entrypoint no longer spends minutes before the exec

    lines.clear()
    model = data / "models" / "gemma-3-270m-q4_k_m.gguf"
    monkeypatch.setattr(default_model, "verified_default_model", lambda folder: model)
    first_run(data, {}, lines.append)
    assert lines == [f"store ready and migrated: {data / 'hearth.db'}", f"default model ready: {model}"]


def test_first_run_names_a_given_default_model(tmp_path):
    lines = []
    first_run(tmp_path, {"HEARTH_DEFAULT_MODEL": "/models/mine.gguf"}, lines.append)
    assert lines[-1] == "default model given by HEARTH_DEFAULT_MODEL: /models/mine.gguf"


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status, expected", [(200, 0), (503, 1)])
def test_healthcheck_follows_healthz(status, expected):
    handler = type("Handler", (_Health,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        port = server.server_address[1]
        assert entrypoint.healthcheck({"HEARTH_BIND": f"0.0.0.0:{port}"}) == expected
    finally:
        server.shutdown()
        server.server_close()


def test_healthcheck_fails_when_nothing_listens():
    assert entrypoint.healthcheck({"HEARTH_BIND": f"0.0.0.0:{free_port()}"}) == 1
