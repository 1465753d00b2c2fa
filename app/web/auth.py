"""Admin login for the dashboard: first-run setup of the admin password, login, logout.

The admin session (a signed cookie) is separate from the API's bearer tokens: a token never opens
the dashboard and the admin cookie never authenticates /v1/. The password is stored hashed
(werkzeug's scrypt) in `<data>/secrets/admin_password`; deleting that file makes the next visit
ask for a new one at /setup. The session remembers a fingerprint of the hash, so changing the
password logs every other session out.
"""

from __future__ import annotations

import functools
import hashlib
import time
from urllib.parse import urlsplit

from flask import (
    Blueprint,
    Response,
    current_app,
    flash,
    jsonify,
    redirect,
    render_template,
    request,
    session,
    url_for,
)
from werkzeug.security import check_password_hash, generate_password_hash

from app.gateway.context import services
from app.secrets import read_secret, write_secret
from app.web import limiter

bp = Blueprint("auth", __name__)

PASSWORD_SECRET = "admin_password"
MIN_PASSWORD_LENGTH = 8
DEFAULT_LOGIN_RATE_LIMIT = "10 per minute"


def _data_dir():
    return services().data_dir


def password_hash() -> str | None:
    """The stored admin password hash, or None before first-run setup."""
    return read_secret(_data_dir(), PASSWORD_SECRET)


def _fingerprint(stored_hash: str) -> str:
    return hashlib.sha256(stored_hash.encode()).hexdigest()[:16]


def set_password(password: str) -> None:
    """Hash and store the admin password (this invalidates every existing session)."""
    write_secret(_data_dir(), PASSWORD_SECRET, generate_password_hash(password))


def password_problem(password: str, confirm: str) -> str | None:
    """Why a new password is refused, or None when it is acceptable."""
    if len(password) < MIN_PASSWORD_LENGTH:
        return f"Use at least {MIN_PASSWORD_LENGTH} characters."
    if password != confirm:
        return "The two passwords differ."
    return None


def is_admin() -> bool:
    """True when this request carries a session logged in with the current password."""
    stored = password_hash()
    return stored is not None and session.get("admin") == _fingerprint(stored)


def log_in(stored_hash: str) -> None:
    """Start a fresh admin session bound to this password hash."""
    # A fresh session on login: a session id planted before login is worthless afterwards.
    session.clear()
    session.permanent = True
    session["admin"] = _fingerprint(stored_hash)
    session["since"] = int(time.time())


def _safe_next(target: str | None) -> str:
    """Only a local path: `next` must never send the admin to another site."""
    if not target:
        return url_for("overview.index") if "overview.index" in current_app.view_functions else "/"
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or not target.startswith("/") or target.startswith("//"):
        return "/"
    return target


def _refuse(to: str) -> Response:
    """Where an anonymous request goes: htmx follows HX-Redirect, JSON callers get 401."""
    if request.headers.get("HX-Request"):
        response = Response(status=401)
        response.headers["HX-Redirect"] = to
        return response
    if request.path.startswith("/api/"):
        return jsonify(error="login required", login=to), 401
    return redirect(to)


def login_required(view):
    """Dashboard views: send to /setup before the first password exists, to /login without a session."""

    @functools.wraps(view)
    def wrapped(*args, **kwargs):
        if password_hash() is None:
            return _refuse(url_for("auth.setup"))
        if not is_admin():
            return _refuse(url_for("auth.login", next=request.full_path.rstrip("?")))
        return view(*args, **kwargs)

    return wrapped


def _login_limit() -> str:
    return current_app.config.get("LOGIN_RATE_LIMIT", DEFAULT_LOGIN_RATE_LIMIT)


@bp.route("/setup", methods=["GET", "POST"])
@limiter.limit(_login_limit, methods=["POST"])
def setup():
    """First run: create the admin password (refused once one exists)."""
    if password_hash() is not None:
        return redirect(url_for("auth.login"))
    error = None
    if request.method == "POST":
        password, confirm = request.form.get("password", ""), request.form.get("confirm", "")
        error = password_problem(password, confirm)
        if error is None:
            set_password(password)
            log_in(password_hash())
            flash("Admin password saved. Welcome to Hearth.", "ok")
            return redirect(_safe_next(None))
    return render_template("auth/setup.html", error=error), 400 if error else 200


@bp.route("/login", methods=["GET", "POST"])
@limiter.limit(_login_limit, methods=["POST"])
def login():
    """Log the admin in; wrong passwords are answered slowly by the hash and limited per client IP."""
    stored = password_hash()
    if stored is None:
        return redirect(url_for("auth.setup"))
    error = None
    if request.method == "POST":
        if check_password_hash(stored, request.form.get("password", "")):
            log_in(stored)
            return redirect(_safe_next(request.form.get("next") or request.args.get("next")))
        error = "Wrong password."
    elif is_admin():
        return redirect(_safe_next(request.args.get("next")))
    return render_template("auth/login.html", error=error, next=request.values.get("next", "")), 401 if error else 200


@bp.post("/logout")
def logout():
    """End the admin session."""
    session.clear()
    flash("Logged out.", "ok")
    return redirect(url_for("auth.login"))
