"""The model library: pull a GGUF into the models folder from a Hugging Face repo or a plain URL.

Sources: `hf.co/owner/repo:Q4_K_M` (Ollama's spelling: the repo's GGUF of that quantisation),
`owner/repo/file.gguf` or `hf.co/owner/repo/file.gguf` (one file), or an `http(s)://` URL. A Hugging
Face file is resolved through `huggingface_hub` against a configurable endpoint (a mirror), which
also gives its size and, for files in LFS, its sha256; a URL may carry `#sha256=<hex>`.

A pull reaches public hosts only, unless the admin allows a LAN host (app.residency.fetch: every
hop's host resolved, checked and connected at the address checked; URLs redacted for display).

A pull is refused before the first byte when the disk cannot hold the file beside what the other
pulls under way still have to write (a ledger of reservations per file system), and once the GGUF
header has arrived (the first megabytes) when the model cannot be served or would not fit the
memory budget — before the weights are downloaded. Bytes go to a hidden `.<name>.part` file next to
the target, locked while a pull writes it (one pull per file, in this process or another), so an
interrupted pull (a cut connection is retried at once, a stopped one by the next pull of the same
source) resumes where it stopped with an HTTP Range request. A sha256 mismatch deletes the part:
nothing is left behind. The file appears under its name only when complete and checked, so the
catalog never sees half a model. Writing, hashing and header parsing run off serve's event loop
(app.residency.offload).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import http.client
import itertools
import logging
import os
import queue
import re
import shutil
import socket
import threading
import time
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

from app.gguf_meta import GgufError, GgufMetadata, read_metadata_prefix
from app.residency.fetch import ALLOW_SETTING, HostPolicy, PullError, open_url, redact
from app.residency.offload import off_loop
from app.residency.voice_pull import is_voice_source, pull_voice

log = logging.getLogger(__name__)

CHUNK_BYTES = 1024 * 1024
MAX_RETRIES = 5
RETRY_PAUSE_S = 0.5
# The header of a big-vocabulary model is a few MiB; past this a file is not a GGUF worth waiting for.
MAX_HEADER_BYTES = 64 * 1024 * 1024
HEADER_FIRST_TRY_BYTES = 256 * 1024
WRITE_QUEUE_CHUNKS = 64
PROGRESS_EVERY_S = 0.2
# Kept free on the models folder's disk beyond the file itself, for the store and the system.
DISK_RESERVE_BYTES = 256 * 1024 * 1024
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_HF_PREFIXES = ("hf.co/", "huggingface.co/", "https://huggingface.co/", "https://hf.co/", "hf://")
# A pulled file's name becomes a served model name (its stem): kept to what a file system and a client's model
# list take, well under the 255 bytes of a file name (UTF-8 may take 4 bytes a character).
MAX_PULL_NAME_CHARS = 60
PULL_STATES = ("resolving", "downloading", "verifying", "done", "failed", "refused")


# -- sources and pulls -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """Where a model file comes from, as resolved before downloading (`endpoint`: the Hugging Face
    endpoint it was resolved through, whose host the pull may reach)."""

    spec: str
    url: str
    filename: str
    size_bytes: int | None = None
    sha256: str | None = None
    endpoint: str | None = None


@dataclass
class Pull:
    """One pull's progress, read by the dashboard, the CLI and /api/pull; `label` is the spec as shown (redacted)."""

    spec: str
    id: int = 0
    state: str = "resolving"
    filename: str | None = None
    total_bytes: int | None = None
    done_bytes: int = 0
    resumed_from: int = 0
    sha256: str | None = None
    error: str | None = None
    code: str | None = None
    path: Path | None = None
    started_s: float = field(default_factory=time.monotonic)
    finished_s: float | None = None
    label: str = ""

    def __post_init__(self):
        self.label = redact(self.spec)

    @property
    def active(self) -> bool:
        """Still resolving, downloading or verifying."""
        return self.state in ("resolving", "downloading", "verifying")

    @property
    def percent(self) -> int:
        """How far the download is, 0–100."""
        return int(100 * self.done_bytes / self.total_bytes) if self.total_bytes else 0

    def end(self, exc: PullError) -> None:
        """Record why the pull stopped (refused by a check, or failed)."""
        self.state = "refused" if exc.refused else "failed"
        self.error, self.code, self.finished_s = str(exc), exc.code, time.monotonic()


