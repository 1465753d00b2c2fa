"""Admin login for the dashboard: first-run setup of the admin password, login, logout.

The admin session (a signed cookie) is separate from the API's bearer tokens: a token never opens
the dashboard and the admin cookie never authenticates /v1/. The password is stored hashed
(werkzeug's scrypt) in `<data>/secrets/admin_password`; deleting that file makes the next visit
ask for a new one at /setup. The session remembers a fingerprint of the hash, so changing the
password logs every other session out.

A signed cookie alone would stay valid after logout (whoever copied it could replay it until it
expires), so each login also gets a random session id that the server keeps in
`<data>/secrets/admin_sessions`: logout removes it, a password change removes every other one, and
a cookie whose id is not listed opens nothing.

Until an admin exists, /setup is open to the whole LAN, so it asks for a one-time setup code (as
Jenkins does with its initial admin password): generated when serve starts (or when /setup is
visited without one), printed in serve's log and kept in `<data>/secrets/setup_code`, removed once
the admin password is created. Creating it is atomic (create_secret): of two simultaneous /setup
posts exactly one becomes the admin, the other is told so.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import secrets as _random
import threading
import time
from pathlib import Path
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
from app.residency.default_model import log_line
from app.secrets import create_secret, read_secret, remove_secret, secret, secrets_dir, write_secret
from app.web.extensions import limiter

bp = Blueprint("auth", __name__)

PASSWORD_SECRET = "admin_password"
SETUP_CODE_SECRET = "setup_code"
# 12 characters without look-alikes (0/o, 1/l/i), shown in groups of 4: about 59 bits, typed by hand.
_CODE_ALPHABET = "abcdefghjkmnpqrstuvwxyz23456789"
MIN_PASSWORD_LENGTH = 8
DEFAULT_LOGIN_RATE_LIMIT = "10 per minute"
SESSIONS_SECRET = "admin_sessions"
# Ids older than this are dropped as new ones are added: the cookie itself expires after 14 days.
SESSION_ID_LIFETIME_S = 14 * 24 * 3600
MAX_ADMIN_SESSIONS = 64  # logins kept at once (browsers, phones); the oldest goes first
# One read-modify-write of the id list at a time (serve has one worker process).
_sessions_lock = threading.Lock()


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
    # The hash's fingerprint already differs; the ids go too, so no old cookie can ever match again.
    with _sessions_lock:
        remove_secret(_data_dir(), SESSIONS_SECRET)


def _new_setup_code() -> str:
    return "-".join("".join(_random.choice(_CODE_ALPHABET) for _ in range(4)) for _ in range(3))


def _normal_code(code: str) -> str:
    """The code as compared: case, spaces and dashes are the typist's, not the code's."""
    return "".join(c for c in code.lower() if c not in " -\t")


def setup_code_path(data_dir: Path) -> Path:
    """Where the setup code is kept while no admin exists."""
    return secrets_dir(data_dir) / SETUP_CODE_SECRET


def pending_setup_code(data_dir: Path, log_new: bool = True) -> str | None:
    """The one-time code /setup asks for, generated (and logged) when missing; None once an admin exists."""
    if read_secret(data_dir, PASSWORD_SECRET) is not None:
        # A code left by an interrupted setup must not linger once it cannot be used.
        remove_secret(data_dir, SETUP_CODE_SECRET)
        return None
    existing = read_secret(data_dir, SETUP_CODE_SECRET)
    if existing:
        return existing
    code = secret(data_dir, SETUP_CODE_SECRET, _new_setup_code)
    if log_new:
        log_line(f"setup code for the first admin password: {code} (also in {setup_code_path(data_dir)})")
    return code


def create_first_password(password: str) -> bool:
    """Create the admin password unless one exists (atomic); False when another request was first."""
    if not create_secret(_data_dir(), PASSWORD_SECRET, generate_password_hash(password)):
        return False
    remove_secret(_data_dir(), SETUP_CODE_SECRET)
    # Sessions of an admin whose password file was deleted end with it.
    with _sessions_lock:
        remove_secret(_data_dir(), SESSIONS_SECRET)
    return True


def password_problem(password: str, confirm: str) -> str | None:
    """Why a new password is refused, or None when it is acceptable."""
    if len(password) < MIN_PASSWORD_LENGTH:
        return f"Use at least {MIN_PASSWORD_LENGTH} characters."
    if password != confirm:
        return "The two passwords differ."
    return None


def _live_sessions() -> dict[str, int]:
    """The admin session ids the server honours, with the time each was issued."""
    raw = read_secret(_data_dir(), SESSIONS_SECRET)
    try:
        live = json.loads(raw) if raw else {}
    except ValueError:
        return {}  # unreadable: every session logs in again, none is let in by mistake
    return live if isinstance(live, dict) else {}


def _update_sessions(change) -> None:
    """Apply `change` to the id list (dropping expired and surplus ids) and store it."""
    with _sessions_lock:
        live = _live_sessions()
        change(live)
        oldest = time.time() - SESSION_ID_LIFETIME_S
        kept = sorted(((sid, at) for sid, at in live.items() if isinstance(at, int | float) and at >= oldest),
                      key=lambda item: item[1])[-MAX_ADMIN_SESSIONS:]
        write_secret(_data_dir(), SESSIONS_SECRET, json.dumps(dict(kept)))


def is_admin() -> bool:
    """True when this request carries a session logged in with the current password and not logged out."""
    stored = password_hash()
    if stored is None or session.get("admin") != _fingerprint(stored):
        return False
    sid = session.get("sid")
    return isinstance(sid, str) and sid in _live_sessions()


def log_in(stored_hash: str, only_session: bool = False) -> None:
    """Start a fresh admin session bound to this password hash (`only_session`: every other one ends)."""
    # A fresh session on login: a session id planted before login is worthless afterwards.
    old_sid = session.get("sid")
    session.clear()
    session.permanent = True
    session["admin"] = _fingerprint(stored_hash)
    now = int(time.time())
    session["since"] = now
    session["sid"] = sid = _random.token_urlsafe(24)

    def add(live: dict) -> None:
        if only_session:
            live.clear()
        live.pop(old_sid, None)
        live[sid] = now

    _update_sessions(add)


def log_out() -> None:
    """End this admin session on the server too: its cookie, replayed, opens nothing."""
    sid = session.get("sid")
    session.clear()
    if isinstance(sid, str):
        _update_sessions(lambda live: live.pop(sid, None))


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
    code = pending_setup_code(_data_dir())
    if code is None:
        return redirect(url_for("auth.login"))
    error, status = None, 200
    if request.method == "POST":
        password, confirm = request.form.get("password", ""), request.form.get("confirm", "")
        given = _normal_code(request.form.get("setup_code", ""))
        if not hmac.compare_digest(given.encode(), _normal_code(code).encode()):
            error, status = ("That is not the setup code. Copy it from Hearth's log or from the file "
                             f"{setup_code_path(_data_dir())}."), 403
        elif (error := password_problem(password, confirm)) is not None:
            status = 400
        elif not create_first_password(password):
            error, status = ("Another browser created the admin password a moment ago, so this one was not "
                             "saved. Log in with the password that was set there."), 409
        else:
            log_in(password_hash())
            flash("Admin password saved. Welcome to Hearth.", "ok")
            return redirect(_safe_next(None))
    return render_template("auth/setup.html", error=error, code_path=setup_code_path(_data_dir()),
                           lost=status == 409), status


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
    """End the admin session (on the server as well as in the browser)."""
    log_out()
    flash("Logged out.", "ok")
    return redirect(url_for("auth.login"))
