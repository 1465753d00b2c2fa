"""Stock llama-server as the tests' oracles and the benches start it: the one place that builds its command line.

It makes the choices the product makes, so an oracle runs what a household's box runs:
- repack as app.repack decides for that build on this CPU (`--no-repack` where its AMX path dies, as on a Xeon VM
  whose CPUID lists AMX; repack on where the build really runs it);
- with same_cache (the default), the cache layout a hearth runner uses, so greedy tokens can be compared: one
  unified KV pool (`--kv-unified`), full-size sliding-window layers (`--swa-full`) and `-b 512`.

tests/test_stock_server_rule.py fails when a test or bench starts llama-server by any other way.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx

from app.devtools.processes import stop_process, wait_healthy
from app.repack import repack_works
from app.residency.supervisor import free_port

# Hearth's runner: one KV pool for every slot, sliding-window layers as large as the context, 512-token batches.
# What same_cache adds, each unless the caller gave one of its spellings: (spellings, flags added).
SAME_CACHE = ((("--kv-unified", "-kvu"), ("--kv-unified",)), (("--swa-full",), ("--swa-full",)),
              (("-b", "--batch-size"), ("-b", "512")))


def stock_command(binary: str | os.PathLike, model: str | os.PathLike | None, *args: str, port: int | None = None,
                  same_cache: bool = True, env: dict[str, str] | None = None) -> list[str]:
    """The argv of stock llama-server on `model` with `args`, the repack rule and (same_cache) Hearth's cache layout."""
    argv = [str(binary)]
    if model is not None:
        argv += ["-m", str(model)]
    if port is not None:
        argv += ["--host", "127.0.0.1", "--port", str(port)]
    argv += [str(a) for a in args]
    if same_cache:
        given = set(argv)
        for spellings, flags in SAME_CACHE:
            if not given.intersection(spellings):
                argv += flags
    if "--repack" not in argv and "--no-repack" not in argv and \
            not repack_works(binary, None if env is None else {**os.environ, **env}):
        argv.append("--no-repack")
    return argv


class StockServer:
    """Stock llama-server started on a free loopback port, healthy (200 on /health) before it is handed out."""

    def __init__(self, binary: str | os.PathLike, model: str | os.PathLike | None, *args: str,
                 log_path: str | os.PathLike | None = None, env: dict[str, str] | None = None,
                 same_cache: bool = True, timeout_s: float = 180.0, client_timeout_s: float = 120.0):
        self.port = free_port()
        self.argv = stock_command(binary, model, *args, port=self.port, same_cache=same_cache, env=env)
        self.log_path = Path(log_path) if log_path is not None else None
        self.env = env
        self.timeout_s = timeout_s
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = httpx.Client(base_url=self.url, timeout=client_timeout_s)
        self.proc: subprocess.Popen | None = None

    def start(self) -> StockServer:
        """Start it and wait for /health 200; raises with the log's tail if it exits or never gets ready."""
        out = open(self.log_path, "wb") if self.log_path is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                         env=None if self.env is None else {**os.environ, **self.env})
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        proc = self.proc
        try:
            wait_healthy(self.url, lambda: None if proc.poll() is None else f"code {proc.returncode}\n{self.log_tail()}",
                         self.timeout_s, "llama-server", interval_s=0.05)
        except TimeoutError as exc:
            self.stop()
            raise TimeoutError(f"{exc}:\n{self.log_tail()}") from None
        return self

    def log_tail(self, n: int = 3000) -> str:
        """The end of its log (empty when it logs nowhere)."""
        if self.log_path is None or not self.log_path.is_file():
            return ""
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        """Close the client, SIGTERM and reap (SIGKILL after 15 s)."""
        self.client.close()
        if self.proc is not None:
            stop_process(self.proc, timeout_s=15)

    def __enter__(self) -> StockServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
