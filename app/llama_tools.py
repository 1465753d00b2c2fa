"""Stock llama.cpp tools (llama-server, llama-batched-bench) built for the pinned llama-cpp-python:
where scripts/build_llama_tools.sh puts them and how to find them."""

from __future__ import annotations

import importlib.metadata
import os
import re
import tomllib
from pathlib import Path

BUILD_SCRIPT = "scripts/build_llama_tools.sh"

# The build script's default; both honour HEARTH_TOOLS_CACHE so a moved cache is still found.
_DEFAULT_TOOLS_CACHE = Path("~/.cache/hearth/llama-tools")
_PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
_PIN = re.compile(r"^\s*llama-cpp-python\s*==\s*([^\s;,]+)")


class LlamaToolsNotFound(FileNotFoundError):
    """A stock llama.cpp tool is not built, or the pinned version cannot be told."""


def pinned_llama_cpp_version() -> str:
    """The llama-cpp-python version the reference tools are built for (pyproject pin, else installed)."""
    # The pin first: it is what scripts/build_llama_tools.sh reads, so both name the same folder.
    if _PYPROJECT.is_file():
        with _PYPROJECT.open("rb") as handle:
            dependencies = tomllib.load(handle).get("project", {}).get("dependencies", [])
        for dependency in dependencies:
            match = _PIN.match(dependency)
            if match:
                return match.group(1)
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError as exc:
        raise LlamaToolsNotFound(
            "cannot tell which llama-cpp-python version to look for: no pin in pyproject.toml "
            "and llama-cpp-python is not installed"
        ) from exc


def tools_cache_dir() -> Path:
    """The folder holding the built llama.cpp tools for the pinned version."""
    root = os.environ.get("HEARTH_TOOLS_CACHE") or str(_DEFAULT_TOOLS_CACHE)
    return Path(root).expanduser() / pinned_llama_cpp_version()


def stock_llama_server() -> Path | None:
    """The built stock llama-server for the pinned version, or None when it is not built."""
    path = tools_cache_dir() / "bin" / "llama-server"
    return path if path.is_file() else None
