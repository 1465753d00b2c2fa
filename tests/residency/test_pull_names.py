"""Pulled names are cleaned before they become files and served model names (no CR/LF, NUL or other control
and format characters, no path separators), and a pull never takes an alias's name: refused, naming the alias."""

from __future__ import annotations

import pytest
from test_pull_safety import _ended, models, weights  # noqa: F401  (fixtures)

from app.devtools.hub_server import HubServer
from app.residency.library import Library, clean_name


@pytest.mark.parametrize("raw, clean", [
    ("model.gguf", "model.gguf"),
    ("evil\r\nname.gguf", "evil name.gguf"),
    ("nul\x00byte.gguf", "nulbyte.gguf"),
    ("right\u202eto-left.gguf", "rightto-left.gguf"),  # a bidi override would show the name reversed
    ("a/b\\c.gguf", "a-b-c.gguf"),
    ("../../etc.gguf", "-..-etc.gguf"),
    (".hidden.gguf", "hidden.gguf"),
    ("  spaced\t\tout .gguf", "spaced out.gguf"),
    ("x" * 300 + ".gguf", "x" * 60 + ".gguf"),
])
def test_a_pulled_name_is_cleaned(raw, clean):
    assert clean_name(raw) == clean


def test_a_url_with_cr_lf_in_its_file_name_lands_under_a_clean_name(weights, models):  # noqa: F811
    server = HubServer({"evil%0D%0Aname.gguf": weights, "%00.gguf": weights})
    try:
        lib = Library(models, check_header=lambda m: None, on_done=lambda path: None)
        port = server.url.rsplit(":", 1)[1]
        p = _ended(lib.start(f"http://localhost:{port}/files/evil%0D%0Aname.gguf", allowed_hosts="localhost"))
        assert p.state == "done", p.error
        assert [f.name for f in models.iterdir()] == ["evil name.gguf"]
        nameless = _ended(lib.start(f"http://localhost:{port}/files/%00.gguf", allowed_hosts="localhost"))
        assert nameless.state == "refused" and "has no name before .gguf" in nameless.error
        assert "null byte" not in nameless.error
    finally:
        server.close()


def test_a_pull_named_like_an_alias_is_refused_naming_the_alias(weights, models):  # noqa: F811
    server = HubServer({"family.gguf": weights})
    try:
        aliases = {"family": "gemma-3-270m-q4_k_m"}
        lib = Library(models, check_header=lambda m: None, on_done=lambda path: None,
                      name_problem=lambda name: f"'{name}' is the alias of the model '{aliases[name]}'"
                      if name in aliases else None)
        p = _ended(lib.start(f"http://localhost:{server.url.rsplit(':', 1)[1]}/files/family.gguf",
                             allowed_hosts="localhost"))
        assert p.state == "refused" and p.code == "exists"
        assert "'family' is the alias of the model 'gemma-3-270m-q4_k_m'" in p.error
        assert list(models.iterdir()) == []  # not a byte written
    finally:
        server.close()
