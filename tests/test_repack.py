"""The repack rule (app/repack.py): asked of the build in a child process, cached per build and CPU, settable by hand;
and the stock llama-server helper (app/devtools/stock_server.py) that gives every oracle the same rule."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from app import repack
from app.devtools.stock_server import stock_command


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache folder of the test's own and an empty in-process memo."""
    folder = tmp_path / "repack-cache"
    monkeypatch.setenv(repack.CACHE_ENV, str(folder))
    monkeypatch.delenv(repack.REPACK_ENV, raising=False)
    monkeypatch.setattr(repack, "_memo", {})
    return folder


def fake_server(path, body: str):
    """A stand-in llama-server build: a shell script with `body`."""
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_a_build_that_dies_with_a_signal_gets_repack_off_and_the_answer_is_cached(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(repack, "cpu_has_amx", lambda: True)
    binary = fake_server(tmp_path / "llama-server", 'echo "tinygemm_kernel_amx"; kill -ILL $$')
    assert repack.repack_works(binary) is False
    [entry] = cache.glob("*.json")
    assert json.loads(entry.read_text())["repack"] is False and "SIGILL" in json.loads(entry.read_text())["why"]
    # Read from the cache now: a build that would answer otherwise is not run again until it changes.
    monkeypatch.setattr(repack, "_memo", {})
    monkeypatch.setattr(repack, "probe", lambda *a, **k: pytest.fail("probed again"))
    assert repack.repack_works(binary) is False
    assert command_has_no_repack(binary)


def command_has_no_repack(binary) -> bool:
    return "--no-repack" in stock_command(binary, "m.gguf")


def test_a_changed_build_is_asked_again(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(repack, "cpu_has_amx", lambda: True)
    binary = fake_server(tmp_path / "llama-server", "kill -SEGV $$")
    assert repack.repack_works(binary) is False
    monkeypatch.setattr(repack, "_memo", {})
    asked = []
    monkeypatch.setattr(repack, "probe", lambda *a, **k: asked.append(a) or (True, "decoded", True))
    fake_server(binary, "exit 0  # rebuilt")
    os.utime(binary, ns=(1, 1))
    assert repack.repack_works(binary) is True and len(asked) == 1


def test_a_probe_that_cannot_run_answers_off_and_is_not_cached(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(repack, "cpu_has_amx", lambda: True)
    binary = fake_server(tmp_path / "llama-server", 'echo "error: unknown argument --repack" >&2; exit 1')
    works, why, definitive = repack.probe(binary)
    assert (works, definitive) == (False, False) and "unknown argument" in why
    assert repack.repack_works(binary) is False
    assert not list(cache.glob("*.json"))


def test_no_probe_runs_without_amx_and_the_setting_wins(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(repack, "cpu_has_amx", lambda: False)
    monkeypatch.setattr(repack, "probe", lambda *a, **k: pytest.fail("probed on a CPU without AMX"))
    assert repack.repack_works() is True
    monkeypatch.setenv(repack.REPACK_ENV, "off")
    assert repack.repack_works() is False
    monkeypatch.setattr(repack, "cpu_has_amx", lambda: True)
    monkeypatch.setenv(repack.REPACK_ENV, "on")
    assert repack.repack_works(tmp_path / "llama-server") is True


def test_the_helper_adds_hearths_cache_layout_once_and_keeps_the_callers_own(cache, monkeypatch):
    monkeypatch.setenv(repack.REPACK_ENV, "on")
    argv = stock_command("/bin/llama-server", "m.gguf", "-c", "1024", port=8081)
    assert argv[0] == "/bin/llama-server" and argv[1:3] == ["-m", "m.gguf"] and argv[argv.index("--port") + 1] == "8081"
    assert {"--kv-unified", "--swa-full"} <= set(argv) and argv[argv.index("-b") + 1] == "512"
    assert "--no-repack" not in argv
    own = stock_command("/bin/llama-server", "m.gguf", "-kvu", "-b", "2048")
    assert own.count("-b") == 1 and own[own.index("-b") + 1] == "2048" and "--kv-unified" not in own
    bare = stock_command("/bin/llama-server", None, "--list-devices", same_cache=False)
    assert bare[0] == "/bin/llama-server" and bare[1:] == ["--list-devices"]
    monkeypatch.setenv(repack.REPACK_ENV, "off")
    monkeypatch.setattr(repack, "_memo", {})
    assert stock_command("/bin/llama-server", "m.gguf")[-1] == "--no-repack"
    assert "--no-repack" not in stock_command("/bin/llama-server", "m.gguf", "--repack")


def test_the_probe_model_loads_and_decodes_with_repack_off(tmp_path):
    """The probe's child on its own model with repack forced off: exit 0, so a signal with it on is the repack path."""
    model = repack.write_probe_model(tmp_path / "probe.gguf")
    done = subprocess.run([sys.executable, "-m", "app.repack", "--decode", str(model), "--plain"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_this_machines_runner_build_gets_an_answer_from_the_probe(cache, monkeypatch):
    """On a CPU that lists AMX the child runs for real: a definitive answer, cached (where it works, a warning-free
    "on"; on the Xeon VM this was written on, the pinned build died with SIGSEGV and the answer is "off")."""
    if not repack.cpu_has_amx():
        pytest.skip("the CPU lists no AMX: no probe runs")
    works, why, definitive = repack.probe()
    assert definitive, why
    assert ("decoded" in why) == works