def _hf_parts(spec: str) -> tuple[str, str | None, str | None] | None:
    """(repo, file, quantisation tag) of a Hugging Face spec; None when the spec is not one."""
    text = spec
    for prefix in _HF_PREFIXES:
        if text.startswith(prefix):
            text = text[len(prefix):]
            break
    else:
        if text.startswith(("http://", "https://")) or text.count("/") < 1:
            return None
    text = text.strip("/")
    repo_part, _, tag = text.partition(":")
    parts = repo_part.split("/")
    if len(parts) < 2 or not all(parts[:2]):
        return None
    repo = "/".join(parts[:2])
    # huggingface.co/owner/repo/resolve/main/file.gguf: a browser's copy of a file link.
    rest = parts[2:]
    if rest[:1] in (["resolve"], ["blob"]) and len(rest) >= 3:
        rest = rest[2:]
    file = "/".join(rest) or None
    return repo, file, tag or None


def _pick_quant(files: list[str], tag: str | None, repo: str) -> str:
    """The repo's GGUF of quantisation `tag` (Ollama's hf.co/owner/repo:TAG), or its only one."""
    ggufs = [f for f in files if f.lower().endswith(".gguf") and "mmproj" not in f.lower()]
    if tag:
        wanted = tag.lower()
        ggufs = [f for f in ggufs if wanted in Path(f).name.lower()]
    # The first shard of a split model, never a later one.
    ggufs = [f for f in ggufs if not re.search(r"-0000[2-9]-of-|-000[1-9]\d-of-", f)]
    if len(ggufs) == 1:
        return ggufs[0]
    what = f"quantisation '{tag}'" if tag else "a tag"
    if not ggufs:
        raise PullError(f"{repo} has no GGUF file" + (f" of quantisation '{tag}'" if tag else ""), refused=True,
                        code="not_found")
    raise PullError(f"{repo} has {len(ggufs)} GGUF files for {what}: name one ({', '.join(sorted(ggufs)[:8])})",
                    refused=True, code="bad_source")


def resolve(spec: str, endpoint: str | None = None, hosts: HostPolicy | None = None) -> Source:
    """Where `spec` is and what it should be (size, sha256), without downloading it; a URL's HEAD
    request reaches only the hosts `hosts` allows (public ones by default)."""
    spec = spec.strip()
    if not spec:
        raise PullError("no source given: a Hugging Face repo (hf.co/owner/repo:Q4_K_M), a file (owner/repo/file.gguf) "
                        "or an http(s) URL", refused=True, code="bad_source")
    hf = _hf_parts(spec)
    if hf is None and spec.startswith(("http://", "https://")):
        url, _, fragment = spec.partition("#")
        sha = fragment.removeprefix("sha256=").lower() if fragment.startswith("sha256=") else None
        name = unquote(Path(urlsplit(url).path).name)
        filename = _gguf_name(name)
        size = None
        try:
            conn, resp = open_url(url, {}, hosts or HostPolicy(), method="HEAD")
            conn.close()
            if resp.status < 400 and resp.getheader("Content-Length"):
                size = int(resp.getheader("Content-Length"))
        except (OSError, http.client.HTTPException, ValueError):
            pass  # a server without HEAD: the GET tells
        return Source(spec, url, filename, size, sha)
    if hf is None:
        raise PullError(f"cannot pull {spec!r}: Hearth pulls from Hugging Face (hf.co/owner/repo:Q4_K_M or "
                        "owner/repo/file.gguf) or an http(s) URL to a .gguf; the Ollama registry is not supported",
                        refused=True, code="bad_source")
    repo, file, tag = hf
    from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError

    try:
        if file is None:
            file = _pick_quant(HfApi(endpoint=endpoint).list_repo_files(repo), tag, repo)
        url = hf_hub_url(repo, file, endpoint=endpoint)
        meta = get_hf_file_metadata(url, endpoint=endpoint)
    except HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        raise PullError(f"Hugging Face ({endpoint or 'default endpoint'}) refused {repo}/{file or ''}: {exc}",
                        refused=status == 404, code="not_found" if status == 404 else "upstream")
    except PullError:
        raise
    except Exception as exc:  # huggingface_hub's HTTP client raises its own errors for an unreachable endpoint
        raise PullError(f"cannot reach Hugging Face ({endpoint or 'default endpoint'}): {type(exc).__name__}: {exc}")
    from huggingface_hub import constants

    etag = (meta.etag or "").lower()
    # The endpoint resolved against ($HF_ENDPOINT when the setting names none): a mirror the admin chose.
    return Source(spec, meta.location or url, _gguf_name(Path(file).name), meta.size,
                  etag if _SHA256.match(etag) else None, endpoint or constants.ENDPOINT)


