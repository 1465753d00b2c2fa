"""Plain helpers shared by the test packages (`from tests.helpers import …`); fixtures live in conftest.py files.

- `wait_until(predicate, timeout_s, message)`: poll a condition with a deadline instead of sleeping.
- `query(db_path, sql, *args)`: rows from a store as another process's reader sees them; `store_now()` to compare
  with its datetimes.
- `metric(client, sample)`: one sample of a Prometheus /metrics page.
- `store_points(session, source, metric, points)`: many seconds of one telemetry series in one insert.
- `write_standin_gguf(path)`: a tiny GGUF with the embedded model's header facts, for tests that read a catalog
  entry but never load weights.
- `ServeStarter`: real `hearth serve` processes on fresh data folders (behind the `start_serve` fixtures).
- `dashboard_app`, `csrf_token`, `setup_code`, `set_up_admin`: the dashboard app in-process and its first-run /setup
  (the setup code read from the data folder).
- `copy_migrated_store(data_dir)`: a store already migrated to head in a fresh data folder, copied instead of migrated.
"""

from __future__ import annotations

import atexit
import re
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import closing, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import gguf
import numpy as np
from gguf.constants import LlamaFileType

from app.devtools.serve_process import ServeProcess, prepare_data
from app.store.db import database_path, make_engine, upgrade

T = TypeVar("T")

POLL_S = 0.05


def wait_until(predicate: Callable[[], T], timeout_s: float = 10.0, message: str | Callable[[], str] = "condition",
               every_s: float = POLL_S) -> T:
    """Poll predicate() until it is truthy and return its value; fail the test (with message) after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            # A callable message is built only on failure (a log tail, the last state seen).
            text = message() if callable(message) else message
            raise AssertionError(f"not met within {timeout_s} s: {text}")
        time.sleep(every_s)


def query(db_path: Path, sql: str, *args: Any) -> list[tuple]:
    """Rows of one query on a SQLite file, through a connection of its own (sees only committed rows)."""
    # closing(): sqlite3's own context manager only ends the transaction, it leaves the connection open.
    with closing(sqlite3.connect(db_path)) as db:
        return db.execute(sql, args).fetchall()


def store_now() -> str:
    """The current UTC time as SQLAlchemy writes a datetime into SQLite, for raw SQL such as `arrival_at >= ?`."""
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")


def metric(client, sample: str) -> float | None:
    """The value of one sample (`name` or `name{labels}`) on client's /metrics, None when it is absent."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return None


def store_points(session, source: str, metric: str, points: Iterable[tuple[int, float]]) -> None:
    """Store finite (unix second, value) samples of one series in one insert (its series row made by store_readings)."""
    from sqlalchemy import insert, select

    from app.store.models import Sample, Series
    from app.telemetry.sampler import store_readings

    # Hours of 1-second samples through store_readings, one second per call, cost seconds of a fast test.
    (first_at, first_value), *rest = points
    store_readings(session, first_at, [(source, metric, first_value)])
    if rest:
        series_id = session.scalar(select(Series.id).where(Series.source == source, Series.metric == metric))
        session.execute(insert(Sample).prefix_with("OR REPLACE"),
                        [{"series_id": series_id, "at": at, "value": value} for at, value in rest])


# --- a store migrated once per process ------------------------------------------------------

_migrated: list[Path] = []


def _migrated_template() -> Path:
    """A store file migrated to head, made on first use in a folder of its own (removed when the process ends)."""
    if not _migrated:
        folder = Path(tempfile.mkdtemp(prefix="hearth-migrated-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        engine = make_engine(database_path(folder))
        upgrade(engine)
        engine.dispose()  # the last connection closed: the WAL is checkpointed into the file and removed
        _migrated.append(database_path(folder))
    return _migrated[0]


def copy_migrated_store(data_dir: Path) -> None:
    """Put a copy of a store migrated to head where data_dir's store would be created, unless one is there.

    Migrating an empty store runs 19 scripts (about 100 ms); hundreds of tests start on a fresh one, and the
    migrations themselves are checked in tests/store. Whoever opens the copy still runs upgrade (a no-op at head)
    and makes the file owner-only, as with a store it created.
    """
    target = database_path(data_dir)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_migrated_template(), target)


# --- a stand-in for the embedded model -------------------------------------------------------

STANDIN_NAME = "gemma-3-270m-q4_k_m"
# Gemma 3 270M's own header values (read from the embedded GGUF), so estimates and pages look as
# they do with the real file; only the vocabulary and the weights are tiny.
_GEMMA3_HEADER = {
    "context_length": 32768, "embedding_length": 640, "block_count": 18, "feed_forward_length": 2048,
    "head_count": 4, "head_count_kv": 1, "key_length": 256, "value_length": 256, "sliding_window": 512,
}


def write_standin_gguf(path: Path) -> Path:
    """Write a small, well-formed gemma3 GGUF that the catalog lists as usable; llama.cpp could not run it."""
    h = _GEMMA3_HEADER
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_name("Gemma 3 270m (stand-in)")
    writer.add_context_length(h["context_length"])
    writer.add_embedding_length(h["embedding_length"])
    writer.add_block_count(h["block_count"])
    writer.add_feed_forward_length(h["feed_forward_length"])
    writer.add_head_count(h["head_count"])
    writer.add_head_count_kv(h["head_count_kv"])
    writer.add_key_length(h["key_length"])
    writer.add_value_length(h["value_length"])
    writer.add_sliding_window(h["sliding_window"])
    writer.add_file_type(LlamaFileType.MOSTLY_Q4_K_M)
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "hello", "world"]
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --- real `hearth serve` processes ---------------------------------------------------------

