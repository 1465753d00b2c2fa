"""Opening the store the way every entry point does: migrate to head, seed defaults."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine
from sqlalchemy.orm import sessionmaker

from app.telemetry.db import database_path, make_engine, session_factory, upgrade
from app.telemetry.seed import seed_defaults


def open_store(data_dir: Path) -> tuple[Engine, sessionmaker]:
    """The data folder's database, migrated to head and seeded with the default classes."""
    data_dir.mkdir(parents=True, exist_ok=True)
    engine = make_engine(database_path(data_dir))
    upgrade(engine)
    sessions = session_factory(engine)
    with sessions() as session:
        seed_defaults(session)
        session.commit()
    return engine, sessions