def clean_name(name: str) -> str:
    """A pulled file's name as Hearth keeps it: no control or format characters (CR, LF, NUL, bidi overrides),
    path separators as '-', spaces collapsed, no leading dot, at most MAX_PULL_NAME_CHARS before its suffix."""
    kept = "".join("-" if c in "/\\" else " " if c.isspace() else c for c in name
                   if not unicodedata.category(c).startswith("C") or c.isspace())
    stem, dot, suffix = " ".join(kept.split()).rpartition(".")
    if not dot:
        return suffix.lstrip(". ")
    return f"{stem.lstrip('. ')[:MAX_PULL_NAME_CHARS].rstrip()}.{suffix}"


def _gguf_name(name: str) -> str:
    cleaned = clean_name(name)
    if not cleaned.lower().endswith(".gguf"):
        raise PullError(f"{cleaned!r} is not a .gguf file: Hearth serves GGUF models only", refused=True,
                        code="bad_source")
    if cleaned[: -len(".gguf")].strip(" -") == "":
        raise PullError(f"{cleaned!r} has no name before .gguf: name the file (owner/repo/NAME.gguf or a URL ending "
                        "in NAME.gguf)", refused=True, code="bad_source")
    return cleaned


def part_path(target: Path) -> Path:
    """Where a pull of `target` keeps its bytes until they are complete and checked."""
    return target.with_name(f".{target.name}.part")


# -- disk reservations -----------------------------------------------------------------------------


@dataclass(eq=False)  # one pull's promise: released by identity, never by an equal one
class Reservation:
    """Disk space a pull under way has promised to fill: what it needs less what it has written so far."""

    device: int
    need_bytes: int
    written_bytes: int = 0

    @property
    def outstanding_bytes(self) -> int:
        """What it has yet to write (free space shrinks as it writes, so only this is still promised)."""
        return max(0, self.need_bytes - self.written_bytes)


class DiskLedger:
    """Disk space promised to the pulls under way, per file system: each pull's free-disk check counts what
    the others still have to write, so fifty pulls at once cannot each pass it on the same free bytes."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held: list[Reservation] = []

    def reserve(self, folder: Path, name: str, need_bytes: int, disk_free: Callable[[Path], int]) -> Reservation:
        """Promise `need_bytes` on `folder`'s disk to a pull of `name`; PullError (refused) when they are not free."""
        device = os.stat(folder).st_dev
        with self._lock:
            free = disk_free(folder)
            others = [r for r in self._held if r.device == device and r.outstanding_bytes]
            promised = sum(r.outstanding_bytes for r in others)
            if need_bytes + promised + DISK_RESERVE_BYTES > free:
                held = (f", {_gib(promised)} of them promised to {len(others)} other pull{'s' if len(others) > 1 else ''} "
                        "under way" if others else "")
                raise PullError(f"not enough disk for {name}: it needs {_gib(need_bytes)} more and {_gib(free)} are free "
                                f"on the models folder's disk{held} (keeping {_gib(DISK_RESERVE_BYTES)}); free some space "
                                "and pull it again (a partial download is kept and resumed)", refused=True,
                                code="disk_full")
            held_now = Reservation(device, need_bytes)
            self._held.append(held_now)
            return held_now

    def release(self, reservation: Reservation) -> None:
        """The pull ended: its promise is void."""
        with self._lock:
            if reservation in self._held:
                self._held.remove(reservation)

    def promised_bytes(self) -> int:
        """Disk space promised to the pulls under way, all file systems together."""
        with self._lock:
            return sum(r.outstanding_bytes for r in self._held)


# One ledger per process: the dashboard's, the API's and the CLI's pulls share the models folder's disk.
LEDGER = DiskLedger()


# -- the download ----------------------------------------------------------------------------------


