"""Front-end libraries served from node_modules (installed by `npm ci` at the versions pinned in
package.json) through an allow-list: they are never copied into the repository."""

from __future__ import annotations

import functools
import json

from flask import Blueprint, Response, abort, send_file

from app.web.folders import ROOT

bp = Blueprint("assets", __name__)

NODE_MODULES = ROOT / "node_modules"

# URL name -> (npm package, file inside it). Nothing else under node_modules is reachable.
VENDOR = {
    "htmx.min.js": ("htmx.org", "dist/htmx.min.js"),
    "uPlot.iife.min.js": ("uplot", "dist/uPlot.iife.min.js"),
    "uPlot.min.css": ("uplot", "dist/uPlot.min.css"),
}
MIMETYPES = {".js": "text/javascript", ".css": "text/css"}


def missing_assets() -> list[str]:
    """Vendor files absent from node_modules (empty when `npm ci` has run)."""
    return [name for name, (package, path) in VENDOR.items() if not (NODE_MODULES / package / path).is_file()]


@functools.cache
def _package_version(package: str) -> str:
    try:
        return json.loads((NODE_MODULES / package / "package.json").read_text())["version"]
    except (OSError, ValueError, KeyError):
        return "missing"


def vendor_url(name: str) -> str:
    """The URL of a vendor file, versioned so browsers may cache it for long."""
    package, _ = VENDOR[name]
    return f"/vendor/{name}?v={_package_version(package)}"


@bp.get("/vendor/<name>")
def vendor(name: str):
    """One allow-listed file from node_modules; a clear 503 when `npm ci` has not been run."""
    if name not in VENDOR:
        abort(404)
    package, path = VENDOR[name]
    file = NODE_MODULES / package / path
    if not file.is_file():
        return Response(f"/* {package} is not installed: run `npm ci` in {ROOT} */\n", status=503,
                        mimetype=MIMETYPES[file.suffix])
    return send_file(file, mimetype=MIMETYPES[file.suffix], max_age=365 * 24 * 3600)
