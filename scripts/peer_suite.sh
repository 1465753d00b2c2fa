#!/usr/bin/env bash
# Runs llama.cpp's own server tests (not slow) against `hearth runner` and against stock
# llama-server built from the same llama.cpp tree, both on the embedded Gemma 3 270M, and prints
# per test file: total, both pass, llama-server only, both fail, Hearth only — with Hearth's
# failure for every test that only llama-server passes. Not part of CI: about 280 tests, each
# starting its own server, so ~20 minutes on an idle box and hours on a busy 2-core one. One pytest
# runs per file, so a stopped run keeps its finished files; `python -m app.devtools.parity.peer_suite
# report --out OUT_DIR` prints the table of what has finished.
#
# Usage: scripts/peer_suite.sh [OUT_DIR] [extra args of `python -m app.devtools.parity.peer_suite run`]
#   e.g. scripts/peer_suite.sh /tmp/peer --targets hearth      (rerun Hearth, keep the stock result)
#        scripts/peer_suite.sh /tmp/peer --files test_tokenize,test_basic
#   PEER_PYTHON   interpreter with the tests' requirements (tools/server/tests/requirements.txt and
#                 pytest-timeout); made once as a venv in ~/.cache/hearth/peer-venv when unset
#   PYTHON        interpreter with Hearth installed (default: .venv/bin/python, else python3)
# Needs scripts/build_llama_tools.sh to have run (stock llama-server and the unpacked sdist).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-/tmp/hearth-peer-suite}"
shift || true
python_bin="${PYTHON:-}"
if [[ -z "$python_bin" ]]; then
    if [[ -x "$repo_root/.venv/bin/python" ]]; then python_bin="$repo_root/.venv/bin/python"; else python_bin=python3; fi
fi

"$repo_root/scripts/build_llama_tools.sh" >/dev/null

if [[ -z "${PEER_PYTHON:-}" ]]; then
    venv="$HOME/.cache/hearth/peer-venv"
    if [[ ! -x "$venv/bin/python" ]]; then
        python3 -m venv "$venv"
        # The pins of llama.cpp's tests/requirements.txt that matter, plus a per-test timeout.
        "$venv/bin/pip" install -q "pytest~=8.3.3" "requests~=2.32.3" "openai~=2.14.0" filelock wget \
            numpy prometheus-client aiohttp pytest-timeout
    fi
    PEER_PYTHON="$venv/bin/python"
fi

cd "$repo_root"
PYTHONPATH="$repo_root" PEER_PYTHON="$PEER_PYTHON" exec "$python_bin" -m app.devtools.parity.peer_suite run --out "$out" "$@"
