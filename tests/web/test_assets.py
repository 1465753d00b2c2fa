"""Front-end libraries: served from node_modules through an allow-list, with a clear message when
`npm ci` has not been run."""

import json

from app.web import assets
from app.web.folders import ROOT


def test_vendor_files_come_from_node_modules_at_the_pinned_versions(client):
    pinned = json.loads((ROOT / "package.json").read_text())["dependencies"]
    for name, (package, _) in assets.VENDOR.items():
        response = client.get(f"/vendor/{name}")
        response.close()  # send_file streams the file: close it (ResourceWarning otherwise)
        assert response.status_code == 200, name
        assert response.headers["Cache-Control"] == "public, max-age=31536000"
        installed = json.loads((assets.NODE_MODULES / package / "package.json").read_text())["version"]
        assert installed == pinned[package]
        assert assets.vendor_url(name) == f"/vendor/{name}?v={installed}"


def test_only_allow_listed_files(client):
    for path in ("/vendor/package.json", "/vendor/..%2Fpackage.json", "/vendor/htmx.js", "/vendor/"):
        assert client.get(path).status_code == 404, path


def test_missing_node_modules_says_run_npm_ci(admin, monkeypatch, tmp_path):
    monkeypatch.setattr(assets, "NODE_MODULES", tmp_path / "node_modules")
    page = admin.get("/").get_data(as_text=True)
    assert "Front-end libraries are missing" in page and "npm ci" in page
    assert "/vendor/" not in page  # no script tags that would fail in the console
    response = admin.get("/vendor/htmx.min.js")
    assert response.status_code == 503 and "run `npm ci`" in response.get_data(as_text=True)
