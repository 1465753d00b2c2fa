"""File work off serve's event loop: under gevent (one OS thread for every connection) a call that
reads or hashes gigabytes runs on a small pool of real threads while the loop serves; anywhere else
(the CLI, tests, a plain thread) it is a plain call.

hashlib and file reads release the GIL on large buffers, so a pool thread hashing a 2 GB partial
file leaves the loop free. The pool is Hearth's own rather than gevent's hub pool: that one holds a
thread per runner for the supervisor's os.waitid (app/serve.py), and file work must not queue behind it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

MAX_FILE_THREADS = 4
_pool: tuple[int, Any] | None = None  # (pid, gevent ThreadPool): a forked worker makes its own


def under_gevent() -> bool:
    """True in a process whose threading gevent has patched (serve's worker)."""
    if "gevent" not in sys.modules:
        return False
    from gevent import monkey

    return bool(monkey.is_module_patched("threading"))


def _file_pool():
    global _pool
    if _pool is None or _pool[0] != os.getpid():
        from gevent.threadpool import ThreadPool

        _pool = (os.getpid(), ThreadPool(MAX_FILE_THREADS))
    return _pool[1]


def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a real thread when under gevent (the calling greenlet waits, the loop serves), else here."""
    if not under_gevent():
        return fn(*args)

    def in_thread():
        # Returned, not raised: the pool prints the traceback of an exception the caller handles.
        try:
            return fn(*args), None
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller below
            return None, exc

    result, error = _file_pool().apply(in_thread)
    if error is not None:
        raise error
    return result
