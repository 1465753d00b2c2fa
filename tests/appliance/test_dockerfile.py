"""The Dockerfile read line by line: multi-stage, pinned bases, CPU/CUDA build argument, npm stage,
privilege drop through the entrypoint, HEALTHCHECK without curl, and the same contract as compose."""

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from app import entrypoint

REPO = Path(__file__).resolve().parents[2]


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) for every instruction, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for raw in (REPO / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line:
            keyword, _, args = line.partition(" ")
            out.append((keyword.upper(), args.strip()))
    return out


def stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name -> its instructions; '' holds the global ARGs before the first FROM."""
    out: dict[str, list] = {"": []}
    current = ""
    for keyword, args in instructions():
        if keyword == "FROM":
            base, _, name = args.partition(" AS ")
            current = name.strip()
            out[current] = [("FROM", base.strip())]
        else:
            out[current].append((keyword, args))
    return out


def global_args() -> dict[str, str]:
    return dict(args.split("=", 1) for keyword, args in stages()[""] if keyword == "ARG")


def stage_env(stage: str) -> dict[str, str]:
    """ENV of a stage (KEY=VALUE form), quotes removed."""
    env = {}
    for keyword, args in stages()[stage]:
        if keyword == "ENV":
            env.update(item.split("=", 1) for item in shlex.split(args))
    return env


def one(stage: str, keyword: str) -> str:
    (args,) = [a for k, a in stages()[stage] if k == keyword]
    return args


def test_multi_stage_with_the_accel_argument_choosing_cpu_or_cuda():
    s = stages()
    assert {"assets", "build-cpu", "build-cuda", "build", "runtime-cpu", "runtime-cuda", "runtime"} <= set(s)
    assert list(s)[-1] == "runtime"
    assert global_args()["ACCEL"] == "cpu"  # CPU unless asked
    assert one("build", "FROM") == "build-${ACCEL}" and one("runtime", "FROM") == "runtime-${ACCEL}"


def test_base_images_are_pinned_to_exact_tags():
    args = global_args()
    for stage, body in stages().items():
        if not stage:
            continue
        base = body[0][1]
        if base.endswith("-${ACCEL}"):
            continue
        name = re.fullmatch(r"\$\{(\w+)\}", base).group(1)
        ref = args[name]
        tag = ref.partition(":")[2]
        assert tag and tag != "latest" and re.search(r"\d+\.\d+\.\d+", tag), f"{stage}: {ref}"
    # Development and runtime CUDA images from one CUDA release and one Ubuntu.
    assert args["CUDA_DEVEL_IMAGE"].replace("-devel-", "-runtime-") == args["CUDA_RUNTIME_IMAGE"]
    assert args["CUDA_DEVEL_IMAGE"].startswith("nvidia/cuda:")


def test_llama_cpp_built_for_the_cpu_family_by_default_and_with_cuda_by_build_argument():
    assert "-DGGML_NATIVE=OFF" in stage_env("build-cpu")["DEFAULT_CMAKE_ARGS"]
    assert "-DGGML_CUDA=on" not in stage_env("build-cpu")["DEFAULT_CMAKE_ARGS"]
    assert "-DGGML_CUDA=on" in stage_env("build-cuda")["DEFAULT_CMAKE_ARGS"]
    assert ("ARG", 'CMAKE_ARGS=""') in stages()["build"]
    runs = [a for k, a in stages()["build"] if k == "RUN"]
    # Pins come from pyproject.toml (one list, read in a stage of its own so only their content keys the compile's
    # cache), compiled with the chosen CMake arguments.
    reqs = " ".join(a for k, a in stages()["requirements"] if k == "RUN")
    assert "pyproject.toml" in reqs and "tomllib" in reqs and "['dependencies']" in reqs
    assert ("COPY", "--from=requirements /requirements.txt /tmp/requirements.txt") in stages()["build"]
    assert any('CMAKE_ARGS="${CMAKE_ARGS:-$DEFAULT_CMAKE_ARGS}" pip install -r /tmp/requirements.txt' in r for r in runs)


def test_front_end_assets_come_from_npm_ci_in_their_own_stage():
    body = stages()["assets"]
    assert ("COPY", "package.json package-lock.json ./") in body
    assert any(k == "RUN" and "&& npm ci " in a for k, a in body)
    assert ("COPY", "--from=assets /src/node_modules ./node_modules") in stages()["build"]
    for name in ("package.json", "package-lock.json", "pyproject.toml"):
        assert (REPO / name).is_file(), name


def test_no_syntax_line_and_the_ca_only_as_a_secret_mount():
    """BuildKit would fetch a `# syntax=` frontend from the hub (offline: the build fails); the build's CA reaches the
    downloading steps as a secret mount, never COPY or ENV, so no layer holds it."""
    text = (REPO / "Dockerfile").read_text()
    assert not re.search(r"^#\s*syntax=", text, re.M)
    downloading = [a for k, a in instructions() if k == "RUN" and ("pip install" in a or "npm ci" in a)]
    assert downloading and all(a.startswith("--mount=type=secret,id=ca") for a in downloading)
    assert not any(k in ("COPY", "ADD", "ENV") and ("ca-certificates.crt" in a or "PIP_CERT" in a or "NODE_EXTRA_CA" in a)
                   for k, a in instructions())


def test_dockerignore_keeps_local_state_out_of_the_image():
    ignored = set((REPO / ".dockerignore").read_text().split())
    assert {".git", ".venv", "node_modules", "data", "tests", "**/*.gguf"} <= ignored


def test_runtime_drops_root_through_the_entrypoint_behind_tini():
    runtime = stages()["runtime"]
    # No USER: the entrypoint starts as root only to hand /data to PUID:PGID, then drops for good
    # (tests/appliance/test_entrypoint.py); a USER line would make PUID/PGID impossible.
    assert not any(k == "USER" for k, _ in runtime)
    assert json.loads(one("runtime", "ENTRYPOINT")) == ["/usr/bin/tini", "--", "python", "-m", "app.entrypoint"]
    assert json.loads(one("runtime", "CMD")) == ["hearth", "serve"]
    assert entrypoint.is_serve(json.loads(one("runtime", "CMD")))
    for stage in ("runtime-cpu", "runtime-cuda"):
        assert any(k == "RUN" and " tini " in a for k, a in stages()[stage]), stage
    assert one("runtime", "STOPSIGNAL") == "SIGTERM"
    useradd = next(a for k, a in runtime if k == "RUN" and "useradd" in a)
    assert f"--uid {entrypoint.DEFAULT_UID}" in useradd and f"--gid {entrypoint.DEFAULT_GID}" in useradd


def test_healthcheck_uses_python_not_curl():
    check = one("runtime", "HEALTHCHECK")
    assert "curl" not in check and "wget" not in check
    command = json.loads(check.split(" CMD ", 1)[1])
    assert command == ["python", "-m", "app.entrypoint", "healthcheck"]
    start_period = re.search(r"--start-period=(\d+)s", check).group(1)
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["hearth"]
    assert compose["healthcheck"]["start_period"] == f"{start_period}s"


def test_image_contract_matches_docker_compose():
    env = stage_env("runtime")
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["hearth"]
    for var in ("HEARTH_DATA", "HEARTH_MODELS_DIR", "HEARTH_BIND"):
        assert env[var] == str(compose["environment"][var]), var
    assert env["HEARTH_BIND"] == entrypoint.DEFAULT_BIND
    assert (env["HEARTH_DATA"], env["HEARTH_MODELS_DIR"]) == (entrypoint.DEFAULT_DATA, entrypoint.DEFAULT_MODELS)
    assert (env["PUID"], env["PGID"]) == (str(entrypoint.DEFAULT_UID), str(entrypoint.DEFAULT_GID))
    assert json.loads(one("runtime", "VOLUME")) == ["/data", "/models"]
    assert one("runtime", "EXPOSE") == env["HEARTH_BIND"].rsplit(":", 1)[1]


@pytest.mark.parametrize("stage", ["runtime-cpu", "runtime-cuda", "build-cpu", "build-cuda"])
def test_apt_lists_are_cleaned(stage):
    for keyword, args in stages()[stage]:
        if keyword == "RUN" and "apt-get install" in args:
            assert "--no-install-recommends" in args and "rm -rf /var/lib/apt/lists/*" in args


def test_the_cpu_image_carries_the_portable_build_keyed_on_the_pin_alone():
    # Every CPU variant as a module (build_llama_tools.sh --cpu-all), the best loaded at run time by
    # app.llama_tools.load_backends; the GGML_NATIVE=OFF wheel alone would need AVX2 and leave AVX-512 unused.
    build = stages()["build"]
    runs = [a for k, a in build if k == "RUN"]
    assert any("cpu/all) variant=cpu-all" in r and "build_llama_tools.sh --$variant" in r for r in runs)
    # The default: one image for a Celeron without AVX2 and a Xeon with AMX (CPU_VARIANTS=wheel opts out: the
    # GGML_NATIVE=OFF wheel alone, AVX2 needed, a shorter compile).
    assert ("ARG", "CPU_VARIANTS=all") in build
    assert stage_env("runtime-cpu")["HEARTH_LLAMA_LIB_DIR"] == "/opt/hearth/llama-lib"
    # Before Hearth's code is copied in: a code change does not rebuild fourteen CPU variants.
    at = [i for i, (k, a) in enumerate(build) if k == "RUN" and "build_llama_tools.sh" in a][0]
    code = build.index(("COPY", ". ./"))
    assert at < code
    assert ("COPY", "--from=requirements /llama-pin.toml /opt/hearth/llama-build/pyproject.toml") in build
