"""The SQLite database: where it lives, how connections are set up, and its Alembic migrations.

Migrations live in the repository's top-level `migrations/` folder. They are found, in order, at
`$HEARTH_MIGRATIONS_DIR`, next to the source tree (a checkout or an editable install), or at
`<sys.prefix>/share/hearth/migrations` (where a non-editable install or the container image puts a
copy of the folder).
"""

from __future__ import annotations

import fcntl
import functools
import os
import sys
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session, sessionmaker

from app.paths import DATABASE_NAME, PRIVATE_FILE_MODE, private_dir, private_file
from app.store.seed import seed_defaults

# Held (flock) by every process serving the store, taken exclusively by `hearth restore`.
LOCK_NAME = f"{DATABASE_NAME}.lock"
DEFAULT_BUSY_TIMEOUT_MS = 5000
# Execution option naming the BEGIN statement a connection's transactions start with.
BEGIN_OPTION = "hearth_sqlite_begin"


def database_path(data_dir: Path) -> Path:
    """Where the store lives inside Hearth's data folder."""
    return Path(data_dir) / DATABASE_NAME


def create_private(path: Path) -> None:
    """Create the database file owner-only (0600) before SQLite does, or make an existing one so.

    SQLite gives its -wal and -shm files the database file's mode, so they follow: the request log and the
    tokens' hashes are never readable by another local user. An existing file is changed by its path and never
    opened: SQLite's locks are POSIX locks, which belong to the process, and closing any descriptor of the file
    releases every lock this process's connections hold on it (serve opens an engine beside its writer's, and a
    closed descriptor here let their transactions overlap: a serve's request log and residency events were lost).
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
    except FileExistsError:
        private_file(path)
        return
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)
    except PermissionError:
        pass  # another user's folder this one may write (an ACL): serve's start check says so
    finally:
        os.close(fd)


def make_engine(path: Path, *, busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS, echo: bool = False) -> Engine:
    """An engine on the SQLite file at `path`: WAL, foreign keys on, busy timeout, synchronous=NORMAL."""
    path = Path(path)
    private_dir(path.parent)
    create_private(path)
    engine = create_engine(URL.create("sqlite", database=str(path)), echo=echo)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):
        # Take BEGIN away from the sqlite3 module (it skips it before SELECT and DDL) and emit it
        # ourselves below: transactions then really are transactions, migrations included.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            # busy_timeout first: switching a new file to WAL needs the lock another connection may hold.
            cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            # Safe with WAL (a power cut may lose the last commits, never corrupt the file) and
            # saves an fsync per commit.
            cursor.execute("PRAGMA synchronous=NORMAL")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection):
        connection.exec_driver_sql(connection.get_execution_options().get(BEGIN_OPTION, "BEGIN"))

    return engine


def immediate(engine: Engine) -> Engine:
    """The same engine (same pool) whose transactions start with BEGIN IMMEDIATE, for writers."""
    # Taking the write lock up front means waiting in the busy handler instead of failing at once
    # when a transaction that has read an older snapshot tries to write (SQLITE_BUSY_SNAPSHOT).
    return engine.execution_options(**{BEGIN_OPTION: "BEGIN IMMEDIATE"})


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions bound to `engine`; objects stay readable after commit."""
    return sessionmaker(engine, expire_on_commit=False)


def migrations_dir() -> Path:
    """The Alembic script folder (see the module docstring for where it is looked for)."""
    candidates = []
    if os.environ.get("HEARTH_MIGRATIONS_DIR"):
        candidates.append(Path(os.environ["HEARTH_MIGRATIONS_DIR"]))
    candidates.append(Path(__file__).resolve().parents[2] / "migrations")
    candidates.append(Path(sys.prefix) / "share" / "hearth" / "migrations")
    for candidate in candidates:
        if (candidate / "env.py").is_file():
            return candidate
    raise FileNotFoundError(
        "Alembic migrations not found; looked in " + ", ".join(str(c) for c in candidates)
        + " (set HEARTH_MIGRATIONS_DIR to the repository's migrations/ folder)"
    )


def alembic_config(engine: Engine | None = None) -> Config:
    """An Alembic Config built in code; with `engine`, migrations run on it."""
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    if engine is not None:
        # Handed to env.py as an object: a URL would lose the engine's connection setup.
        config.attributes["engine"] = engine
    return config


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Apply the migrations up to `revision` (default: the newest)."""
    command.upgrade(alembic_config(engine), revision)


def downgrade(engine: Engine, revision: str) -> None:
    """Undo migrations down to `revision`."""
    command.downgrade(alembic_config(engine), revision)


@functools.cache  # the scripts do not change while a process runs; reading them costs ~10 ms
def head_revision() -> str:
    """The newest revision among the migration scripts."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise RuntimeError("no migration scripts found")
    return head


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at; None for an empty database."""
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def writing_sessions(engine: Engine) -> sessionmaker[Session]:
    """Sessions whose transactions take the write lock when they begin (BEGIN IMMEDIATE).

    For work that reads, then writes, beside another writer (serve's store writer, a `hearth token create` while
    serve runs): a plain transaction reads a snapshot, and if another connection commits before it writes, SQLite
    refuses the write at once ("database is locked", SQLITE_BUSY_SNAPSHOT) without waiting in the busy handler.
    Keep these sessions short and open no other session inside one: while one is open, other writers wait (a
    writing session opened inside it, on another connection, would wait for it until the busy timeout).
    """
    return session_factory(immediate(engine))


def open_store(data_dir: Path) -> tuple[Engine, sessionmaker]:
    """The data folder's database, migrated to head and seeded with the default classes.

    Its sessions are plain ones, for reading (one may be opened inside another); a unit of work that reads and then
    writes beside a running serve takes `writing_sessions(engine)`.
    """
    private_dir(data_dir)
    engine = make_engine(database_path(data_dir))
    if current_revision(engine) != head_revision():
        upgrade(engine)
    sessions = session_factory(engine)
    with sessions() as session:
        seed_defaults(session)
        session.commit()
    return engine, sessions


class StoreInUse(RuntimeError):
    """The store is held by a serving process, so it cannot be replaced now."""


def lock_path(data_dir: Path) -> Path:
    """The file whose flock says a `hearth serve` is using the data folder's store."""
    return Path(data_dir) / LOCK_NAME


def hold_store(data_dir: Path):
    """Take the serving lock (shared, waits for a restore in progress) and return its open file.

    Keep the file open for as long as the store is served; closing it, or the process ending in
    any way (a crash included), releases the lock: a stale lock never blocks a restore.
    """
    data_dir = private_dir(data_dir)
    create_private(lock_path(data_dir))
    holder = open(lock_path(data_dir), "a+")
    fcntl.flock(holder.fileno(), fcntl.LOCK_SH)
    # For the refusal message only: the last process that took the lock.
    holder.seek(0)
    holder.truncate()
    holder.write(f"{os.getpid()}\n")
    holder.flush()
    return holder


def hold_store_exclusively(data_dir: Path):
    """The serving lock taken exclusively without waiting; raises StoreInUse while a serve holds it."""
    data_dir = private_dir(data_dir)
    create_private(lock_path(data_dir))
    holder = open(lock_path(data_dir), "a+")
    try:
        fcntl.flock(holder.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder.seek(0)
        pid = holder.read().strip()
        holder.close()
        raise StoreInUse(f"hearth serve{f' (pid {pid})' if pid.isdigit() else ''} is using the store in {data_dir}")
    return holder
