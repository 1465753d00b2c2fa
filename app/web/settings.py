"""Settings: the stored settings (app/store/settings.py REGISTRY) with validation, and the admin password.

Values provided by environment variables are shown as such and cannot be edited here: the
variable wins until it is unset. An empty field restores the default.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flask import (
    Blueprint,
    current_app,
    flash,
    redirect,
    render_template,
    request,
    url_for,
)
from werkzeug.security import check_password_hash

from app.store.settings import REGISTRY, get_setting, set_setting
from app.web.auth import (
    log_in,
    login_required,
    password_hash,
    password_problem,
    set_password,
)

bp = Blueprint("settings", __name__)


@dataclass(frozen=True)
class Field:
    """How a setting is entered and checked: kind ('int', 'float', 'bool', 'str'), bounds, section."""

    kind: str
    section: str
    minimum: float | None = None
    maximum: float | None = None
    unit: str = ""
    label: str = ""


# Bounds are what Hearth can run with; settings registered later without an entry here are
# edited by the kind of their default.
FIELDS = {
    "memory_limit_mb": Field("int", "Memory", 256, 16 * 1024 * 1024, "MiB", label="Memory budget"),
    "memory_reserve_mb": Field("int", "Memory", 0, 16 * 1024 * 1024, "MiB", label="Memory reserve"),
    "models_dir": Field("str", "Models and runners", label="Models folder"),
    "default_model": Field("str", "Models and runners", label="Default model"),
    "runner_ctx": Field("int", "Models and runners", 256, 1 << 20, "cells", label="KV cells per runner"),
    "runner_parallel": Field("int", "Models and runners", 1, 256, "slots", label="Sequence slots per runner"),
    "runner_batch": Field("int", "Models and runners", 32, 65536, "tokens", label="Batch size (n_batch)"),
    "runner_threads": Field("int", "Models and runners", 1, 1024, "threads", label="CPU threads per runner"),
    "rescan_interval_s": Field("int", "Models and runners", 5, 86400, "s", label="Models folder rescan"),
    "max_in_flight_total": Field("int", "Gateway", 1, 100000, "requests", label="Requests in flight"),
    "samples_retention_h": Field("float", "Telemetry", 1, 24 * 365, "h", label="Keep 1-second samples"),
    "bind": Field("str", "Network and access", label="Bind address"),
    "proxy_hops": Field("int", "Network and access", 0, 10, label="Trusted reverse proxies"),
    "status_public": Field("bool", "Network and access", label="Public status page"),
    "verdict_min_gain": Field("float", "Bench verdict", 1, 100, "×", label="Gain that justifies batching"),
    "verdict_rare_overlap_share": Field("float", "Bench verdict", 0, 1, label="Rare-overlap share"),
    "verdict_default_overlap": Field("int", "Bench verdict", 1, 64, label="Default overlap level"),
    "verdict_interactive_max_priority": Field("int", "Bench verdict", 0, 100, label="Interactive up to priority"),
    "verdict_flat_gain": Field("float", "Bench verdict", 1, 100, "×", label="Flat gain step"),
    "verdict_burst_overlap": Field("int", "Bench verdict", 2, 1024, "requests", label="Burst: requests at once"),
}
SECTIONS = ("Memory", "Models and runners", "Gateway", "Telemetry", "Network and access", "Bench verdict", "Other")
# Environment variables that override a stored setting.
ENV_OVERRIDES = {"models_dir": "HEARTH_MODELS_DIR", "bind": "HEARTH_BIND"}
# Read once when hearth serve starts.
RESTART = {"models_dir", "bind", "proxy_hops", "max_in_flight_total", "rescan_interval_s"}
_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):(\d{1,5})$")


def label_of(name: str) -> str:
    """The name the admin reads: the field's label, else the setting name in words without its unit."""
    field = FIELDS.get(name)
    if field is not None and field.label:
        return field.label
    words = re.sub(r"_(mb|s|h|ms)$", "", name).replace("_", " ")
    return words[:1].upper() + words[1:]


def field_of(name: str) -> Field:
    """The entry rules of a setting (inferred from its default when not listed)."""
    if name in FIELDS:
        return FIELDS[name]
    default = REGISTRY[name].default
    kind = ("bool" if isinstance(default, bool) else "int" if isinstance(default, int)
            else "float" if isinstance(default, float) else "str")
    return Field(kind, "Other")


class Invalid(ValueError):
    """A value the admin must fix; the message says how."""


def _number(raw: str, field: Field) -> float | int:
    try:
        value: float | int = int(raw) if field.kind == "int" else float(raw)
    except ValueError:
        raise Invalid("Enter a whole number." if field.kind == "int" else "Enter a number.") from None
    if field.minimum is not None and value < field.minimum:
        raise Invalid(f"Use at least {field.minimum:g}{' ' + field.unit if field.unit else ''}.")
    if field.maximum is not None and value > field.maximum:
        raise Invalid(f"Use at most {field.maximum:g}{' ' + field.unit if field.unit else ''}.")
    return value


