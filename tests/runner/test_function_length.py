"""The runner's functions fit on a screen: none is longer than 60 lines (the line drawn for app/runner in issue 53),
so each reads whole, as the house style asks (vLLM's EngineCore.step)."""

from __future__ import annotations

import ast
from pathlib import Path

import app.runner

MAX_FUNCTION_LINES = 60


def test_no_runner_function_is_longer_than_60_lines():
    longer = []
    for path in sorted(Path(app.runner.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    longer.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines)")
    assert not longer, "runner functions over 60 lines: " + ", ".join(longer)
