"""The store's single writer: one thread owns the writing, everyone else queues work for it.

Serving threads call `submit`/`add`, which never wait on the disk: the work goes into a bounded
queue and the writer thread commits it in batches. Loop of the writer thread:

  1. wait for the first item; then gather more until `max_batch` items or `batch_window_s` has
     passed (or only what is already queued, when someone is flushing or stopping);
  2. run the whole batch in one transaction (BEGIN IMMEDIATE) and commit;
  3. transient failure (database locked or busy, disk full, I/O error): roll back, wait with
     exponential backoff and retry the whole batch, up to `max_retries` times, then give it up;
  4. any other failure means some item is bad: retry the batch item by item, each in its own
     transaction, so only the bad items are lost (logged and counted);
  5. count what was done and wake the flushers.

Every item that does not reach the store is counted by reason (`lost_by_reason`): a full queue, a
stopped writer, a full disk, a read-only folder, an I/O error, a bad item. `health()` tells the
dashboard and /metrics; after a give-up the next batch tries again, so writing resumes by itself
once space returns.
"""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, inspect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from app.store.db import immediate, session_factory

log = logging.getLogger(__name__)

Work = Callable[[Session], None]

# Primary SQLite result codes worth retrying: another connection holds the lock, the disk is full,
# or the file system hiccuped. Anything else (constraint, missing table, bad SQL) will fail again.
_TRANSIENT_SQLITE_CODES = {
    sqlite3.SQLITE_BUSY,
    sqlite3.SQLITE_LOCKED,
    sqlite3.SQLITE_FULL,
    sqlite3.SQLITE_IOERR,
    sqlite3.SQLITE_PROTOCOL,
    # The data folder made read-only, or its files briefly unopenable: the admin can fix it, so
    # keep trying rather than dropping every later write as a "bad item".
    sqlite3.SQLITE_READONLY,
    sqlite3.SQLITE_CANTOPEN,
}
# Why an item was lost, by SQLite primary result code.
_LOSS_REASONS = {
    sqlite3.SQLITE_FULL: "disk_full",
    sqlite3.SQLITE_READONLY: "read_only",
    sqlite3.SQLITE_CANTOPEN: "cannot_open",
    sqlite3.SQLITE_IOERR: "io_error",
    sqlite3.SQLITE_BUSY: "locked",
    sqlite3.SQLITE_LOCKED: "locked",
    sqlite3.SQLITE_PROTOCOL: "locked",
}
LOSS_REASONS = ("queue_full", "stopped", "bad_item", *sorted(set(_LOSS_REASONS.values())))
_STOP = object()
# At most one "queue full" warning per this many seconds; the count is always exact.
_DROP_LOG_INTERVAL_S = 10.0


def loss_reason(error: BaseException) -> str:
    """The reason an item lost to this error is counted under."""
    code = getattr(getattr(error, "orig", None), "sqlite_errorcode", None)
    if code is None:
        return "bad_item"
    return _LOSS_REASONS.get(code & 0xFF, "bad_item")


def is_transient(error: BaseException) -> bool:
    """Whether a database error is worth retrying as is (locked, busy, disk full, I/O)."""
    if not isinstance(error, DBAPIError):
        return False
    code = getattr(error.orig, "sqlite_errorcode", None)
    if code is None:
        return False
    # Extended codes (e.g. SQLITE_BUSY_SNAPSHOT) carry the primary code in their low byte.
    return (code & 0xFF) in _TRANSIENT_SQLITE_CODES


