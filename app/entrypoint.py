"""The container's entrypoint: take /data for the household's user, prepare the first run, exec the command.

Run as `python -m app.entrypoint [COMMAND...]` (the image's ENTRYPOINT, behind tini); the command
defaults to `hearth serve`. Two ways a NAS starts a container, both handled:

- as root with PUID/PGID (CasaOS, Unraid, plain docker compose): the data folder is given to
  PUID:PGID (only entries that are not theirs yet, so a restart costs a stat per file), then the
  process drops to that user for good before anything else runs;
- already as an unprivileged user (TrueNAS runs apps as 568, Umbrel as 1000): nothing to chown or
  drop, but the data folder must be writable, and a clear error says how to fix it when it is not.

Then, for `hearth serve`: the store is migrated and the command is exec'd so gunicorn replaces this
process and receives SIGTERM itself. On a first run the embedded default model is assembled by the
server in the background, not here: the dashboard is reachable at once and shows a progress bar, and
the same progress goes to the log. `python -m app.entrypoint healthcheck`
is the image's HEALTHCHECK: a GET of /healthz with nothing but the standard library.
"""

from __future__ import annotations

import os
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path

DEFAULT_DATA = "/data"
DEFAULT_MODELS = "/models"
DEFAULT_BIND = "0.0.0.0:8080"
# The image's own user (Dockerfile: useradd --uid 1000): what runs when PUID/PGID are not given.
DEFAULT_UID = 1000
DEFAULT_GID = 1000
# sysexits' EX_CONFIG: the container cannot start as configured; the message says what to change.
EXIT_CONFIG = 78
HEALTHCHECK_TIMEOUT_S = 4.0


class EntrypointError(RuntimeError):
    """A start-up condition the household admin has to fix (the message says how)."""


def log(message: str) -> None:
    """One line in the container log (stderr, unbuffered)."""
    print(f"hearth-entrypoint: {message}", file=sys.stderr, flush=True)


def ids_from_env(env: Mapping[str, str]) -> tuple[int, int]:
    """PUID and PGID from the environment (default 1000:1000), checked to be non-negative integers."""
    ids = []
    for name, default in (("PUID", DEFAULT_UID), ("PGID", DEFAULT_GID)):
        raw = env.get(name, "").strip() or str(default)
        if not raw.isdigit():
            raise EntrypointError(f"{name}={raw!r} is not a numeric id: set {name} to a number such as {default}")
        ids.append(int(raw))
    return ids[0], ids[1]


def claim(path: Path, uid: int, gid: int) -> int:
    """Give path and everything under it to uid:gid (symlinks not followed); returns how many entries changed."""
    changed = 0
    path.mkdir(parents=True, exist_ok=True)
    for root, dirs, files in os.walk(path):
        for entry in [root, *(os.path.join(root, name) for name in dirs + files)]:
            st = os.lstat(entry)
            if (st.st_uid, st.st_gid) != (uid, gid):
                os.lchown(entry, uid, gid)
                changed += 1
    return changed


def gpu_device_groups(dri: Path = Path("/dev/dri")) -> list[int]:
    """The groups owning the GPU render nodes passed into the container (/dev/dri/renderD*: the host's render group),
    so the dropped user keeps the access compose's `devices:` gave (an Intel/AMD GPU through Vulkan)."""
    try:
        return sorted({os.stat(node).st_gid for node in dri.glob("renderD*")})
    except OSError:
        return []


def drop_privileges(uid: int, gid: int, extra_gids: list[int] | None = None) -> None:
    """Become uid:gid for good (supplementary groups reduced to gid and the GPU render nodes' groups), and prove
    root cannot come back."""
    os.setgroups(sorted({gid, *(extra_gids or [])} - {0}) or [gid])
    os.setgid(gid)
    os.setuid(uid)
    try:
        os.setuid(0)
    except PermissionError:
        return
    raise EntrypointError(f"could still regain root after dropping to {uid}:{gid}; refusing to run")


