"""The dashboard: Flask blueprints (one module per page) wired into `hearth serve` by `init_app`.

Each module named in BLUEPRINTS exposes `bp`; pages append their module here. Templates live in
the repository's `templates/`, static files in `static/`, front-end libraries in `node_modules/`
(served by app.web.assets). Views read the typed services from `app.gateway.context.services()`;
they never drive collection.
"""

from __future__ import annotations

from datetime import timedelta
from importlib import import_module

from flask import Flask, current_app, render_template, request
from flask.sessions import SecureCookieSessionInterface
from werkzeug.exceptions import HTTPException
from werkzeug.middleware.proxy_fix import ProxyFix
from werkzeug.routing import RequestRedirect

# The folders and the extensions live in modules of their own: the page modules import them from
# there, never from this package, which imports the page modules. app.factory reads the folders here.
from app.residency.manager import ModelState
from app.web.extensions import csrf, limiter
from app.web.folders import STATIC_DIR as STATIC_DIR
from app.web.folders import TEMPLATES_DIR as TEMPLATES_DIR

BLUEPRINTS = (
    "app.web.auth",
    "app.web.assets",
    "app.web.series",
    "app.web.overview",
    "app.web.status",
    "app.web.settings",
    "app.web.classes",
    "app.web.members",
    "app.web.requests",
    "app.web.models",
    "app.web.preload",
    "app.web.bench",
    "app.web.progress",
)

# (label, path) of the navigation; a link shows only when some view serves its path.
NAV = (
    ("Overview", "/"),
    ("Models", "/models"),
    ("Preload", "/preload"),
    ("Classes", "/classes"),
    ("Requests", "/requests"),
    ("Members", "/members"),
    ("Bench", "/bench"),
    ("Settings", "/settings"),
    ("Status", "/status"),
)

class _SchemeAwareSessions(SecureCookieSessionInterface):
    """Session cookies are Secure exactly when the request came over HTTPS.

    A household LAN often serves plain http: a fixed Secure flag would make the browser drop the
    cookie and login would silently loop. Over HTTPS (directly, or behind a proxy that
    `proxy_hops` trusts for X-Forwarded-Proto) the cookie never travels in clear.
    """

    def get_cookie_secure(self, app: Flask) -> bool:
        """Secure when this request is HTTPS, or when SESSION_COOKIE_SECURE forces it."""
        return bool(app.config["SESSION_COOKIE_SECURE"]) or request.is_secure


def nav_items() -> list[dict]:
    """Navigation links whose path is served by a registered view, with the current one marked."""
    adapter = current_app.url_map.bind("")
    items = []
    for label, path in NAV:
        try:
            endpoint, _ = adapter.match(path, method="GET")
        except RequestRedirect:
            endpoint = None
            for rule in current_app.url_map.iter_rules():
                if rule.rule.rstrip("/") == path:
                    endpoint = rule.endpoint
        except HTTPException:
            continue
        if endpoint is None or endpoint not in current_app.view_functions:
            continue
        here = request.path
        active = here == path if path == "/" else here == path or here.startswith(path + "/")
        items.append({"label": label, "path": path, "endpoint": endpoint, "active": active})
    return items


def wants_html() -> bool:
    """True for dashboard paths; the OpenAI API, /healthz, /metrics and /api/ answer JSON or text."""
    path = request.path
    return not (path.startswith(("/v1/", "/api/")) or path in ("/healthz", "/metrics"))


def render_error(exc: HTTPException):
    """An HTML error page for dashboard paths, keeping the exception's headers (Retry-After, Allow…)."""
    code = exc.code or 500
    body = render_template("errors/error.html", code=code, name=exc.name, description=exc.description), code
    response = current_app.make_response(body)
    if exc.response is not None:
        for key, value in exc.response.headers.items():
            if key.lower() not in ("content-type", "content-length"):
                response.headers[key] = value
    else:
        for key, value in exc.get_headers():
            if key.lower() != "content-type":
                response.headers[key] = value
    return response


def fmt_num(value, digits: int | None = None) -> str:
    """A number for a tile: '–' for none, fewer decimals as it grows."""
    if value is None:
        return "–"
    if digits is None:
        digits = 0 if abs(value) >= 100 else 1 if abs(value) >= 10 else 2 if value else 0
    return f"{value:,.{digits}f}"


def fmt_bytes(value) -> str:
    """Bytes in binary units (GiB, MiB…); '–' for none."""
    if value is None:
        return "–"
    value = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def fmt_duration_s(value) -> str:
    """Seconds as '850 ms', '12 s', '3 min' or '5 h'; '–' for none."""
    if value is None:
        return "–"
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 120:
        return f"{value:.0f} s"
    if value < 7200:
        return f"{value / 60:.0f} min"
    return f"{value / 3600:.0f} h"


def init_app(app: Flask) -> None:
    """Session, CSRF, rate limiting, proxy trust, then every blueprint in BLUEPRINTS."""
    from app.gateway.context import services
    from app.secrets import secret

    svc = services(app)
    if not app.config.get("SECRET_KEY"):
        app.config["SECRET_KEY"] = secret(svc.data_dir, "session_key")
    app.config.update(
        SESSION_COOKIE_NAME="hearth_session",
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Lax",
        # The token lives as long as the admin's session: a dashboard tab left open for hours
        # must still be able to submit its forms.
        WTF_CSRF_TIME_LIMIT=None,
        PERMANENT_SESSION_LIFETIME=timedelta(days=14),
    )
    app.session_interface = _SchemeAwareSessions()
    hops = int(svc.settings.get("proxy_hops") or 0)
    if hops:
        app.wsgi_app = ProxyFix(app.wsgi_app, x_for=hops, x_proto=hops, x_host=hops, x_prefix=hops)
    csrf.init_app(app)
    # The OpenAI (transcriptions too), Ollama, Anthropic and Responses APIs authenticate every call by bearer token, never by cookie:
    # no CSRF there.
    for name in ("gateway", "ollama", "vendors", "audio"):
        if name in app.blueprints:
            csrf.exempt(app.blueprints[name])
    # The limiter object is shared by every app in this process, and flask-limiter keeps the last
    # app's RATELIMIT_ENABLED as its own default: state it per app, so a bench app built without
    # limits never switches the login limit off for the next one.
    app.config.setdefault("RATELIMIT_ENABLED", True)
    limiter.init_app(app)
    app.add_template_filter(fmt_num, "num")
    app.add_template_filter(fmt_bytes, "bytes")
    app.add_template_filter(fmt_duration_s, "duration")
    app.add_template_global(svc.writer.health, "telemetry_health")
    # Templates compare model states with the enum's members, not with strings of their own.
    app.add_template_global(ModelState, "ModelState")
    for module in BLUEPRINTS:
        app.register_blueprint(import_module(module).bp)

    @app.context_processor
    def _layout():
        from app.web.assets import missing_assets, vendor_url
        from app.web.auth import is_admin

        return {"nav_items": nav_items, "missing_assets": missing_assets, "vendor_url": vendor_url,
                "is_admin": is_admin}

