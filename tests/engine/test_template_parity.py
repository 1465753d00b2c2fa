"""Render parity without llama-server: stock llama-server's /apply-template renders, recorded as golden files, against
Hearth's chat prompt rendered in this process.

tests/data/templates/<template>.json holds what `hearth bench templates --record tests/data/templates` saw stock
llama-server render for each history (keyed by the template's file name and the sha256 of its source; a render
that prints the date keeps the date it was made on, which Hearth's template clock is set to here). The template
sources come from the llama.cpp tree vendored in the pinned llama-cpp-python sdist.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tarfile
from datetime import date
from pathlib import Path

import pytest

from app.devtools.parity.template_parity import HISTORIES, render_in_process
from app.llama_tools import pinned_llama_cpp_version, tools_cache_dir

GOLDENS = Path(__file__).resolve().parents[1] / "data" / "templates"
GOLDEN_FILES = sorted(GOLDENS.glob("*.json"))
RECORD = "hearth bench templates --record tests/data/templates"

# The pairs where Hearth renders differently on purpose (docs/templates.md says why), by template and history.
DOCUMENTED_DIFFERENCES = {
    # A template that cannot take tools is taught Hearth's generic envelope (llama-server gives it tools it ignores).
    ("HuggingFaceTB-SmolLM3-3B.jinja", "tools"): "generic tool envelope",
    ("llama-cpp-rwkv-world.jinja", "tools"): "generic tool envelope",
    ("microsoft-Phi-3.5-mini-instruct.jinja", "tools"): "generic tool envelope",
}


def _unpacked_templates() -> Path | None:
    """models/templates where scripts/build_llama_tools.sh unpacked the pinned sdist, if it did."""
    for candidate in sorted((tools_cache_dir() / "src").glob("llama_cpp_python-*/vendor/llama.cpp/models/templates")):
        return candidate
    return None


def _fetched_templates(cache: Path) -> Path:
    """The pinned sdist's models/templates, downloaded with pip once and unpacked (templates only) into cache."""
    version = pinned_llama_cpp_version()
    target = cache / f"llama-cpp-python-{version}-templates"
    if any(target.glob("*.jinja")):
        return target
    download = cache / "sdist"
    subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-deps",
                    "--no-binary", ":all:", "--dest", str(download), "--quiet"], check=True, timeout=600)
    sdist = next(download.glob("llama_cpp_python-*.tar.gz"))
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            if "/vendor/llama.cpp/models/templates/" in member.name and member.name.endswith(".jinja"):
                member.name = Path(member.name).name
                tar.extract(member, target, filter="data")
    return target


@pytest.fixture(scope="session")
def llama_templates() -> Path:
    """The vendored llama.cpp templates: the build script's unpacked tree, else fetched from the pinned sdist."""
    found = _unpacked_templates()
    if found:
        return found
    cache = Path("~/.cache/hearth/llama-templates").expanduser()
    try:
        return _fetched_templates(cache)
    except (subprocess.SubprocessError, OSError, StopIteration) as exc:
        pytest.skip(f"the pinned llama-cpp-python sdist (llama.cpp's models/templates) could not be fetched: {exc}")


def test_golden_files_cover_every_template_and_history(llama_templates):
    names = {p.name for p in llama_templates.glob("*.jinja")}
    recorded = {json.loads(p.read_text())["template"] for p in GOLDEN_FILES}
    assert recorded == names, f"golden files and templates differ; re-record with `{RECORD}`"
    for path in GOLDEN_FILES:
        assert set(json.loads(path.read_text())["renders"]) == set(HISTORIES), path.name


@pytest.mark.parametrize("golden", GOLDEN_FILES, ids=[p.stem for p in GOLDEN_FILES])
def test_hearth_renders_what_llama_server_rendered(llama_templates, golden):
    doc = json.loads(golden.read_text())
    source_path = llama_templates / doc["template"]
    assert hashlib.sha256(source_path.read_bytes()).hexdigest() == doc["sha256"], (
        f"{doc['template']} changed since its golden file was recorded; re-record with `{RECORD}`")
    source = source_path.read_text()
    day = date.fromisoformat(doc["date"]) if doc["date"] else None
    for history, body in HISTORIES.items():
        stock = doc["renders"][history]
        if "prompt" not in stock:
            continue  # llama-server refused this pair: nothing to match
        ours = render_in_process(source, body, doc["bos_token"], doc["eos_token"], day)
        documented = DOCUMENTED_DIFFERENCES.get((doc["template"], history))
        if documented:
            assert ours.prompt != stock["prompt"], (
                f"{doc['template']} / {history} now renders as llama-server does: drop it from DOCUMENTED_DIFFERENCES "
                f"and docs/templates.md")
            continue
        assert ours.error is None, f"{history}: Hearth refused what llama-server rendered: {ours.error}"
        assert ours.prompt == stock["prompt"], f"{history}: {_first_difference(stock['prompt'], ours.prompt)}"


def _first_difference(stock: str, ours: str) -> str:
    at = next((i for i in range(min(len(stock), len(ours))) if stock[i] != ours[i]), min(len(stock), len(ours)))
    return f"first difference at {at}: llama-server {stock[max(0, at - 40):at + 60]!r}, Hearth {ours[max(0, at - 40):at + 60]!r}"