# Runners small enough to start in seconds on two cores.
SMALL_RUNNERS = {"runner_ctx": 512, "runner_parallel": 2, "runner_threads": 2}
# A grown-up (chat, may also use voice) and a kid (voice only).
HOUSEHOLD = [("alice", "chat", ["voice"]), ("kid", "voice", [])]


class ServeStarter:
    """Starts real `hearth serve` processes on fresh data folders and stops every one it started.

    start(models=None, data=None, **prepare): `prepare` goes to prepare_data (classes, settings, tokens,
    policies; settings default to SMALL_RUNNERS, tokens to HOUSEHOLD); the serve's `.tokens` maps member → token.
    Its log lies beside its data folder, so a full data folder cannot silence it.
    """

    def __init__(self, new_folder: Callable[[str], Path], default_model: Path):
        self._new_folder = new_folder
        self._default_model = default_model
        self._started: list[ServeProcess] = []

    def __call__(self, models: Path | None = None, data: Path | None = None, **prepare: Any) -> ServeProcess:
        """Prepare a data folder and start a serve on it; returns it once /healthz answers."""
        data = data or self._new_folder("serve-data")
        models = models or self._new_folder("serve-models")
        # The tests pin the shipped class targets: sizing them from the measured costs (app/services/targets.py)
        # midway through a shared serve's session would change what later tests see.
        prepare["settings"] = {"size_targets_from_hardware": False, **prepare.get("settings", SMALL_RUNNERS)}
        prepare.setdefault("tokens", HOUSEHOLD)
        copy_migrated_store(data)
        tokens = prepare_data(data, **prepare)
        s = ServeProcess(data, models, self._default_model, data.with_name(f"{data.name}.log"))
        s.tokens = tokens
        self._started.append(s)
        return s

    def stop_all(self) -> None:
        """Stop every serve started here (one already stopped is left as it is)."""
        for s in self._started:
            s.stop()


# --- the dashboard in-process ---------------------------------------------------------------

ADMIN_PASSWORD = "correct horse battery"
# A form's hidden field, or the htmx header every page carries on <body>.
_CSRF = re.compile(r'name="csrf_token" value="([^"]+)"|"X-CSRFToken": "([^"]+)"')


@contextmanager
def dashboard_app(data_root: Path, default_model: Path, **config: Any) -> Iterator:
    """create_app on data_root/data and data_root/models, no scheduler, default_model as the embedded model."""
    from app.factory import create_app, shutdown_app

    copy_migrated_store(data_root / "data")
    app = create_app({"HEARTH_DATA": str(data_root / "data"), "HEARTH_MODELS_DIR": str(data_root / "models"),
                      "HEARTH_DEFAULT_MODEL": str(default_model), "SCHEDULER": False, "TESTING": True, **config})
    try:
        yield app
    finally:
        shutdown_app(app)


def csrf_token(client, path: str = "/login", **get_options: Any) -> str:
    """A CSRF token bound to this client's session, read from a page (redirects followed)."""
    page = client.get(path, follow_redirects=True, **get_options)
    match = _CSRF.search(page.get_data(as_text=True))
    assert match, f"no csrf_token on {path} ({page.status_code})"
    return match.group(1) or match.group(2)


def setup_code(data: Path) -> str:
    """The one-time code /setup asks for, read where serve keeps it (the data folder's secrets)."""
    return (data / "secrets" / "setup_code").read_text().strip()


def set_up_admin(client, password: str = ADMIN_PASSWORD):
    """First run: create the admin password through /setup with its setup code (this also logs the client in)."""
    from app.gateway.context import services

    token = csrf_token(client, "/setup")
    response = client.post("/setup", data={"password": password, "confirm": password, "csrf_token": token,
                                           "setup_code": setup_code(services(client.application).data_dir)})
    assert response.status_code == 302, response.get_data(as_text=True)
    return response


class Clock:
    """A clock the test moves by hand (for TTLs and windows)."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def house_system_prompt(repeats: int) -> str:
    """A voice assistant's stable system prompt listing a house's devices (20 per repeat): about 330 tokens a
    repeat on Gemma 3, for prefix-cache and KV-tier tests that need one longer than a sliding window."""
    devices = "".join(
        f"- {room} {kind} {i}: state {'on' if i % 3 else 'off'}, brightness {10 * (i % 10)} %\n"
        for i, (room, kind) in enumerate(
            [(r, k) for r in ("kitchen", "hall", "bedroom", "garage", "office") for k in ("light", "lamp", "plug", "fan")]
            * repeats
        )
    )
    return ("You are the voice assistant of a family home. Answer in one short sentence. "
            "These are the devices of the house and their state:\n" + devices)


def class_form(app, name: str, **changes) -> dict:
    """The Classes page's edit form for one class as stored now, with `changes` over it (what a browser posts)."""
    from app.admin import CLASS_FIELDS
    from app.gateway.context import services
    from app.store.models import RequestClass

    with services(app).sessions() as s:
        row = s.get(RequestClass, name)
        values = {f: str(getattr(row, f)) for f in CLASS_FIELDS}
        values.update({"default_model": row.default_model or "", "thinking": row.thinking})
    return {**values, **changes}


def gguf_fields(path) -> tuple[dict, dict]:
    """A GGUF's metadata (key → value) and its tensors' shapes (name → dims), as gguf's reader gives them."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items()}, {t.name: list(t.shape) for t in reader.tensors}


def run_coroutine(coro):
    """asyncio.run in a thread of its own: a session's Playwright (tests/browser keeps one open per worker) holds a
    running event loop in the main thread, where asyncio.run refuses to start another."""
    import asyncio
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
