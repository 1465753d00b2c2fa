"""Hearth's license and the third-party list the image carries (issue 54)."""

from app.devtools import licenses


def test_the_third_party_list_is_current():
    assert licenses.OUTPUT.read_text() == licenses.render(), "run: python -m app.devtools.licenses --write"


def test_every_pinned_dependency_and_front_end_library_has_a_license_named():
    python = licenses.python_packages(extras=licenses.IMAGE_EXTRAS)
    assert {"llama-cpp-python", "flask", "sqlalchemy", "gunicorn", "wyoming", "piper-tts"} <= set(python)
    assert all(lic and lic != "see the package's own files" for name, (_, lic) in python.items()
               if not name.startswith(("gemma3-270m", "joe-us-piper"))), python
    assert licenses.node_packages() == {"htmx.org": ("2.0.11", "0BSD"), "uplot": ("1.6.32", "MIT")}
    text = licenses.OUTPUT.read_text()
    assert "Gemma Terms of Use" in text and "| llama.cpp" in text
    assert licenses.REPO.joinpath("LICENSE").read_text().startswith("MIT License")
