"""llama.cpp's own server tests, run against `hearth runner` and against stock llama-server on one model.

The tests (tools/server/tests in the llama.cpp tree vendored in the pinned llama-cpp-python sdist)
start "llama-server" themselves from $LLAMA_SERVER_BIN_PATH. Here that path is a launch wrapper
which drops the Hugging Face model flags the tests pass (no network) and puts the embedded model
in their place; stock llama-server also gets `--kv-unified`, Hearth's cache layout. Each target's
outcomes land in a JUnit XML file, and the report compares them test by test.

    python -m app.devtools.parity.peer_suite run --out DIR [--targets llama-server,hearth] [--files ...]
    python -m app.devtools.parity.peer_suite report --out DIR
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from app.llama_tools import stock_llama_server, tools_cache_dir

TARGETS = ("llama-server", "hearth")

FILES = (
    "test_basic", "test_chat_completion", "test_completion", "test_tokenize", "test_stream", "test_security",
    "test_tool_call", "test_embedding", "test_infill", "test_metrics", "test_ignore_eos", "test_ctx_shift",
    "test_kv_keep_only_active", "test_compat_oai_responses", "test_compat_anthropic", "test_rerank",
    "test_template",
)

# Flags the tests use to name a model to download, with the number of values each takes: the
# wrapper drops them and passes the embedded model instead.
_MODEL_SOURCE_FLAGS = {
    "--hf-repo": 1, "-hf": 1, "--hf-file": 1, "-hff": 1, "--model-url": 1, "-mu": 1, "--model": 1, "-m": 1,
    "--mmproj-url": 1, "--offline": 0, "--no-mmproj": 0, "--no-ui": 0,
}

# Tests of what the issue leaves out of scope (router mode, built-in /tools, /cors-proxy), by file and
# name (None: the whole file). They stay in the table, apart, and out of the share.
OUT_OF_SCOPE: dict[tuple[str, str | None], str] = {
    ("test_stream", None): "router mode (stream sessions resumed through the router)",
    ("test_security", "test_cors_origins_defaults_to_localhost_with_tools_enabled"): "built-in /tools (router mode)",
    ("test_security", "test_cors_proxy_only_forwards_explicit_proxy_headers"): "/cors-proxy",
}

_REPO_ROOT = Path(__file__).resolve().parents[3]
PER_TEST_TIMEOUT_S = 90


def tests_dir() -> Path:
    """tools/server/tests of the llama.cpp tree vendored in the pinned sdist (unpacked by the build script)."""
    src = tools_cache_dir() / "src"
    for candidate in sorted(src.glob("llama_cpp_python-*/vendor/llama.cpp/tools/server/tests")):
        return candidate
    raise SystemExit(f"peer_suite: no llama.cpp server tests under {src}; run scripts/build_llama_tools.sh first")


def map_args(target: str, args: list[str], model: str) -> list[str]:
    """llama-server's command line as the tests write it, with the embedded model and, for stock, -kvu."""
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in _MODEL_SOURCE_FLAGS:
            i += 1 + _MODEL_SOURCE_FLAGS[arg]
            continue
        out.append(arg)
        i += 1
    out = ["--model", model, *out]
    if target == "llama-server" and "--kv-unified" not in out and "-kvu" not in out:
        out.append("--kv-unified")
    return out


def launch(target: str, model: str, args: list[str]) -> None:
    """Replace this process with the target server (what the tests start as llama-server)."""
    mapped = map_args(target, args, model)
    if target == "llama-server":
        binary = stock_llama_server()
        if binary is None:
            raise SystemExit("peer_suite: stock llama-server is not built; run scripts/build_llama_tools.sh")
        argv = [str(binary), *mapped]
    else:
        argv = [sys.executable, "-m", "app.cli", "runner", *mapped]
    os.execv(argv[0], argv)


def write_wrapper(folder: Path, target: str, model: str, hearth_root: Path) -> Path:
    """An executable that the tests can start in place of llama-server."""
    path = folder / f"launch-{target}"
    # The launcher is this file; the runner it starts is the `app` of hearth_root (a baseline checkout).
    env = f"PYTHONPATH={shlex.quote(str(hearth_root))}"
    path.write_text(
        "#!/bin/sh\n"
        f"exec env {env} {shlex.quote(sys.executable)} {shlex.quote(__file__)} launch "
        f"--target {target} --model {shlex.quote(model)} -- \"$@\"\n"
    )
    path.chmod(0o755)
    return path