def pull(source: Source, models_dir: Path, check_header: Callable[[GgufMetadata], str | None] = lambda m: None,
         progress: Callable[[Pull], None] = lambda p: None, state: Pull | None = None,
         disk_free: Callable[[Path], int] | None = None,
         max_retries: int = MAX_RETRIES, on_landed: Callable[[Path], None] = lambda path: None,
         hosts: HostPolicy | None = None, ledger: DiskLedger | None = None) -> Path:
    """Download `source` into `models_dir` (resuming a part left by an earlier pull); its path.
    `on_landed` runs once the file has its name and before the pull reads as done (a rescan); `hosts`
    names the non-public hosts it may reach besides the source's Hugging Face endpoint (default: none)."""
    p = state or Pull(source.spec)
    p.filename, p.total_bytes, p.sha256 = source.filename, source.size_bytes, source.sha256
    hosts = (hosts or HostPolicy()).with_endpoint(source.endpoint)
    ledger = ledger or LEDGER
    free_of = disk_free or _disk_free
    target = models_dir / source.filename
    part = part_path(target)
    out = None
    holds: list[Reservation] = []

    def reserve(need_bytes: int) -> None:
        for held in holds:
            ledger.release(held)
        holds[:] = [ledger.reserve(models_dir, source.filename, need_bytes, free_of)]

    def written(n: int) -> None:
        for held in holds:
            held.written_bytes += n

    def exists() -> PullError:
        return PullError(f"{target.name} is already in the models folder; delete it first to pull it again",
                         refused=True, code="exists")

    try:
        if target.exists():
            raise exists()
        out = _open_part(part)
        if target.exists():  # landed by the pull that held the lock until a moment ago
            raise exists()
        have = os.fstat(out.fileno()).st_size
        if source.size_bytes is not None:
            reserve(source.size_bytes - have)
        digest = off_loop(_hash_of, part) if have else hashlib.sha256()
        p.state, p.done_bytes, p.resumed_from = "downloading", have, have
        progress(p)
        header_checked = False
        retries = 0
        while True:
            try:
                header_checked = _download(source, out, digest, p, progress, check_header, header_checked, hosts,
                                           None if holds else reserve, written)
                break
            except _Restart as exc:
                log.warning("pull %s: %s", source.filename, exc)
                digest, header_checked = hashlib.sha256(), False
                if p.total_bytes is not None:
                    reserve(p.total_bytes)
            except _Cut as exc:
                retries += 1
                if retries > max_retries:
                    kept = os.fstat(out.fileno()).st_size
                    raise PullError(f"the download of {source.filename} kept failing ({exc}); pull it again to "
                                    + (f"resume from {_gib(kept)}" if kept else "retry"), code="cut")
                log.warning("pull %s: %s; resuming at %d bytes (retry %d)", source.filename, redact(str(exc)),
                            p.done_bytes, retries)
                time.sleep(RETRY_PAUSE_S)
        p.state = "verifying"
        progress(p)
        actual = digest.hexdigest()
        if source.sha256 and actual != source.sha256:
            raise PullError(f"sha256 mismatch for {source.filename}: expected {source.sha256}, got {actual}; "
                            "the download was deleted", code="mismatch", discard=True)
        if not header_checked:
            prefix, size = off_loop(_read_head, part)
            _check(_parse_header(prefix, size, source.filename), check_header)
        p.sha256 = actual
        os.replace(part, target)
        on_landed(target)
        p.state, p.path, p.finished_s = "done", target, time.monotonic()
        progress(p)
        return target
    except PullError as exc:
        if exc.discard and out is not None:
            part.unlink(missing_ok=True)  # refused or corrupt: nothing is left behind
        p.end(exc)
        progress(p)
        raise
    finally:
        for held in holds:
            ledger.release(held)
        if out is not None:
            _close_part(out, part)


