"""Ending the servers a bench started: one way for all of them."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import httpx


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


def wait_healthy(url: str, exited: Callable[[], str | None], timeout_s: float, what: str = "the server",
                 interval_s: float = 0.1) -> None:
    """Poll url + /health until it answers 200: the one readiness wait of every server a bench or test starts.

    exited() returns why the process is gone (its exit, a log tail), or None while it runs: a server that dies
    while starting fails at once instead of after the timeout. Raises TimeoutError past timeout_s."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5) as client:
        while time.monotonic() < deadline:
            why = exited()
            if why is not None:
                raise RuntimeError(f"{what} exited before it was ready: {why}")
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(interval_s)
    raise TimeoutError(f"{what} at {url} was not ready in {timeout_s:.0f} s")
