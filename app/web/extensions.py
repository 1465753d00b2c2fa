"""The dashboard's Flask extensions, created unbound here and bound to the app by app.web.init_app."""

from __future__ import annotations

from flask_limiter import Limiter
from flask_limiter.util import get_remote_address
from flask_wtf.csrf import CSRFProtect

csrf = CSRFProtect()
# Memory storage: one gunicorn worker (enforced by hearth serve), so one counter per client IP.
limiter = Limiter(get_remote_address, storage_uri="memory://", headers_enabled=True)
