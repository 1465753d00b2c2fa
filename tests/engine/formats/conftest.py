"""The vendored llama.cpp's real chat templates, by file name (skipped where the tree is not unpacked)."""

from pathlib import Path

import pytest

TEMPLATES = Path.home() / ".cache/hearth/llama-tools/0.3.36/src/llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates"


@pytest.fixture(scope="session")
def templates() -> dict[str, str]:
    """Template name (file stem) -> its text."""
    if not TEMPLATES.is_dir():
        pytest.skip(f"the vendored llama.cpp templates are not unpacked at {TEMPLATES} (scripts/build_llama_tools.sh)")
    return {p.stem: p.read_text() for p in TEMPLATES.glob("*.jinja")}
