"""Settings: the stored settings, checked by the registry (app/store/settings.py), and the admin password.

Kinds, bounds, units, sections and "needs a restart" are the registry's; this page only renders them
and passes what was typed to its `validate`, as `hearth settings set` does. Values provided by
environment variables are shown as such and cannot be edited here: the variable wins until it is
unset. An empty field restores the default.
"""

from __future__ import annotations

import os
from collections.abc import Collection

from flask import (
    Blueprint,
    flash,
    redirect,
    render_template,
    request,
    url_for,
)
from werkzeug.security import check_password_hash

from app.gateway.context import Services, services
from app.store.settings import (
    REGISTRY,
    SECTIONS,
    Invalid,
    SettingDef,
    conflicts,
    get_setting,
    run_time_choices,
    set_setting,
    validate,
)
from app.web.auth import (
    log_in,
    login_required,
    password_hash,
    password_problem,
    set_password,
)

bp = Blueprint("settings", __name__)


def _choices(svc: Services, session, name: str) -> Collection[str] | None:
    """A choice setting's options: the models this serve can serve now, the classes in the store."""
    if name == "default_model":
        return set(svc.catalog.model_specs()) | {m["id"] for m in svc.router.model_list()}
    return run_time_choices(session, name)


def _env(d: SettingDef) -> str | None:
    """The environment variable that currently overrides this setting, if any."""
    return d.env if d.env and os.environ.get(d.env) else None


def _rows(svc: Services, session, values: dict, errors: dict) -> dict[str, list[dict]]:
    """Settings grouped by section, with what to show for each."""
    sections: dict[str, list[dict]] = {s: [] for s in SECTIONS}
    for name, d in REGISTRY.items():
        stored = get_setting(session, name)
        shown = values.get(name, stored)
        options: list[str] = []
        if d.kind == "choice":
            # What is stored or was typed stays offered even when it is no longer a choice, so the form shows it.
            offered = set(_choices(svc, session, name) or ()) | set(d.choices)
            options = sorted(offered | ({str(shown)} if shown not in (None, "") else set()))
        sections[d.section].append({
            "name": name,
            "d": d,
            "help": d.help[:1].upper() + d.help[1:],
            "help_has_default": "(default" in d.help,
            "bounds": d.bounds(),
            "options": options,
            "value": "" if shown is None else shown,
            "is_default": stored is None or stored == d.default,
            "env": _env(d),
            "env_value": os.environ.get(d.env) if d.env else None,
            "error": errors.get(name),
        })
    return {k: v for k, v in sections.items() if v}


def _render(svc: Services, session, values: dict, errors: dict, password_error: str | None):
    return render_template("settings/index.html", sections=_rows(svc, session, values, errors), errors=errors,
                           password_error=password_error, models_dir=svc.catalog.models_dir)


@bp.get("/settings")
@login_required
def index():
    """The settings form."""
    svc = services()
    with svc.sessions() as session:
        return _render(svc, session, {}, {}, None)


@bp.post("/settings")
@login_required
def save():
    """Validate every submitted setting with the registry; store them only when all are valid."""
    svc = services()
    values, errors = {}, {}
    with svc.write_sessions() as session:
        for name, d in REGISTRY.items():
            if _env(d):
                continue
            if d.kind != "bool" and name not in request.form:
                continue
            # An unticked checkbox is not sent at all.
            raw = request.form.get(name, "off") if d.kind == "bool" else request.form.get(name)
            try:
                values[name] = validate(name, raw, _choices(svc, session, name))
            except Invalid as exc:
                errors[name] = str(exc)
                values[name] = raw
        if not errors:
            effective = {n: get_setting(session, n) for n in REGISTRY} | values
            errors = conflicts(effective)
        if errors:
            return _render(svc, session, values, errors, None), 400
        changed = [n for n, v in values.items() if get_setting(session, n) != (REGISTRY[n].default if v is None else v)]
        for name in changed:
            set_setting(session, name, values[name])
        session.commit()
    if changed:
        restart = sorted(n for n in changed if REGISTRY[n].restart)
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
    svc = services()
    current = request.form.get("current", "")
    error = None
    if not check_password_hash(password_hash() or "", current):
        error = "The current password is wrong."
    else:
        error = password_problem(request.form.get("password", ""), request.form.get("confirm", ""))
    if error:
        with svc.sessions() as session:
            return _render(svc, session, {}, {}, error), 400
    set_password(request.form["password"])
    log_in(password_hash())
    flash("Admin password changed; other sessions are logged out.", "ok")
    return redirect(url_for("settings.index"))
