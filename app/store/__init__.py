"""The SQLite store: database and migrations wiring, tables, the single writer, backup, seed, settings."""