def check_writable(path: Path) -> None:
    """Create path if needed and write a probe file in it; raise with the fix when this user cannot."""
    uid, gid = os.getuid(), os.getgid()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        owner = ""
        try:
            st = path.stat()
            owner = f" (owned by {st.st_uid}:{st.st_gid}, mode {st.st_mode & 0o7777:o})"
        except OSError:
            pass
        raise EntrypointError(
            f"the data folder {path}{owner} is not writable by uid {uid} gid {gid}: {exc.strerror}. "
            f"Give that user write access to the host folder mounted at {path} "
            f"(for example `chown -R {uid}:{gid} <host folder>`, or on TrueNAS an ACL for the apps user), "
            "or start the container as root with PUID/PGID set to the owner you want"
        ) from exc


def check_models(path: Path) -> str | None:
    """Why the models folder cannot be listed by this user, or None when it can (or does not exist yet)."""
    if not path.exists():
        return None
    if not os.access(path, os.R_OK | os.X_OK):
        return (f"the models folder {path} is not readable by uid {os.getuid()}: only the embedded default "
                "model will be offered until the host folder is readable (read-only is enough)")
    return None


def first_run(data: Path, env: Mapping[str, str], emit: Callable[[str], None] = log) -> None:
    """Migrate the store and say whether the default model is ready or will be assembled by `hearth serve`."""
    from app.residency.default_model import verified_default_model
    from app.store.db import database_path, open_store

    fresh = not database_path(data).exists()
    engine, _ = open_store(data)
    engine.dispose()
    emit(f"store {'created' if fresh else 'ready'} and migrated: {database_path(data)}")
    if env.get("HEARTH_DEFAULT_MODEL"):
        emit(f"default model given by HEARTH_DEFAULT_MODEL: {env['HEARTH_DEFAULT_MODEL']}")
        return
    ready = verified_default_model(data)
    if ready is not None:
        emit(f"default model ready: {ready}")
    else:
        emit("default model: hearth serve assembles it in the background; its progress shows in this log "
             "and on the dashboard")


def is_serve(command: list[str]) -> bool:
    """Whether the command is `hearth serve` (by name or by path, any options after it)."""
    return len(command) >= 2 and Path(command[0]).name == "hearth" and command[1] == "serve"


def prepare(env: Mapping[str, str], command: list[str], emit: Callable[[str], None] = log) -> None:
    """Everything before the exec: ownership and privilege drop (as root), writability, first run."""
    data = Path(env.get("HEARTH_DATA") or DEFAULT_DATA)
    models = Path(env.get("HEARTH_MODELS_DIR") or DEFAULT_MODELS)
    if os.geteuid() == 0:
        uid, gid = ids_from_env(env)
        if uid == 0:
            emit("PUID=0: running as root (set PUID/PGID to the owner of your data folder to avoid it)")
        else:
            try:
                changed = claim(data, uid, gid)
                emit(f"{data} belongs to {uid}:{gid}" + (f" ({changed} entries changed)" if changed else ""))
            except PermissionError as exc:
                # NFS with root_squash: root may not chown; whether the user can write decides below.
                emit(f"cannot change the owner of {data} ({exc.strerror}); going on as {uid}:{gid}")
            drop_privileges(uid, gid, gpu_device_groups())
    else:
        actual = {"PUID": os.getuid(), "PGID": os.getgid()}
        if any(env.get(name, "").strip() not in ("", str(actual[name])) for name in actual):
            emit(f"started as uid {os.getuid()} gid {os.getgid()} by the platform: PUID/PGID are ignored")
    check_writable(data)
    if (problem := check_models(models)) is not None:
        emit(problem)
    if is_serve(command):
        first_run(data, env, emit)


def healthcheck(env: Mapping[str, str]) -> int:
    """GET /healthz on the port hearth serve binds; 0 when it answers 200."""
    bind = env.get("HEARTH_BIND") or DEFAULT_BIND
    host, _, port = bind.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    url = f"http://{host}:{port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=HEALTHCHECK_TIMEOUT_S) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (OSError, ValueError) as exc:
        print(f"healthcheck: {url}: {exc}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"healthcheck: {url} answered {status}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Prepare and exec the command (default `hearth serve`); returns only on a configuration error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["healthcheck"]:
        return healthcheck(os.environ)
    command = argv or ["hearth", "serve"]
    try:
        prepare(os.environ, command)
    except EntrypointError as exc:
        log(f"cannot start: {exc}")
        return EXIT_CONFIG
    # exec: gunicorn takes this PID, so the SIGTERM tini forwards reaches it, not a wrapper.
    os.execvp(command[0], command)


if __name__ == "__main__":
    sys.exit(main())
