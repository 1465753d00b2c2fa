"""Telemetry: samplers of runners and the host, rollups, Prometheus export, per-class analysis."""
