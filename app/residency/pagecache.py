"""Model weights in the page cache: how much of a file is there (mincore), keeping it (read-ahead), dropping it.

A runner maps its GGUF; when the runner stops, the file's pages stay in the kernel's page cache until memory
pressure or an explicit DONTNEED drops them, and the next load reads memory instead of the disk. The Warmer
acts on each model's `weights` choice when its runner stops and whenever RAM is checked:

- warm (the default): after its runner stops, the GGUF (and its mmproj) is read ahead into the page cache
  while the box has RAM free for it (available memory minus a margin), most recently used models first;
- pinned: the same, and every check re-reads what the kernel dropped since;
- cold: POSIX_FADV_DONTNEED once its runner has stopped, giving the RAM back at once.

Nothing is locked in memory (no mlock): a warm file is ordinary cache, the first thing the kernel reclaims
when something needs the RAM, so warming never takes memory a running model or the KV tiers need.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import psutil

from app.residency.offload import off_loop

log = logging.getLogger(__name__)

WEIGHTS_PINNED = "pinned"
WEIGHTS_WARM = "warm"
WEIGHTS_COLD = "cold"
# A model's "weights" choice (runner_settings.weights, migration 0014; NULL stored means warm).
WEIGHTS_CHOICES = (WEIGHTS_PINNED, WEIGHTS_WARM, WEIGHTS_COLD)
# A load whose file had at least this share in the page cache just before it read memory, not the disk.
PAGE_CACHE_SHARE = 0.9
# RAM left free beside what warming takes: the OS, serve, and a runner that starts meanwhile.
DEFAULT_MARGIN_BYTES = 1 << 30
READ_CHUNK_BYTES = 8 << 20

_PAGE = mmap.PAGESIZE
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _mincore = _libc.mincore
    _mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
    _mincore.restype = ctypes.c_int
    _mmap = _libc.mmap
    _mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    _mmap.restype = ctypes.c_void_p
    _munmap = _libc.munmap
    _munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    _munmap.restype = ctypes.c_int
except (OSError, AttributeError):  # not Linux/BSD libc: residency is unknown
    _mincore = None
_MAP_FAILED = ctypes.c_void_p(-1).value
_LOW_BIT = bytes(b & 1 for b in range(256))


def weights_problem(value: str | None) -> str | None:
    """What is wrong with a weights choice, or None (the Models page's and the admin's check)."""
    if value is None or value in WEIGHTS_CHOICES:
        return None
    return f"choose one of: {', '.join(WEIGHTS_CHOICES)} (got {value!r})"


def cached_fraction(path: str | os.PathLike) -> float | None:
    """The share of `path`'s pages in the page cache right now (0..1); None when it cannot be measured."""
    if _mincore is None:
        return None
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return 1.0
            # libc's own mmap: Python's hides the address of a read-only map. Mapping touches no page.
            addr = _mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
            if addr is None or addr == _MAP_FAILED:
                log.debug("mmap %s: %s", path, os.strerror(ctypes.get_errno()))
                return None
            try:
                pages = (size + _PAGE - 1) // _PAGE
                vec = (ctypes.c_ubyte * pages)()
                if _mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
                    log.debug("mincore %s: %s", path, os.strerror(ctypes.get_errno()))
                    return None
                # Bit 0 of each byte: the page is resident.
                return bytes(vec).translate(_LOW_BIT).count(1) / pages
            finally:
                _munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    except OSError as exc:
        log.debug("page cache residency of %s: %s", path, exc)
        return None


def read_ahead(path: str | os.PathLike) -> int:
    """Bring `path` into the page cache: POSIX_FADV_WILLNEED, then read through it; returns the bytes read.

    WILLNEED starts the reads at once, but the kernel may cap how much it reads ahead (on the 2-core dev box,
    3 % of a 241 MiB GGUF was in 1 s after it, `hearth bench tiers --reload` prints it); reading through the
    file afterwards makes sure every page is in (150-520 ms there; a page already cached costs a memory copy)."""
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        total = 0
        buf = bytearray(READ_CHUNK_BYTES)
        view = memoryview(buf)
        while n := f.readinto(view):
            total += n
        return total


def drop(path: str | os.PathLike) -> None:
    """Ask the kernel to drop `path`'s pages from the page cache (POSIX_FADV_DONTNEED).

    Dirty pages (a file just pulled or copied) would stay, so the file is synced first (nothing to do for a
    clean one); pages another process still maps stay too: call it once the runner has stopped."""
    with open(path, "rb", buffering=0) as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def available_bytes() -> int:
    """Memory the kernel could give without swapping (psutil's available)."""
    return int(psutil.virtual_memory().available)


@dataclass(frozen=True)
class WeightsFile:
    """One model's files for the warmer: its name, choice and the paths it maps (GGUF, mmproj)."""

    model_name: str
    choice: str
    paths: tuple[str, ...]


