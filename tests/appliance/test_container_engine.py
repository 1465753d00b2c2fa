"""The container tier: the image the README gives users, built by a real Docker engine and driven by Compose v2 through
the shipped docker-compose.yml, as a NAS owner runs it: first start, setup in chromium, a family token's chat, files
owned by PUID:PGID, a read-only /models, restart and down + up keeping everything, `docker stop` during a stream, the
healthcheck, and no CA or secret in any layer.

The engine is started if none runs, the base images are made locally when the hub cannot be reached, and build layers
are cached by the engine (app/devtools/container.py): a second run rebuilds only Hearth's own code. Marked
`container`; it runs in the README's test command (as root, with docker.io and debootstrap installed)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from app.devtools import container as engine
from tests.helpers import ADMIN_PASSWORD, wait_until

pytestmark = [pytest.mark.container, pytest.mark.model]
REPO = engine.REPO
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICE = COMPOSE["services"]["hearth"]
IMAGE = SERVICE["image"]
NAME = SERVICE["container_name"]
HOST_PORT = int(SERVICE["ports"][0].split(":")[0])
PUID, PGID = 12345, 12346
CHROMIUM = Path("/usr/bin/chromium")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


@pytest.fixture(scope="module")
def image(engine_bases):
    """The CPU image, built from the repository's Dockerfile (local base images where the hub is unreachable)."""
    base_args = engine_bases
    log = Path(tempfile.gettempdir()) / "hearth-image-build.log"
    seconds = engine.build(REPO, IMAGE, build_args=base_args, log_path=log)
    size = engine.image_size_bytes(IMAGE)
    print(f"[container] {IMAGE} built in {seconds:.0f} s (log {log}); size {size / 1e6:.0f} MB; bases {base_args or 'hub'}")
    return IMAGE