def snapshot_hearth(out: Path) -> Path:
    """A copy of this checkout's `app`, so edits made while the suite runs do not change what it measures."""
    root = out / "hearth-src"
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(_REPO_ROOT / "app", root / "app", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(_REPO_ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


def prepare_tests(tree: Path) -> Path:
    """Copy llama.cpp's tests under `tree` at their place in llama.cpp, without their model pre-download."""
    if tree.exists():
        shutil.rmtree(tree)
    work = tree / "tools" / "server" / "tests"
    shutil.copytree(tests_dir(), work, ignore=shutil.ignore_patterns("tmp", "__pycache__"))
    # The tests read chat templates as ../../../models/templates/*.jinja: the tree's models folder.
    (tree / "models").symlink_to(tests_dir().parents[2] / "models")
    # The session fixture starts every preset once to download its model; the wrapper serves the local
    # embedded model, so those starts would only cost time (minutes per file on a small box).
    conftest = work / "conftest.py"
    text = conftest.read_text()
    conftest.write_text(text.replace("ServerPreset.load_all()", "pass  # peer_suite: models are local"))
    return work


def run_target(target: str, out: Path, model: str, files: list[str], python: str, port: int,
               hearth_root: Path = _REPO_ROOT) -> None:
    """Run the tests against one target, one pytest per file (a stopped run keeps its finished files)."""
    work = prepare_tests(out / f"tree-{target}")
    wrapper = write_wrapper(out, target, model, hearth_root)
    env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(wrapper), "PORT": str(port)}
    env.pop("PYTHONPATH", None)  # the tests' own utils.py must win, not Hearth's packages
    for file in files:
        junit = out / target / f"{file}.xml"
        junit.parent.mkdir(parents=True, exist_ok=True)
        cmd = [python, "-m", "pytest", "-m", "not slow", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
               f"--timeout={PER_TEST_TIMEOUT_S}", f"unit/{file}.py"]
        print(f"peer_suite: {target}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        with (out / target / f"{file}.log").open("w") as log:
            subprocess.run(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)


@dataclass(frozen=True)
class Outcome:
    """One test's result: passed, or why not."""

    passed: bool
    reason: str = ""


def read_junit(folder: Path) -> dict[tuple[str, str], Outcome]:
    """(file, test name) → outcome, from one target's JUnit XML files (empty when it has not run)."""
    results: dict[tuple[str, str], Outcome] = {}
    cases = [c for path in sorted(folder.glob("*.xml")) for c in ET.parse(path).getroot().iter("testcase")]
    for case in cases:
        file = case.get("classname", "").split(".")[-1]
        name = case.get("name", "")
        bad = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        if bad is None:
            results[(file, name)] = Outcome(True)
            continue
        text = (bad.get("message") or bad.text or bad.tag).strip()
        reason = f"{bad.tag}: {' '.join(text.split())}"
        # A test's teardown error comes as a second entry of the same test: its failure counts.
        if (file, name) not in results or results[(file, name)].passed:
            results[(file, name)] = Outcome(False, reason[:220])
    return results


def out_of_scope(file: str, name: str) -> str | None:
    """Why a test is out of the issue's scope, or None."""
    return OUT_OF_SCOPE.get((file, None)) or OUT_OF_SCOPE.get((file, name.split("[")[0]))


def report(out: Path, files: list[str]) -> str:
    """The per-file comparison table and the reason of every test only stock llama-server passes."""
    stock = read_junit(out / "llama-server")
    ours = read_junit(out / "hearth")
    rows, only_stock, skipped = [], [], []
    totals: Counter = Counter()
    for file in files:
        keys = sorted(k for k in set(stock) | set(ours) if k[0] == file)
        c = Counter()
        for key in keys:
            s, h = stock.get(key, Outcome(False, "not run")), ours.get(key, Outcome(False, "not run"))
            c["total"] += 1
            why = out_of_scope(*key)
            if why is not None:
                c["out_of_scope"] += 1
                skipped.append((key, why, s.passed, h.passed))
                continue
            if s.passed and h.passed:
                c["both"] += 1
            elif s.passed:
                c["stock_only"] += 1
                only_stock.append((key, h.reason))
            elif h.passed:
                c["hearth_only"] += 1
            else:
                c["neither"] += 1
        totals.update(c)
        rows.append((file, c))
    lines = [f"{'file':28} {'total':>5} {'both':>5} {'llama-server only':>17} {'both fail':>9} {'Hearth only':>11}"
             f" {'out of scope':>12}"]
    for file, c in [*rows, ("TOTAL", totals)]:
        lines.append(f"{file:28} {c['total']:5} {c['both']:5} {c['stock_only']:17} {c['neither']:9} "
                     f"{c['hearth_only']:11} {c['out_of_scope']:12}")
    stock_passed = totals["both"] + totals["stock_only"]
    share = 100 * totals["both"] / stock_passed if stock_passed else 0.0
    lines.append(f"\nHearth passes {totals['both']} of the {stock_passed} in-scope tests stock llama-server passes "
                 f"({share:.1f} %); target ≥ 90 %.")
    if skipped:
        s_pass = sum(1 for *_, s, _h in skipped if s)
        both = sum(1 for *_, s, h in skipped if s and h)
        all_share = 100 * (totals["both"] + both) / (stock_passed + s_pass) if stock_passed + s_pass else 0.0
        lines.append(f"Counting the out-of-scope tests too: {totals['both'] + both} of {stock_passed + s_pass} "
                     f"({all_share:.1f} %). Out of scope (the issue's list):")
        for (file, name), why, s, h in skipped:
            lines.append(f"  {file}::{name}: {why} (llama-server {'passes' if s else 'fails'}, "
                         f"Hearth {'passes' if h else 'fails'})")
    if only_stock:
        lines.append("\nPassed by llama-server only, with Hearth's failure:")
        for (file, name), reason in only_stock:
            lines.append(f"  {file}::{name}: {reason}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The command line: run, report, and launch (the wrapper's entry point)."""
    p = argparse.ArgumentParser(prog="peer_suite", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the tests against each target, then print the report")
    run.add_argument("--out", required=True, help="folder for the logs, JUnit files and the report")
    run.add_argument("--targets", default=",".join(TARGETS), help="comma-separated (default %(default)s)")
    run.add_argument("--files", default=",".join(FILES), help="test files, without .py")
    run.add_argument("--model", help="GGUF to serve (default: the embedded Gemma 3 270M)")
    run.add_argument("--python", default=os.environ.get("PEER_PYTHON", sys.executable),
                     help="interpreter with the tests' requirements (pytest, requests, openai, …)")
    run.add_argument("--port", type=int, default=8480)
    run.add_argument("--hearth-root", type=Path, default=None,
                     help="checkout whose `app` the Hearth runs use, e.g. a baseline (default: a copy of this one)")
    rep = sub.add_parser("report", help="print the comparison of the last run")
    rep.add_argument("--out", required=True)
    rep.add_argument("--files", default=",".join(FILES))
    lau = sub.add_parser("launch", help="(wrapper) start a target with llama-server's flags")
    lau.add_argument("--target", choices=TARGETS, required=True)
    lau.add_argument("--model", required=True)
    lau.add_argument("rest", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)

    if args.command == "launch":
        rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
        launch(args.target, args.model, rest)
        return 0
    out = Path(args.out).resolve()
    files = [f for f in args.files.split(",") if f]
    if args.command == "run":
        out.mkdir(parents=True, exist_ok=True)
        model = args.model or _embedded_model()
        targets = [t for t in args.targets.split(",") if t]
        root = args.hearth_root.resolve() if args.hearth_root else snapshot_hearth(out) if "hearth" in targets else None
        for i, target in enumerate(targets):
            run_target(target, out, model, files, args.python, args.port + 10 * i, root or _REPO_ROOT)
    text = report(out, files)
    (out / "report.txt").write_text(text + "\n")
    print(text)
    return 0


def _embedded_model() -> str:
    from app.paths import data_dir
    from app.residency.default_model import ensure_default_model

    return str(ensure_default_model(data_dir(), progress=True))


if __name__ == "__main__":
    sys.exit(main())
