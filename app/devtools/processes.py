"""Ending the servers a bench started: one way for all of them."""

from __future__ import annotations

import subprocess


def stop_process(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGTERM and reap; SIGKILL if it has not exited in timeout_s (a runner writes its disk tier on the way out,
    llama-server drains its slots), so a bench never leaves a server behind or hangs on one."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