class Stack:
    """The shipped docker-compose.yml in a project folder of its own (./data, ./models), driven by Compose v2."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.compose = engine.compose_binary()
        self.env = {**os.environ, "PUID": str(PUID), "PGID": str(PGID), "TZ": "Etc/UTC"}
        self.url = f"http://127.0.0.1:{HOST_PORT}"

    def run(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        """docker-compose -f <repo>/docker-compose.yml --project-directory <folder> ARGS."""
        return subprocess.run([self.compose, "-f", str(REPO / "docker-compose.yml"), "--project-directory",
                               str(self.folder), *args], env=self.env, capture_output=True, text=True, check=check,
                              timeout=timeout)

    def health(self) -> str:
        """The engine's health status of the container ("starting", "healthy", "unhealthy")."""
        out = engine.docker("inspect", "-f", "{{.State.Health.Status}}", NAME, check=False, timeout=30)
        return out.stdout.strip()

    def wait_healthy(self, timeout_s: float) -> None:
        """Until the healthcheck says healthy (the compose file's start period bounds a first start)."""
        wait_until(lambda: self.health() == "healthy", timeout_s=timeout_s,
                   message=lambda: f"{NAME} is {self.health()}:\n{self.logs()[-3000:]}")

    def wait_serving(self, timeout_s: float = 180) -> None:
        """Until serve answers /healthz through the published port (sooner than the engine's next health check)."""
        def answers() -> bool:
            try:
                return httpx.get(f"{self.url}/healthz", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(answers, timeout_s=timeout_s, message=lambda: f"/healthz on {self.url}:\n{self.logs()[-3000:]}")

    def logs(self) -> str:
        """Everything the container printed."""
        out = engine.docker("logs", NAME, check=False, timeout=30)
        return out.stdout + out.stderr

    def exec(self, *args: str) -> subprocess.CompletedProcess:
        """An admin command as the README gives it: through the entrypoint, which drops to PUID:PGID."""
        return engine.docker("exec", NAME, "python", "-m", "app.entrypoint", *args, check=False, timeout=120)


def _start_period_s() -> float:
    return float(re.match(r"(\d+)s", SERVICE["healthcheck"]["start_period"]).group(1))


def _interval_s() -> float:
    return float(re.match(r"(\d+)s", SERVICE["healthcheck"]["interval"]).group(1))


@pytest.fixture(scope="module")
def stack(image):
    """`docker-compose up -d --no-build` of the built image in a fresh project folder; `down` after."""
    if not _port_free(HOST_PORT):
        pytest.fail(f"port {HOST_PORT}, which docker-compose.yml publishes, is taken on this host")
    engine.docker("rm", "-f", NAME, check=False)  # one left by an interrupted run
    folder = Path(tempfile.mkdtemp(prefix="hearth-compose-"))
    folder.chmod(0o755)
    (folder / "models").mkdir()
    s = Stack(folder)
    s.run("up", "-d", "--no-build")
    yield s
    s.run("down", "--timeout", "30", check=False)
    # ./data belongs to PUID:PGID and holds files only that user can remove: the engine's root removes them.
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def family_token(stack):
    """A family member's token made with the CLI inside the container."""
    done = stack.exec("hearth", "token", "create", "--member", "kid", "--class", "chat")
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()[0].strip()  # printed once, first; the line after describes it


def chat(stack: Stack, token: str, content: str, max_tokens: int = 8) -> dict:
    """One non-streamed chat through the published port."""
    r = httpx.post(f"{stack.url}/v1/chat/completions", headers={"Authorization": f"Bearer {token}"}, timeout=300,
                   json={"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                         "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_first_start_is_healthy_within_the_start_period_and_logs_the_setup_code(stack):
    stack.wait_healthy(_start_period_s() + _interval_s() + 30)
    code = (stack.folder / "data" / "secrets" / "setup_code").read_text().strip()
    assert f"setup code {code}" in stack.logs()


def test_data_belongs_to_puid_and_is_private_and_serve_is_not_root(stack):
    stack.wait_serving()
    data = stack.folder / "data"
    st = data.stat()
    assert (st.st_uid, st.st_gid) == (PUID, PGID) and st.st_mode & 0o777 == 0o700
    for path in [data / "hearth.db", data / "secrets", *(data / "secrets").iterdir()]:
        mode = path.stat().st_mode & 0o777
        assert path.stat().st_uid == PUID and mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
    processes = engine.docker("top", NAME, "-eo", "pid,uid,args").stdout.splitlines()[1:]  # docker top needs pid
    # tini, PID 1, stays root to reap and forward signals; the entrypoint dropped everything it started to PUID.
    serving = [line for line in processes if "tini" not in line.split(None, 2)[2]]
    assert any("hearth serve" in line for line in serving), processes
    assert all(line.split()[1] == str(PUID) for line in serving), processes


@pytest.mark.skipif(not CHROMIUM.is_file(), reason="apt-get install -y chromium")
def test_the_dashboard_is_set_up_and_logged_into_in_chromium(stack):
    from playwright.sync_api import sync_playwright

    stack.wait_serving()
    code = (stack.folder / "data" / "secrets" / "setup_code").read_text().strip()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                    args=["--no-sandbox", "--disable-background-networking"])
        try:
            page = browser.new_page()
            page.goto(f"{stack.url}/")
            assert "/setup" in page.url
            page.fill("input[name=setup_code]", code)
            page.fill("input[name=password]", ADMIN_PASSWORD)
            page.fill("input[name=confirm]", ADMIN_PASSWORD)
            page.click("button[type=submit]")
            page.wait_for_url(lambda url: "/setup" not in url, timeout=30_000)
            assert page.title() and "Overview" in page.content()
        finally:
            browser.close()


def test_a_family_token_is_answered_by_the_embedded_model(stack, family_token):
    stack.wait_serving()
    answer = chat(stack, family_token, "Say hello.")
    assert answer["usage"]["completion_tokens"] > 0 and answer["choices"][0]["message"]["content"]


@pytest.fixture
def file_server(tmp_path):
    """A GGUF served over HTTP from this host on every address, so the container reaches it through its gateway."""
    import functools
    import http.server

    from app.residency.supervisor import free_port
    from tests.helpers import write_standin_gguf

    write_standin_gguf(tmp_path / "tiny.gguf")
    port = free_port()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("0.0.0.0", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield port
    server.shutdown()
    server.server_close()


def test_a_pull_into_the_read_only_models_folder_says_so_and_serving_goes_on(stack, family_token, file_server):
    networks = json.loads(engine.docker("inspect", "-f", "{{json .NetworkSettings.Networks}}", NAME).stdout)
    gateway = next(iter(networks.values()))["Gateway"]  # this host, as the container sees it
    # The host is on the LAN side of the pull's SSRF rules: the admin lists it, as for a mirror on the LAN.
    assert stack.exec("hearth", "settings", "set", "pull_allowed_hosts", gateway).returncode == 0
    done = stack.exec("hearth", "models", "pull", f"http://{gateway}:{file_server}/tiny.gguf")
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "the models folder is read-only" in out, out
    assert chat(stack, family_token, "Still there?")["usage"]["completion_tokens"] > 0


LONG_PROMPT = "You are the family's kitchen assistant. " * 40 + "What is for dinner?"


def _restart_keeps(stack: Stack, token: str, restart) -> None:
    first = chat(stack, token, LONG_PROMPT)
    set_ = stack.exec("hearth", "settings", "set", "requests_retention_days", "45")
    assert set_.returncode == 0, set_.stderr
    # The runner writes idle prefixes to the disk tier; what it holds is on ./data before the restart.
    kv = stack.folder / "data" / "kv-cache"
    wait_until(lambda: kv.is_dir() and any(kv.rglob("*")), timeout_s=60, message="a prefix written to the disk tier")
    restart()
    stack.wait_serving()
    again = chat(stack, token, LONG_PROMPT)
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # answered from the disk tier
    listed = stack.exec("hearth", "settings", "list").stdout
    assert re.search(r"^requests_retention_days\s+45\s", listed, re.M), listed


def test_compose_restart_keeps_the_store_tokens_settings_and_the_kv_disk_tier(stack, family_token):
    _restart_keeps(stack, family_token, lambda: stack.run("restart"))


def test_down_and_up_keep_them_too(stack, family_token):
    def down_up():
        stack.run("down", "--timeout", "30")
        stack.run("up", "-d", "--no-build")
    _restart_keeps(stack, family_token, down_up)


def test_docker_stop_during_a_stream_ends_it_cleanly_and_leaves_no_runner(stack, family_token):
    stack.wait_serving()
    events, ended = [], threading.Event()

    def stream():
        try:
            with httpx.stream("POST", f"{stack.url}/v1/chat/completions", timeout=120,
                              headers={"Authorization": f"Bearer {family_token}"},
                              # Short enough to end inside the drain serve gives answers in flight (8 s), also on a
                              # busy box: the image's CPU build (AVX2, no AVX-512) decodes a few tok/s when shared.
                              json={"messages": [{"role": "user", "content": "Tell a long story."}],
                                    "max_tokens": 12, "stream": True, "ignore_eos": True}) as r:
                for line in r.iter_lines():
                    events.append(line)
        except httpx.HTTPError as exc:
            events.append(f"error: {exc!r}")
        finally:
            ended.set()

    threading.Thread(target=stream, daemon=True).start()
    wait_until(lambda: sum(e.startswith("data: {") for e in events) >= 2, timeout_s=120, message="the stream to flow")
    t0 = time.monotonic()
    stack.run("stop", "--timeout", SERVICE["stop_grace_period"].rstrip("s"))
    stopped_s = time.monotonic() - t0
    try:
        assert ended.wait(30)
        state = json.loads(engine.docker("inspect", "-f", "{{json .State}}", NAME).stdout)
        assert state["ExitCode"] == 0 and not state["OOMKilled"], state  # not killed at the end of the grace period
        assert stopped_s < float(SERVICE["stop_grace_period"].rstrip("s"))
        lines = [e for e in events if e]
        assert lines[-1] == "data: [DONE]" and not any('"error"' in e for e in lines), lines[-3:]
        assert any('"finish_reason": "length"' in e or '"finish_reason":"length"' in e for e in lines), lines[-3:]
    finally:
        stack.run("start")  # the module's next tests need it serving, whatever this one found
        stack.wait_serving()


def test_the_healthcheck_turns_unhealthy_when_serve_stops_answering_and_healthy_after(stack):
    stack.wait_healthy(_interval_s() + 30)
    serve = [line.split() for line in engine.docker("top", NAME, "-eo", "pid,args").stdout.splitlines()[1:]
             if "gunicorn" in line or "hearth serve" in line]
    pids = [row[0] for row in serve]
    assert pids
    subprocess.run(["kill", "-STOP", *pids], check=True)
    try:
        budget = _interval_s() * (SERVICE["healthcheck"]["retries"] + 1) + 30
        wait_until(lambda: stack.health() == "unhealthy", timeout_s=budget, message="the healthcheck to fail")
    finally:
        subprocess.run(["kill", "-CONT", *pids], check=True)
    wait_until(lambda: stack.health() == "healthy", timeout_s=_interval_s() + 30, message="healthy again")


def test_no_layer_holds_the_build_ca_or_a_secret(image):
    history = engine.docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", image).stdout
    assert "BEGIN CERTIFICATE" not in history and "ca-certificates.crt" not in history
    local_cas = sorted(Path("/usr/local/share/ca-certificates").glob("*.crt"))
    files = engine.docker("run", "--rm", "--entrypoint", "sh", image, "-c",
                          "ls /run/secrets 2>/dev/null; ls /data; cat /etc/pip.conf 2>/dev/null; "
                          "find / -xdev -name '*.pem' -newer /etc/hostname 2>/dev/null | head").stdout
    assert files.strip() == "", files
    for ca in local_cas:
        # This host's own CAs (a TLS-inspecting proxy's, added to the bundle the build gets) are in no file of the image.
        line = ca.read_text().split("-----BEGIN CERTIFICATE-----", 1)[1].split()[0]
        grep = engine.docker("run", "--rm", "--entrypoint", "grep", image, "-rlF", line, "/etc", "/opt", "/root",
                             "/home", "/usr/local", check=False)
        assert grep.stdout.strip() == "", (ca, grep.stdout)


def _commit_before_the_last_migration() -> str:
    """The parent of the commit that added the newest migration: the release a household upgrades from."""
    last = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%H", "--", "migrations/versions"],
                          capture_output=True, text=True, check=True).stdout.strip()
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", f"{last}^"], capture_output=True, text=True,
                          check=True).stdout.strip()


def _row_counts(db: Path) -> dict[str, int]:
    import sqlite3

    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%'")]
        return {t: conn.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in tables}


def test_an_upgrade_from_the_release_before_the_last_migration_keeps_every_row(image, stack):
    """The previous release's code (built with today's Dockerfile and llama.cpp build script, so its dependency and
    llama.cpp layers are the cached ones) writes a household's data; today's image starts on that ./data, migrates it
    and keeps every row of every table."""
    old_commit = _commit_before_the_last_migration()
    context = Path(tempfile.mkdtemp(prefix="hearth-old-"))
    try:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", old_commit], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(context)], input=archive.stdout, check=True)
        shutil.copy(REPO / "Dockerfile", context / "Dockerfile")
        shutil.copy(REPO / ".dockerignore", context / ".dockerignore")
        shutil.copy(REPO / "scripts" / "build_llama_tools.sh", context / "scripts" / "build_llama_tools.sh")
        old_tag = f"{IMAGE}-previous"
        engine.build(context, old_tag, build_args=engine.base_image_args(log=lambda line: None),
                     log_path=Path(tempfile.gettempdir()) / "hearth-image-previous.log")
    finally:
        shutil.rmtree(context, ignore_errors=True)
    stack.run("down", "--timeout", "30")
    data = stack.folder / "data"
    shutil.rmtree(data)
    try:
        with open(stack.folder / "previous.yaml", "w") as f:
            yaml.safe_dump({"services": {"hearth": {"image": old_tag}}}, f)
        previous = [*("-f", str(stack.folder / "previous.yaml"))]
        old = subprocess.run([stack.compose, "-f", str(REPO / "docker-compose.yml"), *previous, "--project-directory",
                              str(stack.folder), "up", "-d", "--no-build"], env=stack.env, capture_output=True,
                             text=True)
        assert old.returncode == 0, old.stderr
        stack.wait_serving()
        made = stack.exec("hearth", "token", "create", "--member", "grandpa", "--class", "chat")
        assert made.returncode == 0, made.stderr
        token = made.stdout.splitlines()[0].strip()
        for question in ("What time is it?", "Tell me a joke."):
            chat(stack, token, question)
        assert stack.exec("hearth", "settings", "set", "requests_retention_days", "30").returncode == 0
        wait_until(lambda: _row_counts(data / "hearth.db").get("requests", 0) >= 2, timeout_s=60,
                   message="the previous release to log both requests")
        subprocess.run([stack.compose, "-f", str(REPO / "docker-compose.yml"), *previous, "--project-directory",
                        str(stack.folder), "down", "--timeout", "30"], env=stack.env, check=True, capture_output=True)
        before = _row_counts(data / "hearth.db")
        stack.run("up", "-d", "--no-build")
        stack.wait_serving()
        after = _row_counts(data / "hearth.db")
        lost = {t: (n, after.get(t, 0)) for t, n in before.items() if t != "alembic_version" and after.get(t, 0) < n}
        print(f"[container] upgrade {old_commit[:7]} → today: {sum(before.values())} rows in {len(before)} tables "
              f"before, {sum(after.values())} after; lost per table: {lost or 'none'}")
        assert not lost
        assert chat(stack, token, "Still here after the upgrade?")["usage"]["completion_tokens"] > 0
    finally:
        stack.run("up", "-d", "--no-build", check=False)


# ggml's x86-64 CPU variants (GGML_CPU_ALL_VARIANTS in ggml/src/CMakeLists.txt of the pinned llama.cpp) and how it scores
# one against the CPU (ggml-cpu/arch/x86/cpu-feats.cpp): every feature a variant was built with must be there, and each
# adds its weight; the highest score is loaded. The expected pick below is worked out from /proc/cpuinfo on its own.
X86_VARIANTS = {
    "x64": (), "sse42": ("SSE42",), "sandybridge": ("SSE42", "AVX"), "ivybridge": ("SSE42", "AVX", "F16C"),
    "piledriver": ("SSE42", "AVX", "F16C", "FMA"), "haswell": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2"),
    "skylakex": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512"),
    "cannonlake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI"),
    "cascadelake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VNNI"),
    "icelake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI", "AVX512_VNNI"),
    "cooperlake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VNNI", "AVX512_BF16"),
    "zen4": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16"),
    "alderlake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX_VNNI"),
    "sapphirerapids": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI", "AVX512_VNNI",
                       "AVX512_BF16", "AMX_TILE", "AMX_INT8"),
}
_WEIGHT = {"FMA": 1, "F16C": 2, "SSE42": 4, "BMI2": 8, "AVX": 16, "AVX2": 32, "AVX_VNNI": 64, "AVX512": 128,
           "AVX512_VBMI": 256, "AVX512_BF16": 512, "AVX512_VNNI": 1024, "AMX_INT8": 2048, "AMX_TILE": 0}