def _open_part(part: Path):
    """The part file, opened to append and locked for this pull (one pull per file, across processes too)."""
    try:
        out = open(part, "ab", buffering=0)
    except OSError as exc:
        raise PullError(_unwritable(part.parent, exc),
                        code="read_only" if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM) else "write_failed")
    try:
        fcntl.flock(out.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        out.close()
        raise PullError(f"{part.name.removeprefix('.').removesuffix('.part')} is being pulled already (by another pull "
                        "of this Hearth or a `hearth models pull`): that pull goes on; its progress is on the Models page",
                        refused=True, code="busy")
    return out


def _unwritable(folder: Path, exc: OSError) -> str:
    """What to tell when the part file cannot be created in the models folder."""
    if exc.errno == errno.EROFS:
        return (f"the models folder is read-only: {exc}; Hearth writes pulls into {folder}, so mount it read-write "
                "(docker-compose.yml ships it as ./models:/models:ro: drop the :ro), or copy .gguf files in yourself")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (f"the models folder is read-only for the user Hearth runs as (uid {os.getuid()}): {exc}; give that "
                f"user write access to {folder}, or copy .gguf files in yourself")
    return f"cannot write into the models folder {folder}: {exc}"


def _close_part(out, part: Path) -> None:
    """Unlock and close the part; an empty one is removed (nothing to resume), a partial one stays for the next pull."""
    try:
        mine = os.fstat(out.fileno())
        on_disk = os.stat(part)
        if mine.st_size == 0 and (on_disk.st_dev, on_disk.st_ino) == (mine.st_dev, mine.st_ino):
            part.unlink()
    except OSError:
        pass  # landed (renamed) or already gone
    finally:
        out.close()


def _hash_of(part: Path):
    """A sha256 over what an earlier pull left in `part`, to go on with (runs off the event loop)."""
    digest = hashlib.sha256()
    with open(part, "rb") as f:
        while block := f.read(CHUNK_BYTES * 8):
            digest.update(block)
    return digest


def _read_head(part: Path) -> tuple[bytes, int]:
    """The first MAX_HEADER_BYTES of `part` and its size (runs off the event loop)."""
    with open(part, "rb") as f:
        return f.read(MAX_HEADER_BYTES), os.fstat(f.fileno()).st_size


def _append(out, digest, chunk: bytes) -> None:
    """Write and hash one chunk (runs off the event loop); a raw file may take a write in pieces."""
    view = memoryview(chunk)
    while view:
        view = view[out.write(view):]
    digest.update(chunk)


def header_entry(metadata: GgufMetadata, name: str):
    """A catalog entry for a GGUF known only by its header (a pull under way), usable or with the reason."""
    from dataclasses import replace

    from app.residency.catalog import _entry_from_metadata, _unusable_reason

    path = Path(name)
    entry = _entry_from_metadata(path, "folder", metadata.file_size, 0.0, metadata, [metadata])
    split = metadata.fields.get("split.count")
    reason = _unusable_reason(metadata, [metadata])
    if isinstance(split, int) and split > 1:
        reason = f"a split model ({split} files): pull a single-file GGUF"
    return entry if reason is None else replace(entry, usable=False, unusable_reason=reason)


def budget_refusal(metadata: GgufMetadata, n_ctx: int | None, parallel: int | None, n_batch: int,
                   budget_bytes: int, ram_tier_mib: int = 0) -> str | None:
    """Why a model known by its header cannot be served, or would not fit the memory budget with these
    runner settings (None: sized as app.residency.estimate.size_runner would) and the RAM tier the budget
    reserves for its runner; None when it can be served and fits."""
    from app.residency.estimate import estimate_memory, size_runner

    entry = header_entry(metadata, metadata.path)
    if not entry.usable:
        return f"{entry.name} cannot be served: {entry.unusable_reason}"
    if n_ctx is None or parallel is None:
        sized = size_runner(entry, budget_bytes, n_batch, parallel=parallel, n_ctx=n_ctx, ram_tier_mib=ram_tier_mib)
        n_ctx, parallel = sized.n_ctx, sized.parallel
    need = estimate_memory(entry, n_ctx, parallel, n_batch, ram_tier_mib=ram_tier_mib).total_bytes
    if need > budget_bytes:
        tier = f", RAM tier {ram_tier_mib} MiB" if ram_tier_mib > 0 else ""
        return (f"{entry.name} would need {_gib(need)} resident (ctx {n_ctx} × {parallel} slots{tier}) and the memory "
                f"budget is {_gib(budget_bytes)}: pull a smaller quantisation, raise memory_limit_mb"
                + (" or lower runner_cache_ram_mib" if tier else ""))
    return None


class _Cut(Exception):
    """The connection broke mid-download: resumable."""


class _Restart(Exception):
    """The server ignored the Range request: the part was emptied and the download starts over."""


def _check(metadata: GgufMetadata, check_header: Callable[[GgufMetadata], str | None]) -> None:
    reason = check_header(metadata)
    if reason:
        raise PullError(reason, refused=True, code="unservable", discard=True)


def _parse_header(prefix: bytes, size: int, name: str) -> GgufMetadata:
    try:
        return read_metadata_prefix(prefix, size, name)
    except GgufError as exc:
        raise PullError(f"{name} is not a GGUF Hearth can serve: {exc}", refused=True, code="unservable", discard=True)


def _download(source: Source, out, digest, p: Pull, progress, check_header, header_checked: bool, hosts: HostPolicy,
              reserve: Callable[[int], None] | None, written: Callable[[int], None]) -> bool:
    """Append the rest of the file to the part `out`; True once the header was checked. `reserve` is
    called with what is left once the response tells the size (when nothing told it before)."""
    # The standard library's reader, not httpx's: on loopback it read 400-740 MB/s against
    # httpx's 130 (measured here), and curl's speed is the target. Writing and hashing run on a
    # second thread (both release the GIL), so reading never waits for them; under serve's gevent
    # that thread is a greenlet, so each chunk's write goes to a pool thread (off_loop).
    have = os.fstat(out.fileno()).st_size
    p.done_bytes = have
    if p.total_bytes is not None and have >= p.total_bytes:
        return header_checked
    header = bytearray()
    if have and not header_checked:
        header += off_loop(_read_head, Path(out.name))[0]
    try:
        conn, resp = open_url(source.url, {"Range": f"bytes={have}-"} if have else {}, hosts)
    except socket.gaierror as exc:  # no such host: retrying at once would not find it either
        raise PullError(f"cannot find the host of {source.url}: {exc.strerror or exc}; check the source's spelling "
                        "and this machine's DNS", code="upstream")
    except (OSError, http.client.HTTPException) as exc:
        raise _Cut(f"{type(exc).__name__}: {exc}")
    chunks: queue.Queue = queue.Queue(maxsize=WRITE_QUEUE_CHUNKS)
    failed: list[BaseException] = []

    def write() -> None:
        for chunk in iter(chunks.get, None):
            if failed:
                continue  # drained, so the reader never waits on a writer that stopped
            try:
                off_loop(_append, out, digest, chunk)
                written(len(chunk))
            except Exception as exc:  # a full disk after all: stop, keep what was written
                failed.append(exc)

    writer = threading.Thread(target=write, name="pull-writer", daemon=True)
    try:
        if resp.status == 416 and have:
            return header_checked
        if resp.status >= 400:
            raise PullError(f"{source.url} answered HTTP {resp.status}", code="not_found" if resp.status == 404 else "upstream")
        if have and resp.status != 206:
            off_loop(out.truncate, 0)
            raise _Restart(f"the server ignored the Range request (HTTP {resp.status}): starting over")
        if p.total_bytes is None and resp.getheader("Content-Length"):
            p.total_bytes = have + int(resp.getheader("Content-Length"))
        if reserve is not None and p.total_bytes is not None:
            reserve(p.total_bytes - have)
        writer.start()
        last = 0.0
        # Parsing restarts from the first byte: try at doubling sizes, not on every chunk (a
        # 262k-token vocabulary is a 6 MB header, and a parse per chunk would be quadratic).
        next_try = HEADER_FIRST_TRY_BYTES
        while not failed:
            chunk = resp.read1(CHUNK_BYTES)
            if not chunk:
                break
            chunks.put(chunk)
            p.done_bytes += len(chunk)
            if not header_checked:
                header += chunk
                if len(header) >= next_try:
                    header_checked = _try_header(header, p, check_header)
                    next_try = 2 * len(header)
            now = time.monotonic()
            if now - last >= PROGRESS_EVERY_S:
                last = now
                progress(p)
    except (OSError, http.client.HTTPException) as exc:
        raise _Cut(f"{type(exc).__name__}: {exc}")
    finally:
        if writer.is_alive():
            chunks.put(None)
            writer.join()
        conn.close()
    if failed:
        raise PullError(f"writing {out.name} failed: {failed[0]}; what was written is kept: pull it again to resume",
                        code="write_failed")
    if p.total_bytes is not None and p.done_bytes < p.total_bytes:
        raise _Cut(f"the connection closed at {p.done_bytes} of {p.total_bytes} bytes")
    return header_checked


def _try_header(header: bytearray, p: Pull, check_header) -> bool:
    """Check the header once enough bytes arrived; False while more are needed. The parse runs off the
    event loop (a big vocabulary is megabytes of Python work), the check here (it reads the settings)."""
    try:
        metadata = off_loop(lambda: read_metadata_prefix(bytes(header), p.total_bytes or len(header), p.filename or ""))
    except GgufError as exc:
        if "truncated" in str(exc) and len(header) < MAX_HEADER_BYTES:
            return False
        raise PullError(f"{p.filename} is not a GGUF Hearth can serve: {exc}", refused=True, code="unservable",
                        discard=True)
    _check(metadata, check_header)
    header.clear()
    return True


def _disk_free(folder: Path) -> int:
    return shutil.disk_usage(folder).free


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


class Library:
    """Pulls in the background, one thread each, with their progress kept for the dashboard and the API."""

    def __init__(self, models_dir: Path, check_header: Callable[[GgufMetadata], str | None],
                 on_done: Callable[[Path], None], endpoint: Callable[[], str | None] = lambda: None,
                 disk_free: Callable[[Path], int] | None = None, ledger: DiskLedger | None = None,
                 name_problem: Callable[[str], str | None] = lambda name: None):
        self.models_dir = models_dir
        # Why a served model name may not come from a pull (an alias's, a reserved one), or None.
        self._name_problem = name_problem
        self._check_header = check_header
        self._on_done = on_done
        self._endpoint = endpoint
        self._disk_free = disk_free
        self._ledger = ledger or LEDGER
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pulls: dict[int, Pull] = {}

    def start(self, spec: str, allowed_hosts: str | None = None) -> Pull:
        """Start pulling `spec` (or return the pull of it already running, which this one joins).
        `allowed_hosts`: the admin's pull_allowed_hosts, the non-public hosts this pull may reach."""
        with self._lock:
            for p in self._pulls.values():
                if p.spec == spec and p.active:
                    return p
            p = Pull(spec, id=next(self._ids))
            self._pulls[p.id] = p
        threading.Thread(target=self._run, args=(p, allowed_hosts), name=f"pull-{p.id}", daemon=True).start()
        return p

    def _claim(self, p: Pull, filename: str) -> None:
        """Make `p` the pull of `filename`; refused while another pull of this library writes it."""
        with self._lock:
            other = next((o for o in self._pulls.values() if o is not p and o.active and o.filename == filename), None)
            if other is not None:
                raise PullError(f"{filename} is being pulled already (pull {other.id}, {other.label}, {other.percent} %): "
                                "that pull goes on; its progress is on the Models page", refused=True, code="busy")
            p.filename = filename

    def _run(self, p: Pull, allowed_hosts: str | None) -> None:
        try:
            try:
                hosts = HostPolicy.parse(allowed_hosts)
            except ValueError as exc:
                raise PullError(f"the setting {ALLOW_SETTING} cannot be read: {exc}", refused=True, code="host_refused")
            if is_voice_source(p.spec):
                self._on_done(pull_voice(p.spec, self.models_dir, hosts, p))
                return
            source = resolve(p.spec, self._endpoint(), hosts)
            problem = self._name_problem(Path(source.filename).stem)
            if problem is not None:
                raise PullError(problem, refused=True, code="exists")
            self._claim(p, source.filename)
            # Done only once the catalog lists it: a client told "success" may use the model at once.
            pull(source, self.models_dir, self._check_header, state=p, disk_free=self._disk_free,
                 on_landed=self._on_done, hosts=hosts, ledger=self._ledger)
        except PullError as exc:
            if p.active:
                p.end(exc)
            log.warning("pull %s %s: %s", p.label, p.state, exc)
        except Exception as exc:  # a pull thread must record why it ended, whatever happened
            # The message redacted; the traceback (which quotes it as raised) only at debug level.
            log.error("pull %s failed: %s", p.label, redact(f"{type(exc).__name__}: {exc}"))
            log.debug("pull %s failed", p.label, exc_info=True)
            p.state, p.error, p.code, p.finished_s = ("failed", redact(f"{type(exc).__name__}: {exc}"), "upstream",
                                                      time.monotonic())

    def get(self, pull_id: int) -> Pull | None:
        """One pull by id."""
        return self._pulls.get(pull_id)

    def pulls(self) -> list[Pull]:
        """Every pull of this process, newest first."""
        return sorted(self._pulls.values(), key=lambda p: -p.id)
