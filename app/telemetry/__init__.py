"""Telemetry and the store: SQLite tables (models), connections and migrations (db), the
single-threaded batching writer (writer) and default rows (seed)."""
