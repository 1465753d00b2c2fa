"""Every install manifest parses, carries its store's required keys, and agrees with docker-compose.yml.

No container engine here: compose files are parsed as YAML, the TrueNAS template is rendered with
Jinja2 from questions.yaml's defaults, Unraid templates are read as XML, the systemd unit as INI.
"""

import re
import tomllib
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
APPLIANCE = REPO / "appliance"
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
IMAGE = "ghcr.io/hearth-llm/hearth"
PATH_VARS = ("HEARTH_DATA", "HEARTH_MODELS_DIR", "HEARTH_BIND")
REQUIRED_ENV = {"PUID", "PGID", "TZ", *PATH_VARS}
TRUENAS_IX_VOLUMES = {"data": "/mnt/.ix-apps/app_mounts/hearth/data",
                      "models": "/mnt/.ix-apps/app_mounts/hearth/models"}


@dataclass
class Manifest:
    """What every install method must agree on, read out of one manifest's own format."""

    name: str
    env: dict[str, str]
    container_port: int | None
    volumes: dict[str, str]  # container path -> "rw" | "ro"
    image: str | None
    healthcheck: list[str] | None  # None: the image's HEALTHCHECK applies
    stop_grace_s: float
    gpu: bool
    extra: dict = field(default_factory=dict)


def duration_s(text: str | int) -> float:
    """A compose duration ("30s", "1m30s") or a plain number of seconds."""
    if isinstance(text, int) or str(text).isdigit():
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|m|s)", str(text))
    assert parts and "".join(n + u for n, u in parts) == text, f"bad duration {text!r}"
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


def merge(base: dict, overlay: dict) -> dict:
    """Compose's merge of an override file: mappings merge key by key, anything else is replaced."""
    out = dict(base)
    for key, value in overlay.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _env_dict(environment) -> dict[str, str]:
    if isinstance(environment, list):
        return dict(item.split("=", 1) for item in environment)
    return {k: str(v) for k, v in (environment or {}).items()}


def _volumes(volumes) -> dict[str, str]:
    out = {}
    for v in volumes:
        if isinstance(v, str):
            parts = v.split(":")
            out[parts[1]] = parts[2] if len(parts) > 2 else "rw"
        else:
            out[v["target"]] = "ro" if v.get("read_only") else "rw"
    return out


def _container_port(ports) -> int:
    (port,) = ports
    if isinstance(port, dict):
        return int(port["target"])
    return int(str(port).split(":")[-1].split("/")[0])


def _has_gpu(service: dict) -> bool:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)


def from_compose_service(name: str, service: dict, port: int | None = None) -> Manifest:
    """A Manifest from one compose service."""
    return Manifest(
        name=name,
        env=_env_dict(service.get("environment")),
        container_port=port if port is not None else _container_port(service["ports"]),
        volumes=_volumes(service["volumes"]),
        image=service["image"],
        healthcheck=service["healthcheck"]["test"],
        stop_grace_s=duration_s(service["stop_grace_period"]),
        gpu=_has_gpu(service),
        extra={"service": service},
    )


def load_yaml(path: Path):
    return yaml.safe_load(path.read_text())


def compose() -> dict:
    return load_yaml(REPO / "docker-compose.yml")


def schema_defaults(attrs: list[dict]) -> dict:
    """The values TrueNAS fills in from questions.yaml when the admin changes nothing."""
    out = {}
    for q in attrs:
        schema = q["schema"]
        if schema.get("type") == "dict":
            out[q["variable"]] = schema_defaults(schema.get("attrs", []))
        elif "default" in schema:
            out[q["variable"]] = schema["default"]
    return out


def truenas_values(**overrides) -> dict:
    """questions.yaml defaults + ix_values.yaml + the ix_volumes TrueNAS passes, with overrides merged in."""
    folder = APPLIANCE / "truenas" / "hearth"
    values = merge(schema_defaults(load_yaml(folder / "questions.yaml")["questions"]), load_yaml(folder / "ix_values.yaml"))
    values["ix_volumes"] = TRUENAS_IX_VOLUMES
    return merge(values, overrides)


def render_truenas(values: dict) -> dict:
    """templates/docker-compose.yaml rendered as TrueNAS does (undefined names fail here)."""
    source = (APPLIANCE / "truenas" / "hearth" / "templates" / "docker-compose.yaml").read_text()
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, extensions=["jinja2.ext.do"])
    return yaml.safe_load(env.from_string(source).render(values=values))


