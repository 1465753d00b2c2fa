"""Alembic environment: runs Hearth's migrations on an SQLite engine.

`app.store.db.upgrade` passes its engine in `config.attributes["engine"]`. From the `alembic`
command line (`alembic -c migrations/alembic.ini ...`) the database is `sqlalchemy.url` when set,
else `hearth.db` in `$HEARTH_DATA` (default ~/.local/share/hearth).
"""

import os
from pathlib import Path

from alembic import context
from sqlalchemy.engine import make_url

from app.store.db import database_path, make_engine
from app.store.models import Base

config = context.config
target_metadata = Base.metadata


def _engine():
    engine = config.attributes.get("engine")
    if engine is not None:
        return engine
    url = config.get_main_option("sqlalchemy.url")
    if url:
        # Through make_engine even then: the BEGIN handling is what makes the DDL transactional.
        return make_engine(Path(make_url(url).database))
    data_dir = Path(os.environ.get("HEARTH_DATA") or Path.home() / ".local" / "share" / "hearth")
    return make_engine(database_path(data_dir))


def _set_foreign_keys(connection, enabled: bool) -> None:
    # SQLite ignores this pragma inside a transaction, so it goes straight to the driver before
    # BEGIN / after COMMIT. Off during migrations: batch mode rebuilds a table by copy, drop and
    # rename, and dropping a referenced table would otherwise cascade or fail.
    connection.connection.driver_connection.execute(f"PRAGMA foreign_keys={'ON' if enabled else 'OFF'}")


def run_migrations_offline() -> None:
    """Write the SQL to stdout instead of running it (`alembic upgrade --sql`)."""
    context.configure(
        url=config.get_main_option("sqlalchemy.url") or "sqlite://",
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Run every pending migration in one transaction, with foreign keys checked at the end."""
    with _engine().connect() as connection:
        _set_foreign_keys(connection, False)
        try:
            context.configure(
                connection=connection,
                target_metadata=target_metadata,
                render_as_batch=True,
                compare_type=True,
                # SQLite does have transactional DDL once BEGIN is ours (see make_engine): an
                # upgrade that fails halfway leaves the database as it was.
                transactional_ddl=True,
            )
            with context.begin_transaction():
                context.run_migrations()
                violations = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                if violations:
                    raise RuntimeError(f"migration left foreign key violations: {violations[:10]}")
        finally:
            _set_foreign_keys(connection, True)


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