class StoreWriter:
    """Batches and commits queued writes on one thread; callers never block on the database."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_queue: int = 100_000,
        max_batch: int = 500,
        batch_window_s: float = 0.05,
        max_retries: int = 8,
        retry_base_s: float = 0.05,
        retry_max_s: float = 2.0,
        name: str = "store-writer",
        clock: Callable[[], float] = time.time,
    ):
        self._sessions = session_factory(immediate(engine))
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue)
        self.max_batch = max_batch
        self.batch_window_s = batch_window_s
        self.max_retries = max_retries
        self.retry_base_s = retry_base_s
        self.retry_max_s = retry_max_s
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        # Guards the counters below and orders submit against stop, so nothing lands behind _STOP.
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._closed = False
        self._num_flushing = 0
        self._num_accepted = 0
        self._num_processed = 0
        self._num_written = 0
        self._num_dropped = 0
        self._num_failed_items = 0
        self._num_failed_batches = 0
        self._num_retries = 0
        self._num_commits = 0
        self._last_drop_log = float("-inf")
        self._clock = clock
        self._lost_by_reason: dict[str, int] = {}
        self._last_error: str | None = None
        self._last_error_at: float | None = None
        self._failing_since: float | None = None
        self._last_commit_at: float | None = None

    # -- callers' side ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the writer thread (work submitted before this waits in the queue)."""
        if self._closed:
            raise RuntimeError("a stopped StoreWriter cannot be started again")
        self._thread.start()

    def submit(self, fn: Work) -> bool:
        """Queue `fn(session)` to run in a write transaction; False if dropped (queue full or stopped)."""
        with self._lock:
            if not self._closed:
                try:
                    self._queue.put_nowait(fn)
                except queue.Full:
                    pass
                else:
                    self._num_accepted += 1
                    return True
            self._num_dropped += 1
            self._count_lost("stopped" if self._closed else "queue_full", 1)
            now = time.monotonic()
            if now - self._last_drop_log >= _DROP_LOG_INTERVAL_S:
                self._last_drop_log = now
                reason = "stopped" if self._closed else f"queue full ({self._queue.maxsize} items)"
                log.warning("store writer %s: dropping writes, %d dropped so far", reason, self._num_dropped)
            return False

    def add(self, obj: Any) -> bool:
        """Queue an INSERT of a new ORM object's column values (copied now; relationships are not)."""
        state = inspect(obj)
        if not state.transient:
            raise ValueError(f"{obj!r} already belongs to a session; add() only inserts new objects")
        cls = type(obj)
        # A copy taken on the caller's thread: the caller may keep using obj, and a retried batch
        # needs a fresh instance each time (a rolled-back one keeps its flushed state).
        values = {}
        for attr in state.mapper.column_attrs:
            if attr.key in state.dict:
                values[attr.key] = state.dict[attr.key]
                continue
            default = attr.columns[0].default
            # Callable defaults are timestamps in practice: take them at submit time, not at
            # whatever later moment the batch commits.
            if default is not None and default.is_callable:
                values[attr.key] = default.arg(None)
        return self.submit(lambda session: session.add(cls(**values)))

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything submitted before this call has been processed; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._done:
            target = self._num_accepted
            self._num_flushing += 1
            try:
                while self._num_processed < target:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    self._done.wait(remaining)
                return True
            finally:
                self._num_flushing -= 1

    def stop(self, timeout_s: float | None = None) -> bool:
        """Refuse new work, write what is queued, and end the thread; False if that did not finish in time."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s

        def remaining_s() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        with self._lock:
            already_closed = self._closed
            self._closed = True
        if not self._thread.is_alive():
            return self._queue.empty()
        if not already_closed:
            try:
                # Last in the queue: submit() takes nothing once closed.
                self._queue.put(_STOP, timeout=remaining_s())
            except queue.Full:
                return False
        self._thread.join(remaining_s())
        return not self._thread.is_alive()

    @property
    def num_written(self) -> int:
        """Items committed."""
        return self._num_written

    @property
    def num_dropped(self) -> int:
        """Items refused by submit because the queue was full or the writer stopped."""
        return self._num_dropped

    @property
    def num_failed_items(self) -> int:
        """Items accepted but not written: bad items, and the items of abandoned batches."""
        return self._num_failed_items

    @property
    def num_failed_batches(self) -> int:
        """Batches given up after `max_retries` transient failures."""
        return self._num_failed_batches

    @property
    def num_retries(self) -> int:
        """Transient failures that were retried."""
        return self._num_retries

    @property
    def num_commits(self) -> int:
        """Transactions committed (a batch is normally one)."""
        return self._num_commits

    @property
    def lost_by_reason(self) -> dict[str, int]:
        """Items that never reached the store, by reason (queue_full, stopped, disk_full, read_only, ...)."""
        return dict(self._lost_by_reason)

    def health(self) -> dict:
        """What the dashboard and /metrics show: losses by reason, the last error, whether writes fail now."""
        with self._lock:
            lost = dict(self._lost_by_reason)
            return {
                "ok": self._failing_since is None and not lost,
                "failing": self._failing_since is not None,
                "failing_since": self._failing_since,
                "lost_total": sum(lost.values()),
                "lost_by_reason": lost,
                "last_error": self._last_error,
                "last_error_at": self._last_error_at,
                "last_commit_at": self._last_commit_at,
                "written_total": self._num_written,
                "retries_total": self._num_retries,
                "pending": self._num_accepted - self._num_processed,
            }

    def _count_lost(self, reason: str, n: int) -> None:
        # Callers hold self._lock: submit() counts from serving threads, the writer thread from its own.
        self._lost_by_reason[reason] = self._lost_by_reason.get(reason, 0) + n

    def _note_error(self, error: BaseException) -> None:
        now = self._clock()
        self._last_error = str(getattr(error, "orig", None) or error)
        self._last_error_at = now
        if self._failing_since is None:
            self._failing_since = now

    @property
    def num_pending(self) -> int:
        """Items accepted and not yet processed."""
        return self._num_accepted - self._num_processed

    # -- writer thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        stopping = False
        while not stopping:
            batch, stopping = self._gather()
            if batch:
                self._write(batch)
                with self._done:
                    self._num_processed += len(batch)
                    self._done.notify_all()

    def _gather(self) -> tuple[list[Work], bool]:
        item = self._queue.get()
        if item is _STOP:
            return [], True
        batch = [item]
        deadline = time.monotonic() + self.batch_window_s
        while len(batch) < self.max_batch:
            # Someone is waiting on this batch: take what is queued, don't sit out the window.
            hurry = self._num_flushing > 0 or self._closed
            remaining = deadline - time.monotonic()
            try:
                if hurry or remaining <= 0:
                    item = self._queue.get_nowait()
                else:
                    item = self._queue.get(timeout=remaining)
            except queue.Empty:
                break
            if item is _STOP:
                return batch, True
            batch.append(item)
        return batch, False

    def _write(self, batch: list[Work]) -> None:
        for attempt in range(self.max_retries + 1):
            try:
                self._commit(batch)
            except Exception as error:  # noqa: BLE001 - sorted below: transient, or a bad item to isolate
                if not is_transient(error):
                    self._isolate(batch, error)
                    return
                self._note_error(error)
                if attempt == self.max_retries:
                    self._give_up(batch, error)
                    return
                self._num_retries += 1
                delay_s = min(self.retry_max_s, self.retry_base_s * 2**attempt)
                log.info("store writer: %s; retry %d in %.2f s", error.orig, attempt + 1, delay_s)
                time.sleep(delay_s)
            else:
                self._num_written += len(batch)
                self._num_commits += 1
                self._failing_since = None
                self._last_commit_at = self._clock()
                return

    def _isolate(self, batch: list[Work], error: Exception) -> None:
        if len(batch) == 1:
            with self._lock:
                self._num_failed_items += 1
                self._count_lost("bad_item", 1)
                self._last_error = f"bad item: {error}"
                self._last_error_at = self._clock()
            # A database error says what was wrong; anything else is a bug in the caller's work.
            log.error("store writer: dropped a bad item: %s", error, exc_info=not isinstance(error, DBAPIError))
            return
        # One bad item must not take the rest of its batch down with it.
        for item in batch:
            self._write([item])

    def _commit(self, batch: list[Work]) -> None:
        with self._sessions() as session, session.begin():
            for fn in batch:
                fn(session)

    def _give_up(self, batch: list[Work], error: Exception) -> None:
        with self._lock:
            self._num_failed_batches += 1
            self._num_failed_items += len(batch)
            self._count_lost(loss_reason(error), len(batch))
        log.error(
            "store writer: gave up a batch of %d items after %d retries: %s", len(batch), self.max_retries, error
        )
