"""`hearth bench replay` stopped by SIGTERM stops the hearth serve and the runners it started (real processes)."""

import os
import signal
import subprocess
import sys

import psutil

from tests.helpers import wait_until
from tests.verdict.test_replay_e2e import TINY


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_sigterm_stops_the_serve_and_the_runners_it_started(gemma_path, tmp_path):
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(TINY)
    env = dict(os.environ, HEARTH_DATA=str(tmp_path / "data"))
    bench = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "bench", "replay", "--scenario", str(scenario), "--levels", "1",
         "--modes", "continuous", "--serve", "--model", str(gemma_path), "--ctx", "512", "--parallel", "2",
         "--batch", "256", "--repeats", "5"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def started():
            kids = psutil.Process(bench.pid).children(recursive=True)
            return kids if any("app.cli serve" in " ".join(k.cmdline()) for k in kids if _alive(k.pid)) else None

        # The bench's own runner first, then its serve (stopped while it starts up, or later: nothing stays).
        kids = wait_until(started, timeout_s=180, message="the bench's serve")
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=120) == 128 + signal.SIGTERM
        wait_until(lambda: not any(_alive(k.pid) for k in kids), timeout_s=60,
                   message=lambda: f"processes left: {[' '.join(k.cmdline()) for k in kids if _alive(k.pid)]}")
    finally:
        if bench.poll() is None:
            bench.kill()
        for k in kids if "kids" in locals() else ():
            if _alive(k.pid):
                k.kill()
