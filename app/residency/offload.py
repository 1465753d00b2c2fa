"""File work off serve's event loop: under gevent (one OS thread for every connection) a call that
reads or hashes gigabytes runs on a small pool of real threads while the loop serves; anywhere else
(the CLI, tests, a plain thread) it is a plain call.

hashlib and file reads release the GIL on large buffers, so a pool thread hashing a 2 GB partial
file leaves the loop free; the pool's threads run at a lower CPU priority (nice), so on a busy
two-core NAS the loop still gets the CPU first (measured by `hearth bench pull`). The pool is
Hearth's own rather than gevent's hub pool: that one holds a thread per runner for the supervisor's
os.waitid (app/serve.py), and file work must not queue behind it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

MAX_FILE_THREADS = 4
# The pool's threads yield the CPU to the serving loop: hashing gigabytes may take longer, a stream's
# next token must not wait for it (on Linux a thread's nice value is its own).
FILE_THREAD_NICE = 10
_pool: tuple[int, Any] | None = None  # (pid, gevent ThreadPool): a forked worker makes its own
_niced: set[int] = set()


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
        _lower_priority()
        # Returned, not raised: the pool prints the traceback of an exception the caller handles.
        try:
            return fn(*args), None
        except BaseException as exc:  # re-raised in the caller below
            return None, exc

    result, error = _file_pool().apply(in_thread)
    if error is not None:
        raise error
    return result


def _lower_priority() -> None:
    """Give this pool thread the nice value FILE_THREAD_NICE, once (where the system allows it)."""
    from gevent.monkey import get_original

    native_id = get_original("_thread", "get_native_id")()
    if native_id in _niced:
        return
    _niced.add(native_id)
    try:
        os.setpriority(os.PRIO_PROCESS, native_id, max(os.getpriority(os.PRIO_PROCESS, native_id), FILE_THREAD_NICE))
    except (OSError, AttributeError):
        pass  # not Linux, or not allowed: the pool still keeps the loop free, only without the nicer share
