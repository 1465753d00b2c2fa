"""No test or bench starts stock llama-server except through app/devtools/stock_server.py (or, as a runner kind,
through RunnerSpec.command): both apply the product's repack rule (app/repack.py), so an oracle never dies where the
pinned build's AMX path does, and the helper gives it Hearth's cache layout when tokens are compared.

The check reads the source (AST): a list literal that is a llama-server command line built by hand (its first item a
binary, not `sys.executable` or a flag, and llama-server's flags after it), or any list whose first item names a
llama-server binary, is refused outside the helper."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("tests", "app/devtools", "app/verdict", "scripts")
HELPER = ROOT / "app/devtools/stock_server.py"
# Files that build a llama.cpp command line of another tool, each with its reason.
EXEMPT = {
    # llama-batched-bench, not llama-server: its callers pass the runners' repack choice (ModelConfig.repack_enabled,
    # app.repack's rule for the same tree's build).
    ROOT / "app/devtools/reference.py",
}
# Flags a llama-server command line carries (the runner takes the same ones: its lists start with sys.executable).
SERVER_FLAGS = {"-m", "--model", "--mmproj", "-c", "--ctx-size", "-np", "--parallel", "--no-webui", "--port",
                "--jinja", "--embedding", "--reranking", "-hf"}
PYTHON_MODULES = {"app.cli", "app.repack", "app.entrypoint", "pip"}


def _names_a_server_binary(node: ast.AST) -> bool:
    """A name, attribute or finder call that is a llama-server binary (not a row or a string that mentions it)."""
    if isinstance(node, ast.Call):
        called = ast.unparse(node.func)
        if "llama_server" in called:
            return True
        return called in ("str", "Path", "os.fspath") and bool(node.args) and _names_a_server_binary(node.args[0])
    if isinstance(node, (ast.Name, ast.Attribute)):
        return "llama_server" in ast.unparse(node).lower()
    return False


def _is_python(node: ast.AST) -> bool:
    text = ast.unparse(node)
    return text in ("sys.executable", "str(sys.executable)", "python", "'python'", "'python3'") or "python" in text


def hand_built_commands(path: Path) -> list[str]:
    """`file:line: source` of each list literal in `path` that starts llama-server by hand."""
    text = path.read_text()
    if not any(word in text for word in ("llama", "-m", "--model", "--port")):
        return []  # nothing that could start a server: not worth parsing
    tree = ast.parse(text, filename=str(path))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.List) or not node.elts:
            continue
        first = node.elts[0]
        if isinstance(first, ast.Starred):
            continue  # extends a command built elsewhere, which this check sees where it is built
        constants = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        if isinstance(first, ast.Constant):
            command = isinstance(first.value, str) and Path(first.value).name == "llama-server"
        elif _names_a_server_binary(first):
            command = True
        elif not isinstance(first, (ast.Name, ast.Attribute, ast.Call)):
            command = False
        else:
            command = not _is_python(first) and not constants & PYTHON_MODULES and bool(constants & SERVER_FLAGS)
        if command:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:120]}")
    return found


def test_only_the_helper_builds_llama_server_command_lines():
    offenders = [line for tree in TREES for path in sorted((ROOT / tree).rglob("*.py"))
                 if path not in EXEMPT | {HELPER, Path(__file__).resolve()} for line in hand_built_commands(path)]
    assert not offenders, ("start stock llama-server through app.devtools.stock_server (stock_command or "
                           "StockServer), which applies the repack rule:\n" + "\n".join(offenders))


def test_the_check_catches_the_shapes_it_was_written_for():
    sample = ROOT / "tests" / "_stock_rule_sample.py"
    try:
        sample.write_text(
            "import subprocess, sys\n"
            "subprocess.Popen([str(binary), '-m', model, '--port', '8080'])\n"         # a binary and its flags
            "cmd = [args.llama_server, *common, '--no-webui']\n"                        # named as llama-server
            "subprocess.run([str(vulkan_llama_server()), '--list-devices'])\n"           # any use of the binary
            "subprocess.run(['/opt/llama-server', '--version'])\n"                      # spelt out
            "header = ['| path | × llama-server |', '|---|---|']\n"                      # a table's header
            "ok = [sys.executable, '-m', 'app.cli', 'runner', '-m', model]\n"             # hearth's runner
            "flags = ['-m', model, '-c', '512']\n"                                       # arguments, not a command
        )
        lines = sorted(line.split(":")[1] for line in hand_built_commands(sample))
    finally:
        sample.unlink()
    assert lines == ["2", "3", "4", "5"]