def unraid(path: Path) -> Manifest:
    """A Manifest from an Unraid dockerMan template."""
    root = ET.parse(path).getroot()
    configs = root.findall("Config")
    by_type = {}
    for c in configs:
        by_type.setdefault(c.get("Type"), []).append(c)
    extra = root.findtext("ExtraParams") or ""
    stop = re.search(r"--stop-timeout[ =](\d+)", extra)
    (port,) = by_type["Port"]
    return Manifest(
        name=path.name,
        env={c.get("Target"): c.text or c.get("Default") for c in by_type.get("Variable", [])},
        container_port=int(port.get("Target")),
        volumes={c.get("Target"): c.get("Mode") for c in by_type["Path"]},
        image=root.findtext("Repository"),
        healthcheck=None,
        stop_grace_s=float(stop.group(1)) if stop else 10.0,  # Docker's default stop timeout
        gpu="--runtime=nvidia" in extra or "--gpus" in extra,
        extra={"root": root},
    )


def systemd_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values (systemd allows a key many times, e.g. Environment=)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def systemd(path: Path) -> Manifest:
    """A Manifest from the bare-metal unit (no image, no container paths: host paths instead)."""
    service = systemd_unit(path)["Service"]
    env = dict(e.split("=", 1) for e in service["Environment"])
    return Manifest(
        name=path.name,
        env=env,
        container_port=int(env["HEARTH_BIND"].rsplit(":", 1)[1]),
        volumes={env["HEARTH_DATA"]: "rw", env["HEARTH_MODELS_DIR"]: "ro"},
        image=None,
        healthcheck=None,
        stop_grace_s=float(service["TimeoutStopSec"][0]),
        gpu=False,
        extra={"service": service},
    )


def all_manifests() -> list[Manifest]:
    """Every install method Hearth ships, each read in its own format."""
    base = compose()
    gpu = merge(base, load_yaml(REPO / "compose.gpu.yaml"))
    out = [
        from_compose_service("docker-compose.yml", base["services"]["hearth"]),
        from_compose_service("docker-compose.yml + compose.gpu.yaml", gpu["services"]["hearth"]),
    ]
    for folder in ("Hearth", "Hearth_Nvidia"):
        doc = load_yaml(APPLIANCE / "casaos" / folder / "docker-compose.yml")
        out.append(from_compose_service(f"casaos/{folder}", doc["services"]["hearth"]))
    out.append(unraid(APPLIANCE / "unraid" / "hearth.xml"))
    out.append(unraid(APPLIANCE / "unraid" / "hearth-nvidia.xml"))
    for gpu_on in (False, True):
        rendered = render_truenas(truenas_values(hearth={"nvidia_gpu": gpu_on}))
        service = rendered["services"]["hearth"]
        out.append(from_compose_service(f"truenas (nvidia_gpu={gpu_on})", service))
    umbrel = load_yaml(APPLIANCE / "umbrel" / "hearth" / "docker-compose.yml")
    proxy = umbrel["services"]["app_proxy"]["environment"]
    # Umbrel publishes no port itself: its app_proxy forwards to APP_PORT.
    out.append(from_compose_service("umbrel", umbrel["services"]["hearth"], port=int(proxy["APP_PORT"])))
    out.append(systemd(APPLIANCE / "systemd" / "hearth.service"))
    return out


MANIFESTS = all_manifests()
REFERENCE = MANIFESTS[0]
NVIDIA_VARIANTS = {"docker-compose.yml + compose.gpu.yaml", "casaos/Hearth_Nvidia", "hearth-nvidia.xml",
                   "truenas (nvidia_gpu=True)"}