def parse_value(name: str, raw: str | None, hearth) -> Any:
    """The typed value of a submitted field (None: the default); Invalid says what to fix."""
    field = field_of(name)
    if field.kind == "bool":
        return raw in ("on", "true", "1")
    raw = (raw or "").strip()
    if raw == "":
        return None
    if field.kind in ("int", "float"):
        return _number(raw, field)
    if name == "models_dir":
        path = Path(raw).expanduser()
        if not path.is_absolute():
            raise Invalid("Use an absolute path, e.g. /srv/models.")
        if not path.is_dir():
            raise Invalid(f"{path} is not a folder on this machine.")
        return str(path)
    if name == "bind":
        match = _HOST_PORT.match(raw)
        if not match or not 1 <= int(match.group(2)) <= 65535:
            raise Invalid("Use host:port, e.g. 0.0.0.0:8080 for the whole LAN or 127.0.0.1:8080 for this machine only.")
        return raw
    if name == "default_model":
        known = set(hearth.model_specs()) | {m["id"] for m in hearth.model_list()}
        if raw not in known:
            raise Invalid(f"Unknown model; choose one of: {', '.join(sorted(known)) or 'none yet'}.")
        return raw
    return raw


def _rows(session, values: dict, errors: dict) -> dict[str, list[dict]]:
    """Settings grouped by section, with what to show for each."""
    sections: dict[str, list[dict]] = {s: [] for s in SECTIONS}
    for name, definition in REGISTRY.items():
        field = field_of(name)
        stored = get_setting(session, name)
        env = ENV_OVERRIDES.get(name)
        shown = values.get(name, stored)
        sections.setdefault(field.section, []).append({
            "name": name,
            "label": label_of(name),
            "help": definition.help[:1].upper() + definition.help[1:],
            "help_has_default": "default" in definition.help,
            "field": field,
            "default": definition.default,
            "value": "" if shown is None else shown,
            "is_default": stored is None or stored == definition.default,
            "env": env if env and os.environ.get(env) else None,
            "env_value": os.environ.get(env) if env else None,
            "restart": name in RESTART,
            "error": errors.get(name),
        })
    return {k: v for k, v in sections.items() if v}


@bp.get("/settings")
@login_required
def index():
    """The settings form."""
    hearth = current_app.extensions["hearth"]
    with hearth.sessions() as session:
        sections = _rows(session, {}, {})
    return render_template("settings/index.html", sections=sections, errors={}, password_error=None,
                           models_dir=hearth.models_dir)


@bp.post("/settings")
@login_required
def save():
    """Validate every submitted setting; store them only when all are valid."""
    hearth = current_app.extensions["hearth"]
    values, errors = {}, {}
    for name in REGISTRY:
        field = field_of(name)
        if name in ENV_OVERRIDES and os.environ.get(ENV_OVERRIDES[name]):
            continue
        if field.kind != "bool" and name not in request.form:
            continue
        try:
            values[name] = parse_value(name, request.form.get(name), hearth)
        except Invalid as exc:
            errors[name] = str(exc)
            values[name] = request.form.get(name)
    with hearth.sessions() as session:
        if errors:
            sections = _rows(session, values, errors)
            return render_template("settings/index.html", sections=sections, errors=errors, password_error=None,
                                   models_dir=hearth.models_dir), 400
        changed = [n for n, v in values.items() if get_setting(session, n) != (REGISTRY[n].default if v is None else v)]
        for name in changed:
            set_setting(session, name, values[name])
        session.commit()
    if changed:
        restart = sorted(set(changed) & RESTART)
        message = f"Saved {', '.join(changed)}; applies within 5 s."
        if restart:
            message += f" Restart hearth serve for {', '.join(restart)}."
        flash(message, "ok")
    else:
        flash("Nothing changed.", "info")
    return redirect(url_for("settings.index"))


@bp.post("/settings/password")
@login_required
def change_password():
    """Change the admin password (the current one is required); other sessions are logged out."""
    hearth = current_app.extensions["hearth"]
    current = request.form.get("current", "")
    error = None
    if not check_password_hash(password_hash() or "", current):
        error = "The current password is wrong."
    else:
        error = password_problem(request.form.get("password", ""), request.form.get("confirm", ""))
    if error:
        with hearth.sessions() as session:
            sections = _rows(session, {}, {})
        return render_template("settings/index.html", sections=sections, errors={}, password_error=error,
                               models_dir=hearth.models_dir), 400
    set_password(request.form["password"])
    log_in(password_hash())
    flash("Admin password changed; other sessions are logged out.", "ok")
    return redirect(url_for("settings.index"))
