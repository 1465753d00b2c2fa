"""The model library: pull a GGUF into the models folder from a Hugging Face repo or a plain URL.

Sources: `hf.co/owner/repo:Q4_K_M` (Ollama's spelling: the repo's GGUF of that quantisation),
`owner/repo/file.gguf` or `hf.co/owner/repo/file.gguf` (one file), or an `http(s)://` URL. A Hugging
Face file is resolved through `huggingface_hub` against a configurable endpoint (a mirror), which
also gives its size and, for files in LFS, its sha256; a URL may carry `#sha256=<hex>`.

A pull is refused before the first byte when the disk cannot hold the file, and once the GGUF
header has arrived (the first megabytes) when the model cannot be served or would not fit the
memory budget — before the weights are downloaded. Bytes go to a hidden `.<name>.part` file next to
the target, so an interrupted pull (a cut connection is retried at once, a stopped one by the next
pull of the same source) resumes where it stopped with an HTTP Range request. A sha256 mismatch
deletes the part: nothing is left behind. The file appears under its name only when complete and
checked, so the catalog never sees half a model.
"""

from __future__ import annotations

import hashlib
import http.client
import itertools
import logging
import os
import queue
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import httpx

from app.gguf_meta import GgufError, GgufMetadata, read_metadata_prefix

log = logging.getLogger(__name__)

CHUNK_BYTES = 1024 * 1024
MAX_RETRIES = 5
RETRY_PAUSE_S = 0.5
CONNECT_TIMEOUT_S = 15.0
READ_TIMEOUT_S = 60.0
# The header of a big-vocabulary model is a few MiB; past this a file is not a GGUF worth waiting for.
MAX_HEADER_BYTES = 64 * 1024 * 1024
HEADER_FIRST_TRY_BYTES = 256 * 1024
MAX_REDIRECTS = 5
WRITE_QUEUE_CHUNKS = 64
PROGRESS_EVERY_S = 0.2
# Kept free on the models folder's disk beyond the file itself, for the store and the system.
DISK_RESERVE_BYTES = 256 * 1024 * 1024
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_HF_PREFIXES = ("hf.co/", "huggingface.co/", "https://huggingface.co/", "https://hf.co/", "hf://")
PULL_STATES = ("resolving", "downloading", "verifying", "done", "failed", "refused")


class PullError(Exception):
    """A pull that cannot go on; `refused` when it was stopped by a check rather than a failure."""

    def __init__(self, message: str, refused: bool = False):
        super().__init__(message)
        self.refused = refused


@dataclass(frozen=True)
class Source:
    """Where a model file comes from, as resolved before downloading."""

    spec: str
    url: str
    filename: str
    size_bytes: int | None = None
    sha256: str | None = None


@dataclass
class Pull:
    """One pull's progress, read by the dashboard, the CLI and /api/pull."""

    spec: str
    id: int = 0
    state: str = "resolving"
    filename: str | None = None
    total_bytes: int | None = None
    done_bytes: int = 0
    resumed_from: int = 0
    sha256: str | None = None
    error: str | None = None
    path: Path | None = None
    started_s: float = field(default_factory=time.monotonic)
    finished_s: float | None = None

    @property
    def active(self) -> bool:
        """Still resolving, downloading or verifying."""
        return self.state in ("resolving", "downloading", "verifying")

    @property
    def percent(self) -> int:
        """How far the download is, 0–100."""
        return int(100 * self.done_bytes / self.total_bytes) if self.total_bytes else 0


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
        raise PullError(f"{repo} has no GGUF file" + (f" of quantisation '{tag}'" if tag else ""))
    raise PullError(f"{repo} has {len(ggufs)} GGUF files for {what}: name one ({', '.join(sorted(ggufs)[:8])})")