class Warmer:
    """Keeps the weights of stopped models in the page cache by each model's choice, under the free RAM.

    `files()` lists every local model's WeightsFile; `resident()` the names whose runner is up now (their
    pages are mapped, nothing to do). Reads run on one background thread (each file read, under serve's
    gevent, on a real one: app.residency.offload), so a runner's stop never waits on the disk; the order is
    pinned models first, then the most recently stopped."""

    def __init__(self, files: Callable[[], Iterable[WeightsFile]], resident: Callable[[], set[str]],
                 available: Callable[[], int] = available_bytes, margin_bytes: int = DEFAULT_MARGIN_BYTES):
        self._files = files
        self._resident = resident
        self._available = available
        self.margin_bytes = margin_bytes
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._order: list[str] = []  # model names, most recently used last
        self._pending = False
        self._thread: threading.Thread | None = None
        self._closed = False
        self._busy = False
        self.num_warmed = 0  # files read ahead, for tests and the log
        self.num_dropped = 0
        self.last_skipped: dict[str, str] = {}  # model → why it was not warmed on the last sweep

    def used(self, model_name: str) -> None:
        """`model_name` was just used (loaded or stopped): it goes to the front of the warm order."""
        with self._lock:
            if model_name in self._order:
                self._order.remove(model_name)
            self._order.append(model_name)

    def stopped(self, model_name: str) -> None:
        """`model_name`'s runner has exited: drop its pages if it is cold, else warm it (in the background)."""
        self.used(model_name)
        f = next((f for f in self._files() if f.model_name == model_name), None)
        if f is not None and f.choice == WEIGHTS_COLD:
            for p in f.paths:
                try:
                    off_loop(drop, p)  # its fsync may wait on the disk: never on serve's event loop
                    self.num_dropped += 1
                except OSError as exc:
                    log.warning("could not drop %s from the page cache: %s", p, exc)
            return
        self.request()

    def check(self) -> None:
        """The periodic RAM check (serve's check_weights job): re-warm pinned models whose pages were dropped."""
        self.request()

    def request(self) -> None:
        """Ask the background thread for a sweep (several requests while one runs make one more)."""
        with self._lock:
            if self._closed:
                return
            self._pending = True
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="hearth-warm-weights", daemon=True)
                self._thread.start()
            self._wake.notify()

    def idle(self, timeout_s: float = 30.0) -> bool:
        """Wait until no sweep is pending or running (tests); False on timeout."""
        with self._lock:
            return self._wake.wait_for(lambda: not self._pending and not self._busy, timeout_s)

    def close(self) -> None:
        """Stop the background thread after the sweep it is in."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()

    def _run(self) -> None:
        while True:
            with self._lock:
                self._wake.wait_for(lambda: self._pending or self._closed)
                if self._closed:
                    return
                self._pending, self._busy = False, True
            try:
                self.sweep()
            except Exception:
                log.exception("warming model weights failed")
            finally:
                with self._lock:
                    self._busy = False
                    self._wake.notify_all()

    def plan(self) -> list[WeightsFile]:
        """The files to keep warm, in order: pinned first, then warm ones by most recent use; resident ones left out."""
        resident = self._resident()
        with self._lock:
            rank = {name: i for i, name in enumerate(reversed(self._order))}
        # A warm model this serve never used has nothing to say for it: only pinned ones are warmed unasked.
        wanted = [f for f in self._files() if f.model_name not in resident
                  and (f.choice == WEIGHTS_PINNED or (f.choice == WEIGHTS_WARM and f.model_name in rank))]
        return sorted(wanted, key=lambda f: (f.choice != WEIGHTS_PINNED, rank.get(f.model_name, len(rank))))

    def sweep(self) -> list[str]:
        """Read ahead every planned file whose missing part fits the free RAM less the margin; the names warmed."""
        warmed: list[str] = []
        skipped: dict[str, str] = {}
        # The kernel counts cached file pages as available (reclaimable): the files kept so far are taken off
        # it, so warming a later file never pushes an earlier (more wanted) one out of the cache.
        kept = 0
        for f in self.plan():
            for p in f.paths:
                try:
                    size = os.path.getsize(p)
                except OSError as exc:
                    skipped[f.model_name] = f"unreadable: {exc}"
                    continue
                frac = cached_fraction(p)
                missing = size if frac is None else int(size * (1 - frac))
                room = self._available() - self.margin_bytes - kept
                if missing <= _PAGE * 16:
                    kept += size
                    continue
                if size > room:
                    # Never beyond free RAM: a later (less recently used) file that is smaller may still fit.
                    skipped[f.model_name] = (f"needs {missing >> 20} MiB, {max(room - (size - missing), 0) >> 20} MiB "
                                             "free beyond the margin and the weights kept before it")
                    continue
                kept += size
                try:
                    # Gigabytes read: on a real thread under serve's gevent loop, which goes on serving meanwhile.
                    off_loop(read_ahead, p)
                except OSError as exc:
                    skipped[f.model_name] = f"read failed: {exc}"
                    continue
                self.num_warmed += 1
                if f.model_name not in warmed:
                    warmed.append(f.model_name)
        if warmed:
            log.info("weights kept warm in the page cache: %s", ", ".join(warmed))
        for name, why in skipped.items():
            log.info("weights of %s not warmed: %s", name, why)
        self.last_skipped = skipped
        return warmed
