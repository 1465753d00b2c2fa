"""Settings stored in the database: a registry of (name, default, help), editable by the admin."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from app.store.models import Setting, utcnow


@dataclass(frozen=True)
class SettingDef:
    """One setting: its name, default value and what it does."""

    name: str
    default: Any
    help: str


REGISTRY = {
    s.name: s
    for s in [
        SettingDef("default_model", None, "model used when a request and its class name none (default: the embedded model)"),
        SettingDef("memory_limit_mb", None, "memory resident models may use, in MiB (default: detected RAM/VRAM minus a reserve)"),
        SettingDef("memory_reserve_mb", None, "memory kept free for everything else, in MiB (default: 10 %, at least 512)"),
        SettingDef("max_in_flight_total", 64, "requests the gateway relays at once, all classes together"),
        SettingDef("runner_ctx", 4096, "default KV cells per local runner"),
        SettingDef("runner_parallel", 4, "default sequence slots per local runner"),
        SettingDef("runner_batch", 512, "default n_batch per local runner"),
        SettingDef("runner_threads", None, "CPU threads per local runner (default: all cores)"),
        SettingDef("runner_prefix_cache", True, "local hearth runners reuse the KV cells of prompt prefixes shared across requests (a resent system prompt, a growing chat); applies when a runner starts"),
        SettingDef("api_open_on_lan", False, "answer API requests without a token from private-network (LAN) addresses, as member 'lan' in class api_open_class; a presented token is still checked"),
        SettingDef("api_open_class", "chat", "class of tokenless LAN requests when api_open_on_lan is on"),
        SettingDef("rescan_interval_s", 60, "how often the models folder is rescanned"),
        SettingDef("models_dir", None, "folder scanned for .gguf models (default: <data>/models; $HEARTH_MODELS_DIR wins; restart to apply)"),
        SettingDef("bind", None, "host:port hearth serve listens on (default 127.0.0.1:8080; --bind and $HEARTH_BIND win; restart to apply)"),
        SettingDef("status_public", False, "show the phone status page (/status) without the admin login"),
        SettingDef("proxy_hops", 0, "reverse proxies in front of hearth serve whose X-Forwarded-* headers are trusted (0: none; restart to apply)"),
        SettingDef("verdict_min_gain", 1.3, "throughput gain of continuous over serial batching, at the household's typical overlap, that justifies continuous batching"),
        SettingDef("verdict_rare_overlap_share", 0.1, "below this share of busy time with 2 or more requests active, requests 'rarely overlap' and residency comes first"),
        SettingDef("verdict_default_overlap", 4, "overlap level the verdict uses when the request log has no traffic yet"),
        SettingDef("verdict_interactive_max_priority", 1, "classes with this priority or lower are interactive: their p95 TTFT must stay within target"),
        SettingDef("verdict_flat_gain", 1.1, "throughput step between overlap levels below which more parallel slots stop paying"),
        SettingDef("samples_retention_h", 48, "hours of 1-second telemetry samples kept; longer ranges read 1-minute rollups (kept 30 days) and hourly ones (365 days)"),
    ]
}


class UnknownSetting(KeyError):
    """A setting name that is not in the registry."""


def get_setting(session: Session, name: str) -> Any:
    """The stored value, or the registry default."""
    if name not in REGISTRY:
        raise UnknownSetting(name)
    row = session.get(Setting, name)
    return REGISTRY[name].default if row is None else row.value


def set_setting(session: Session, name: str, value: Any) -> None:
    """Store a value (None restores the default); the caller commits."""
    if name not in REGISTRY:
        raise UnknownSetting(name)
    row = session.get(Setting, name)
    if value is None:
        if row is not None:
            session.delete(row)
        return
    if row is None:
        session.add(Setting(key=name, value=value, updated_at=utcnow()))
    else:
        row.value = value
        row.updated_at = utcnow()


def all_settings(session: Session) -> dict[str, Any]:
    """Every registered setting with its current value."""
    return {name: get_setting(session, name) for name in REGISTRY}