def resolve(spec: str, endpoint: str | None = None, client: httpx.Client | None = None) -> Source:
    """Where `spec` is and what it should be (size, sha256), without downloading it."""
    spec = spec.strip()
    if not spec:
        raise PullError("no source given: a Hugging Face repo (hf.co/owner/repo:Q4_K_M), a file (owner/repo/file.gguf) "
                        "or an http(s) URL")
    hf = _hf_parts(spec)
    if hf is None and spec.startswith(("http://", "https://")):
        url, _, fragment = spec.partition("#")
        sha = fragment.removeprefix("sha256=").lower() if fragment.startswith("sha256=") else None
        name = unquote(Path(urlsplit(url).path).name)
        size = None
        if client is not None:
            try:
                head = client.head(url, follow_redirects=True)
                if head.status_code < 400 and head.headers.get("content-length"):
                    size = int(head.headers["content-length"])
            except httpx.HTTPError:
                pass  # a server without HEAD: the GET tells
        return Source(spec, url, _gguf_name(name), size, sha)
    if hf is None:
        raise PullError(f"cannot pull {spec!r}: Hearth pulls from Hugging Face (hf.co/owner/repo:Q4_K_M or "
                        "owner/repo/file.gguf) or an http(s) URL to a .gguf; the Ollama registry is not supported")
    repo, file, tag = hf
    from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError

    try:
        if file is None:
            file = _pick_quant(HfApi(endpoint=endpoint).list_repo_files(repo), tag, repo)
        url = hf_hub_url(repo, file, endpoint=endpoint)
        meta = get_hf_file_metadata(url, endpoint=endpoint)
    except HfHubHTTPError as exc:
        raise PullError(f"Hugging Face ({endpoint or 'default endpoint'}) refused {repo}/{file or ''}: {exc}")
    except (httpx.HTTPError, OSError) as exc:
        raise PullError(f"cannot reach Hugging Face ({endpoint or 'default endpoint'}): {exc}")
    etag = (meta.etag or "").lower()
    return Source(spec, meta.location or url, _gguf_name(Path(file).name), meta.size,
                  etag if _SHA256.match(etag) else None)


def _gguf_name(name: str) -> str:
    if not name.lower().endswith(".gguf"):
        raise PullError(f"{name!r} is not a .gguf file: Hearth serves GGUF models only")
    if "/" in name or name.startswith("."):
        raise PullError(f"{name!r} is not a plain file name")
    return name


def part_path(target: Path) -> Path:
    """Where a pull of `target` keeps its bytes until they are complete and checked."""
    return target.with_name(f".{target.name}.part")


def pull(source: Source, models_dir: Path, check_header: Callable[[GgufMetadata], str | None] = lambda m: None,
         progress: Callable[[Pull], None] = lambda p: None, state: Pull | None = None,
         disk_free: Callable[[Path], int] | None = None,
         max_retries: int = MAX_RETRIES, on_landed: Callable[[Path], None] = lambda path: None) -> Path:
    """Download `source` into `models_dir` (resuming a part left by an earlier pull); its path.
    `on_landed` runs once the file has its name and before the pull reads as done (a rescan)."""
    p = state or Pull(source.spec)
    p.filename, p.total_bytes, p.sha256 = source.filename, source.size_bytes, source.sha256
    target = models_dir / source.filename
    part = part_path(target)
    try:
        if target.exists():
            raise PullError(f"{target.name} is already in the models folder; delete it first to pull it again",
                            refused=True)
        have = part.stat().st_size if part.exists() else 0
        if source.size_bytes is not None:
            free = (disk_free or _disk_free)(models_dir)
            need = source.size_bytes - have
            if need + DISK_RESERVE_BYTES > free:
                raise PullError(f"not enough disk for {source.filename}: it needs {_gib(need)} more and "
                                f"{_gib(free)} are free on the models folder's disk (keeping {_gib(DISK_RESERVE_BYTES)})",
                                refused=True)
        digest = _hash_of(part)
        p.state, p.done_bytes, p.resumed_from = "downloading", have, have
        progress(p)
        header_checked = False
        retries = 0
        while True:
            if p.done_bytes and not part.exists():  # the server ignored a Range request: started over
                digest, p.done_bytes, header_checked = hashlib.sha256(), 0, False
            try:
                header_checked = _download(source, part, digest, p, progress, check_header, header_checked)
                break
            except _Cut as exc:
                retries += 1
                if retries > max_retries:
                    raise PullError(f"the download of {source.filename} kept failing ({exc}); pull it again to resume "
                                    f"from {_gib(part.stat().st_size if part.exists() else 0)}")
                log.warning("pull %s: %s; resuming at %d bytes (retry %d)", source.filename, exc, p.done_bytes, retries)
                time.sleep(RETRY_PAUSE_S)
        p.state = "verifying"
        progress(p)
        actual = digest.hexdigest()
        if source.sha256 and actual != source.sha256:
            part.unlink(missing_ok=True)
            raise PullError(f"sha256 mismatch for {source.filename}: expected {source.sha256}, got {actual}; "
                            "the download was deleted")
        if not header_checked:
            with open(part, "rb") as f:
                _check(read_metadata_prefix(f.read(MAX_HEADER_BYTES), part.stat().st_size, source.filename), check_header)
        p.sha256 = actual
        os.replace(part, target)
        on_landed(target)
        p.state, p.path, p.finished_s = "done", target, time.monotonic()
        progress(p)
        return target
    except PullError as exc:
        if exc.refused and "already in the models folder" not in str(exc):
            part.unlink(missing_ok=True)  # refused: nothing is left behind
        p.state, p.error, p.finished_s = ("refused" if exc.refused else "failed"), str(exc), time.monotonic()
        progress(p)
        raise


