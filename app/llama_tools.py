"""Stock llama.cpp tools (llama-server, llama-batched-bench) built for the pinned llama-cpp-python:
where scripts/build_llama_tools.sh puts them and how to find them."""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import re
import tomllib
from collections.abc import Mapping
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


def tools_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The folder holding the built llama.cpp tools for the pinned version."""
    root = (os.environ if environ is None else environ).get("HEARTH_TOOLS_CACHE") or str(_DEFAULT_TOOLS_CACHE)
    return Path(root).expanduser() / pinned_llama_cpp_version()


def stock_llama_server() -> Path | None:
    """The built stock llama-server for the pinned version, or None when it is not built."""
    path = tools_cache_dir() / "bin" / "llama-server"
    return path if path.is_file() else None


# Which llama.cpp build runners load: "cpu" (the wheel's own libraries, the default) or "vulkan" (the shared
# libraries of `scripts/build_llama_tools.sh --vulkan`, or of HEARTH_LLAMA_LIB_DIR when set).
BACKEND_ENV = "HEARTH_LLAMA_BACKEND"
LIB_DIR_ENV = "HEARTH_LLAMA_LIB_DIR"
BACKENDS = ("cpu", "vulkan")


def vulkan_tools_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The folder of the Vulkan build (`scripts/build_llama_tools.sh --vulkan`) for the pinned version."""
    cpu = tools_cache_dir(environ)
    return cpu.with_name(f"{cpu.name}-vulkan")


def vulkan_llama_server() -> Path | None:
    """Stock llama-server of the Vulkan build, or None when it is not built."""
    path = vulkan_tools_dir() / "bin" / "llama-server"
    return path if path.is_file() else None


def vulkan_lib_dir(environ: Mapping[str, str] | None = None) -> Path | None:
    """The Vulkan build's folder of libllama/libggml*/libmtmd, or None when it is not built."""
    path = vulkan_tools_dir(environ) / "bin"
    return path if (path / "libllama.so").is_file() and (path / "libmtmd.so").is_file() else None


def llama_lib_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that make llama-cpp-python load the chosen build (LLAMA_CPP_LIB_PATH and MTMD_CPP_LIB, read
    when llama_cpp is imported); empty for the default CPU build. Raises LlamaToolsNotFound for a missing build."""
    env = os.environ if environ is None else environ
    backend = (env.get(BACKEND_ENV) or "cpu").strip().lower()
    if backend not in BACKENDS:
        raise LlamaToolsNotFound(f"{BACKEND_ENV}={backend!r}: choose one of {', '.join(BACKENDS)}")
    named = env.get(LIB_DIR_ENV)
    if backend == "cpu":
        # The wheel's own libraries, or a CPU build named by HEARTH_LLAMA_LIB_DIR (the image's portable one,
        # `scripts/build_llama_tools.sh --cpu-all`: every CPU variant as a module, the best loaded by load_backends).
        # An empty or missing folder is the wheel's libraries too (the image names its folder whether or not it
        # was built with CPU_VARIANTS=all); one with files but no libllama.so is a broken build.
        lib_dir = Path(named).expanduser() if named else None
        if lib_dir is None or not lib_dir.is_dir() or not any(lib_dir.iterdir()):
            return {}
        if not (lib_dir / "libllama.so").is_file():
            raise LlamaToolsNotFound(f"{LIB_DIR_ENV}={named} holds no libllama.so: run {BUILD_SCRIPT} --cpu-all")
        return {"LLAMA_CPP_LIB_PATH": str(lib_dir), "MTMD_CPP_LIB": str(lib_dir)}
    lib_dir = Path(named).expanduser() if named else vulkan_lib_dir(env)
    if lib_dir is None or not (lib_dir / "libllama.so").is_file():
        where = lib_dir or vulkan_tools_dir(env) / "bin"
        raise LlamaToolsNotFound(f"{BACKEND_ENV}=vulkan but no Vulkan build of llama.cpp in {where}: "
                                 f"run {BUILD_SCRIPT} --vulkan (needs glslc, libvulkan-dev, spirv-headers)")
    # libmtmd from the same build: two libggml copies in one process would be two backend registries.
    return {"LLAMA_CPP_LIB_PATH": str(lib_dir), "MTMD_CPP_LIB": str(lib_dir)}


def apply_llama_lib_env() -> dict[str, str]:
    """Set llama_lib_env() in this process (before llama_cpp is imported); returns what was set."""
    extra = llama_lib_env()
    os.environ.update(extra)
    return extra


def cpu_all_lib_dir(environ: Mapping[str, str] | None = None) -> Path | None:
    """The portable CPU build's folder (`scripts/build_llama_tools.sh --cpu-all`), or None when it is not built."""
    cpu = tools_cache_dir(environ)
    path = cpu.with_name(f"{cpu.name}-cpu-all") / "bin"
    return path if (path / "libllama.so").is_file() else None


def backend_modules(lib_dir: str | os.PathLike | None) -> list[str]:
    """The CPU variant modules of a GGML_BACKEND_DL build in lib_dir (libggml-cpu-haswell.so, ...); [] for a build
    that links its backends in (the wheel's, the Vulkan one)."""
    if not lib_dir:
        return []
    return sorted(p.name for p in Path(lib_dir).glob("libggml-cpu-*.so"))


_backends_loaded = False


def load_backends() -> None:
    """llama_backend_init, after loading a GGML_BACKEND_DL build's backend modules: the one place every process that
    runs llama.cpp starts it (runner, repack probe, device probe, benches).

    A build whose backends are modules (the image's portable CPU build) has none until they are loaded: ggml scores
    each CPU variant in LLAMA_CPP_LIB_PATH against this CPU and keeps the best (ggml_backend_load_all_from_path),
    as llama.cpp's own tools do at start. Once per process: a second load would register the backends twice."""
    global _backends_loaded
    import llama_cpp  # after LLAMA_CPP_LIB_PATH is set: it names the build loaded

    if not _backends_loaded:
        lib_dir = os.environ.get("LLAMA_CPP_LIB_PATH")
        if backend_modules(lib_dir):
            ggml = ctypes.CDLL("libggml.so.0")  # the copy libllama loaded, found by its soname
            ggml.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
            ggml.ggml_backend_load_all_from_path.restype = None
            ggml.ggml_backend_load_all_from_path(str(lib_dir).encode())
        _backends_loaded = True
    llama_cpp.llama_backend_init()