def dockerfile_healthcheck() -> list[str]:
    """The exec-form command of the Dockerfile's HEALTHCHECK, as a compose `test` list."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    (line,) = [ln for ln in text.splitlines() if ln.startswith("HEALTHCHECK")]
    return ["CMD", *yaml.safe_load(line.split(" CMD ", 1)[1])]


@pytest.mark.parametrize("m", MANIFESTS, ids=lambda m: m.name)
def test_manifest_agrees_with_docker_compose(m):
    # Bare metal names its user in the unit (User=/Group=), not with PUID/PGID.
    required = REQUIRED_ENV - {"PUID", "PGID"} if m.image is None else REQUIRED_ENV
    assert required <= set(m.env), f"{m.name} lacks {required - set(m.env)}"
    assert m.env["HEARTH_BIND"] == REFERENCE.env["HEARTH_BIND"]
    assert m.container_port == REFERENCE.container_port == int(m.env["HEARTH_BIND"].rsplit(":", 1)[1])
    assert m.stop_grace_s == REFERENCE.stop_grace_s
    if m.image is None:  # bare metal: host folders, named by the same variables
        assert set(m.volumes) == {m.env["HEARTH_DATA"], m.env["HEARTH_MODELS_DIR"]}
        return
    for var in ("HEARTH_DATA", "HEARTH_MODELS_DIR"):
        assert m.env[var] == REFERENCE.env[var]
    assert m.volumes == REFERENCE.volumes == {"/data": "rw", "/models": "ro"}
    assert m.healthcheck in (None, REFERENCE.healthcheck)
    assert m.gpu == (m.name in NVIDIA_VARIANTS)
    assert m.image == f"{IMAGE}:{VERSION}{'-cuda' if m.gpu else ''}"


def test_compose_healthcheck_is_the_images():
    assert REFERENCE.healthcheck == dockerfile_healthcheck()


def test_stop_grace_period_covers_gunicorns_graceful_timeout():
    from app.serve import gunicorn_settings

    assert REFERENCE.stop_grace_s > gunicorn_settings("127.0.0.1:1")["graceful_timeout"]


IMAGE_FILES = ["Dockerfile", "docker-compose.yml", "compose.gpu.yaml", *(
    str(p.relative_to(REPO)) for p in sorted(APPLIANCE.rglob("*")) if p.is_file() and p.suffix in (".yml", ".yaml", ".xml"))]


@pytest.mark.parametrize("name", IMAGE_FILES)
def test_no_latest_tag(name):
    text = (REPO / name).read_text()
    assert not re.search(r":latest\b", text), name
    for ref in re.findall(r"(?:\bimage:|<Repository>|IMAGE=)[ \t]*\"?([^\s\"<{]+)", text):
        assert re.fullmatch(r"[\w.\-/]+:[\w.\-]*\d[\w.\-]*", ref), f"{name}: {ref} is not pinned to a version tag"


def test_truenas_image_tags_are_pinned():
    images = load_yaml(APPLIANCE / "truenas" / "hearth" / "ix_values.yaml")["images"]
    assert {k: f"{v['repository']}:{v['tag']}" for k, v in images.items()} == {
        "image": f"{IMAGE}:{VERSION}", "cuda_image": f"{IMAGE}:{VERSION}-cuda"}


# ---- each store's own required keys ---------------------------------------------------------------

CASAOS_CATEGORIES = {"Media", "Productivity", "Home", "Networking", "AI", "Finance", "Social", "Developer", "Others"}


@pytest.mark.parametrize("folder", ["Hearth", "Hearth_Nvidia"])
def test_casaos_store_info(folder):
    # IceWhaleTech/CasaOS-AppStore docs/specs/compose-and-x-casaos.md: required id, main, port_map
    # (a string), icon, title (locale object), category (fixed list), version; recommended the rest.
    doc = load_yaml(APPLIANCE / "casaos" / folder / "docker-compose.yml")
    info = doc["x-casaos"]
    assert re.fullmatch(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)+", info["id"])
    assert info["main"] in doc["services"]
    assert isinstance(info["port_map"], str) and info["port_map"] == str(REFERENCE.container_port)
    assert info["icon"].startswith("https://")
    for key in ("title", "tagline", "description"):
        assert info[key]["en_US"].strip(), key
    assert info["category"] in CASAOS_CATEGORIES
    assert info["version"] == VERSION
    assert info["author"] and info["developer"]
    assert set(info["architectures"]) <= {"amd64", "arm64", "arm"} and info["architectures"]
    assert doc["name"] and re.fullmatch(r"[a-z0-9][a-z0-9_-]*", doc["name"])
    # Service level: a description for every variable, port and volume the service has.
    service = doc["services"][info["main"]]
    described = service["x-casaos"]
    assert {e["container"] for e in described["envs"]} == set(service["environment"])
    assert {p["container"] for p in described["ports"]} == {str(p["target"]) for p in service["ports"]}
    assert {v["container"] for v in described["volumes"]} == {v["target"] for v in service["volumes"]}
    for item in described["envs"] + described["ports"] + described["volumes"]:
        assert item["description"]["en_US"].strip()


def test_casaos_app_ids_differ():
    ids = {load_yaml(APPLIANCE / "casaos" / f / "docker-compose.yml")["x-casaos"]["id"] for f in ("Hearth", "Hearth_Nvidia")}
    assert len(ids) == 2


UNRAID_KEYS = ["Name", "Repository", "Registry", "Network", "Privileged", "Support", "Project", "Overview",
               "Category", "WebUI", "TemplateURL", "Icon", "ExtraParams"]
UNRAID_CONFIG_ATTRS = {"Name", "Target", "Default", "Mode", "Description", "Type", "Display", "Required", "Mask"}


@pytest.mark.parametrize("name", ["hearth.xml", "hearth-nvidia.xml"])
def test_unraid_template(name):
    m = unraid(APPLIANCE / "unraid" / name)
    root = m.extra["root"]
    assert root.tag == "Container" and root.get("version") == "2"
    for key in UNRAID_KEYS:
        assert root.find(key) is not None, key
    assert root.findtext("WebUI") == f"http://[IP]:[PORT:{m.container_port}]/"
    assert root.findtext("TemplateURL").endswith(f"/appliance/unraid/{name}")
    for config in root.findall("Config"):
        assert UNRAID_CONFIG_ATTRS <= set(config.attrib), config.get("Name")
        assert config.get("Type") in {"Port", "Path", "Variable", "Device", "Label"}
    nvidia = name == "hearth-nvidia.xml"
    assert ("NVIDIA_VISIBLE_DEVICES" in m.env) == nvidia
    assert ("--runtime=nvidia" in root.findtext("ExtraParams")) == nvidia
    assert (m.env["PUID"], m.env["PGID"]) == ("99", "100")  # Unraid's nobody:users


TRUENAS_APP_KEYS = ["app_version", "capabilities", "categories", "description", "home", "host_mounts", "icon",
                    "keywords", "maintainers", "name", "run_as_context", "screenshots", "sources", "title",
                    "train", "version"]


def test_truenas_app_metadata():
    folder = APPLIANCE / "truenas" / "hearth"
    app = load_yaml(folder / "app.yaml")
    for key in TRUENAS_APP_KEYS:
        assert key in app, key
    assert app["app_version"] == VERSION and app["name"] == "hearth"
    assert re.fullmatch(r"\d+\.\d+\.\d+", app["version"])
    values = truenas_values()
    (context,) = app["run_as_context"]
    assert (context["uid"], context["gid"]) == (values["run_as"]["user"], values["run_as"]["group"]) == (568, 568)
    questions = load_yaml(folder / "questions.yaml")
    groups = {g["name"] for g in questions["groups"]}
    assert {q["group"] for q in questions["questions"]} <= groups
    assert values["hearth"]["nvidia_gpu"] is False  # no GPU unless the admin asks for one


def test_truenas_template_runs_unprivileged_and_follows_the_answers():
    default = render_truenas(truenas_values())["services"]["hearth"]
    assert default["user"] == "568:568"
    assert {v["source"] for v in default["volumes"]} == set(TRUENAS_IX_VOLUMES.values())
    custom = render_truenas(truenas_values(
        run_as={"user": 3000, "group": 3001}, network={"web_port": 30080},
        storage={"models": {"type": "host_path", "host_path_config": {"path": "/mnt/tank/gguf"}}},
        hearth={"additional_envs": [{"name": "HEARTH_EXTRA", "value": "a b"}]}))["services"]["hearth"]
    assert custom["user"] == "3000:3001"
    assert (custom["environment"]["PUID"], custom["environment"]["PGID"]) == ("3000", "3001")
    assert custom["ports"] == ["30080:8080"]
    assert {"type": "bind", "source": "/mnt/tank/gguf", "target": "/models", "read_only": True} in custom["volumes"]
    assert custom["environment"]["HEARTH_EXTRA"] == "a b"


UMBREL_KEYS = ["manifestVersion", "id", "category", "name", "version", "tagline", "description", "developer",
               "website", "dependencies", "repo", "support", "port", "gallery", "path", "defaultUsername",
               "defaultPassword", "submitter", "submission"]


def test_umbrel_app():
    folder = APPLIANCE / "umbrel" / "hearth"
    app = load_yaml(folder / "umbrel-app.yml")
    for key in UMBREL_KEYS:
        assert key in app, key
    assert app["manifestVersion"] in (1, 1.1)
    assert re.fullmatch(r"[a-z][a-z0-9-]*", app["id"])
    assert app["version"] == VERSION
    doc = load_yaml(folder / "docker-compose.yml")
    proxy = doc["services"]["app_proxy"]["environment"]
    service = next(name for name in doc["services"] if name != "app_proxy")
    assert proxy["APP_HOST"] == f"{app['id']}_{service}_1"
    assert int(proxy["APP_PORT"]) == REFERENCE.container_port
    # Umbrel starts apps unprivileged; the data folders it creates come from this app folder.
    assert doc["services"][service]["user"] == "1000:1000"
    for volume in doc["services"][service]["volumes"]:
        host = volume.split(":")[0]
        assert host.startswith("${APP_DATA_DIR}/")
        assert (folder / host.removeprefix("${APP_DATA_DIR}/")).is_dir()


def test_systemd_unit_runs_hearth_serve_unprivileged_and_stops_gently():
    m = systemd(APPLIANCE / "systemd" / "hearth.service")
    service = m.extra["service"]
    assert service["User"] == ["hearth"] and service["Group"] == ["hearth"]
    (exec_start,) = service["ExecStart"]
    assert exec_start == ("/opt/hearth/venv/bin/python -m app.entrypoint "
                          "/opt/hearth/venv/bin/hearth serve --bind ${HEARTH_BIND}")
    assert service["KillSignal"] == ["SIGTERM"] and service["KillMode"] == ["mixed"]
    assert "/var/lib/" + service["StateDirectory"][0] == m.env["HEARTH_DATA"]
    assert (APPLIANCE / "systemd" / "INSTALL.md").is_file()