def _hash_of(part: Path):
    """A sha256 over what an earlier pull left in `part`, to go on with."""
    digest = hashlib.sha256()
    if part.exists():
        with open(part, "rb") as f:
            while block := f.read(CHUNK_BYTES * 8):
                digest.update(block)
    return digest


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
                   budget_bytes: int) -> str | None:
    """Why a model known by its header cannot be served, or would not fit the memory budget with these
    runner settings (None: sized as app.residency.estimate.size_runner would); None when it can be served and fits."""
    from app.residency.estimate import estimate_memory, size_runner

    entry = header_entry(metadata, metadata.path)
    if not entry.usable:
        return f"{entry.name} cannot be served: {entry.unusable_reason}"
    if n_ctx is None or parallel is None:
        sized = size_runner(entry, budget_bytes, n_batch, parallel=parallel, n_ctx=n_ctx)
        n_ctx, parallel = sized.n_ctx, sized.parallel
    need = estimate_memory(entry, n_ctx, parallel, n_batch).total_bytes
    if need > budget_bytes:
        return (f"{entry.name} would need {_gib(need)} resident (ctx {n_ctx} × {parallel} slots) and the memory budget "
                f"is {_gib(budget_bytes)}: pull a smaller quantisation or raise memory_limit_mb")
    return None


class _Cut(Exception):
    """The connection broke mid-download: resumable."""


def _check(metadata: GgufMetadata, check_header: Callable[[GgufMetadata], str | None]) -> None:
    reason = check_header(metadata)
    if reason:
        raise PullError(reason, refused=True)