_CPUINFO_FLAGS = {"FMA": {"fma"}, "F16C": {"f16c"}, "SSE42": {"sse4_2"}, "BMI2": {"bmi2"}, "AVX": {"avx"},
                  "AVX2": {"avx2"}, "AVX_VNNI": {"avx_vnni"},
                  "AVX512": {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"},
                  "AVX512_VBMI": {"avx512vbmi"}, "AVX512_BF16": {"avx512_bf16"}, "AVX512_VNNI": {"avx512_vnni"},
                  "AMX_INT8": {"amx_int8"}, "AMX_TILE": {"amx_tile"}}


def _best_variant_for(flags: set[str]) -> str:
    """The variant ggml loads on a CPU with these /proc/cpuinfo flags (AMX_TILE is built in but not scored)."""
    scores = {name: 1 + sum(_WEIGHT[f] for f in feats) for name, feats in X86_VARIANTS.items()
              if all(_CPUINFO_FLAGS[f] <= flags for f in feats if f != "AMX_TILE")}
    return max(scores, key=scores.get)


_LOADED_VARIANT = r"loaded CPU backend from (\S+)"
_WHICH_VARIANT = """
import json, os
from app.llama_tools import apply_llama_lib_env, backend_modules, load_backends
apply_llama_lib_env()
load_backends()
print(json.dumps({"lib_dir": os.environ.get("LLAMA_CPP_LIB_PATH"),
                  "modules": backend_modules(os.environ.get("LLAMA_CPP_LIB_PATH"))}))
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the variant table above is x86-64's")
def test_the_image_carries_every_cpu_variant_and_loads_the_best_one_for_this_cpu(image):
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    done = engine.docker("run", "--rm", image, "python", "-c", _WHICH_VARIANT)
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts["lib_dir"] == "/opt/hearth/llama-lib"
    assert facts["modules"] == sorted(f"libggml-cpu-{v}.so" for v in X86_VARIANTS)
    loaded = re.findall(_LOADED_VARIANT, done.stderr)
    expected = _best_variant_for(flags)
    assert [Path(p).name for p in loaded] == [f"libggml-cpu-{expected}.so"], done.stderr[-2000:]
    # Whether this build may repack here is asked of the build itself in the container too (app/repack.py).
    probe = engine.docker("run", "--rm", image, "python", "-m", "app.repack", "--fresh")
    verdict = json.loads(probe.stdout.strip().splitlines()[-1])
    print(f"[container] CPU variant loaded: {expected}; repack in the image: {verdict}")
    assert isinstance(verdict["repack"], bool) and verdict["why"]
