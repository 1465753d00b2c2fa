"""Capture every `hearth ... --help` output into a folder, or compare them with an earlier capture.

Moves of code between modules must leave the command line unchanged; this proves it byte for byte:

    PYTHONPATH=$PWD python scripts/help_snapshot.py /tmp/help-before           # before the move
    PYTHONPATH=$PWD python scripts/help_snapshot.py /tmp/help-after --compare /tmp/help-before
"""
from __future__ import annotations

import argparse
import difflib
import os
import subprocess
import sys
from pathlib import Path


def command_paths(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path of the parser tree, the root first, in the order --help lists them."""
    paths = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                paths.extend(command_paths(child, prefix + (name,)))
    return paths


def help_text(path: tuple[str, ...]) -> str:
    """The --help output of one command path, as a fresh `python -m app.cli` prints it at 100 columns."""
    env = dict(os.environ, COLUMNS="100", LINES="50")
    done = subprocess.run([sys.executable, "-m", "app.cli", *path, "--help"], env=env,
                          capture_output=True, text=True, check=False)
    return f"rc={done.returncode}\n{done.stdout}{done.stderr}"


def capture(folder: Path) -> dict[str, str]:
    """Write one file per command path into folder; return name -> text."""
    from app.cli import build_parser

    folder.mkdir(parents=True, exist_ok=True)
    texts = {}
    for path in command_paths(build_parser()):
        name = "_".join(("hearth",) + path) + ".txt"
        texts[name] = help_text(path)
        (folder / name).write_text(texts[name])
    return texts


def main() -> int:
    """Capture, and compare with an earlier capture when asked; 1 when anything differs."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="where to write the captured outputs")
    ap.add_argument("--compare", type=Path, help="an earlier capture that every output must equal")
    args = ap.parse_args()
    texts = capture(args.folder)
    print(f"{len(texts)} --help outputs written to {args.folder}")
    if args.compare is None:
        return 0
    before = {p.name: p.read_text() for p in args.compare.glob("*.txt")}
    differ = 0
    for name in sorted(set(before) | set(texts)):
        if before.get(name) != texts.get(name):
            differ += 1
            sys.stdout.writelines(difflib.unified_diff((before.get(name) or "").splitlines(True),
                                                       (texts.get(name) or "").splitlines(True),
                                                       f"before/{name}", f"after/{name}"))
    print(f"{differ} of {len(texts)} differ from {args.compare}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