def _open(url: str, headers: dict[str, str]) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A GET on `url`, following redirects (a hub's CDN), with the response's headers read."""
    for _ in range(MAX_REDIRECTS):
        parts = urlsplit(url)
        conn_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = conn_class(parts.hostname, parts.port, timeout=READ_TIMEOUT_S)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", target or "/", headers={"User-Agent": "hearth-library", "Accept-Encoding": "identity",
                                                    **headers})
        resp = conn.getresponse()
        if resp.status in (301, 302, 303, 307, 308) and resp.getheader("Location"):
            resp.read()
            conn.close()
            url = urljoin(url, resp.getheader("Location"))
            continue
        return conn, resp
    raise PullError(f"more than {MAX_REDIRECTS} redirects from {url}")


def _download(source: Source, part: Path, digest, p: Pull, progress, check_header, header_checked: bool) -> bool:
    """Append the rest of the file to `part`; True once the header was checked."""
    # The standard library's reader, not httpx's: on loopback it read 400-740 MB/s against
    # httpx's 130 (measured here), and curl's speed is the target. Writing and hashing run on a
    # second thread (both release the GIL), so reading never waits for them.
    have = part.stat().st_size if part.exists() else 0
    if p.total_bytes is not None and have >= p.total_bytes:
        return header_checked
    header = bytearray()
    if have and not header_checked:
        with open(part, "rb") as f:
            header += f.read(MAX_HEADER_BYTES)
    try:
        conn, resp = _open(source.url, {"Range": f"bytes={have}-"} if have else {})
    except (OSError, http.client.HTTPException) as exc:
        raise _Cut(f"{type(exc).__name__}: {exc}")
    chunks: queue.Queue = queue.Queue(maxsize=WRITE_QUEUE_CHUNKS)
    failed: list[BaseException] = []

    def write() -> None:
        with open(part, "ab") as out:
            for chunk in iter(chunks.get, None):
                if failed:
                    continue
                try:
                    out.write(chunk)
                    digest.update(chunk)
                except OSError as exc:  # a full disk after all: stop, keep what was written
                    failed.append(exc)

    writer = threading.Thread(target=write, name="pull-writer", daemon=True)
    try:
        if resp.status == 416 and have:
            return header_checked
        if resp.status >= 400:
            raise PullError(f"{source.url} answered HTTP {resp.status}")
        if have and resp.status != 206:
            part.unlink(missing_ok=True)
            raise _Cut(f"the server ignored the Range request (HTTP {resp.status}): starting over")
        if p.total_bytes is None and resp.getheader("Content-Length"):
            p.total_bytes = have + int(resp.getheader("Content-Length"))
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
        raise PullError(f"writing {part} failed: {failed[0]}")
    if p.total_bytes is not None and p.done_bytes < p.total_bytes:
        raise _Cut(f"the connection closed at {p.done_bytes} of {p.total_bytes} bytes")
    return header_checked


def _try_header(header: bytearray, p: Pull, check_header) -> bool:
    """Check the header once enough bytes arrived; False while more are needed."""
    try:
        metadata = read_metadata_prefix(bytes(header), p.total_bytes or len(header), p.filename or "")
    except GgufError as exc:
        if "truncated" in str(exc) and len(header) < MAX_HEADER_BYTES:
            return False
        raise PullError(f"{p.filename} is not a GGUF Hearth can serve: {exc}", refused=True)
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
                 disk_free: Callable[[Path], int] | None = None):
        self.models_dir = models_dir
        self._check_header = check_header
        self._on_done = on_done
        self._endpoint = endpoint
        self._disk_free = disk_free
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pulls: dict[int, Pull] = {}

    def start(self, spec: str) -> Pull:
        """Start pulling `spec` (or return the pull of it already running)."""
        with self._lock:
            for p in self._pulls.values():
                if p.spec == spec and p.active:
                    return p
            p = Pull(spec, id=next(self._ids))
            self._pulls[p.id] = p
        threading.Thread(target=self._run, args=(p,), name=f"pull-{p.id}", daemon=True).start()
        return p

    def _run(self, p: Pull) -> None:
        try:
            with httpx.Client(timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
                              follow_redirects=True) as client:
                source = resolve(p.spec, self._endpoint(), client)
                # Done only once the catalog lists it: a client told "success" may use the model at once.
                pull(source, self.models_dir, self._check_header, state=p, disk_free=self._disk_free,
                     on_landed=self._on_done)
        except PullError as exc:
            if p.active:
                p.state, p.error, p.finished_s = ("refused" if exc.refused else "failed"), str(exc), time.monotonic()
            log.warning("pull %s %s: %s", p.spec, p.state, exc)
        except Exception as exc:  # a pull thread must record why it ended, whatever happened
            log.exception("pull %s failed", p.spec)
            p.state, p.error, p.finished_s = "failed", f"{type(exc).__name__}: {exc}", time.monotonic()

    def get(self, pull_id: int) -> Pull | None:
        """One pull by id."""
        return self._pulls.get(pull_id)

    def pulls(self) -> list[Pull]:
        """Every pull of this process, newest first."""
        return sorted(self._pulls.values(), key=lambda p: -p.id)
