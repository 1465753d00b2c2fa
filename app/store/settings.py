"""Settings stored in the database: a registry of (name, default, help) with each entry's kind, bounds,
unit, section and whether a restart applies it; one `validate` that the CLI and the dashboard share.

Bounds are what serve and its runners can run with, not taste: a runner needs a few hundred KV
cells for a chat template and a short answer, at least one sequence slot, and a batch of at least
one token per slot (the engine's token budget is n_batch, and every running sequence decodes one
token per iteration). A stored value that breaks them anyway (written before the bounds existed)
is read as the default, with a warning, so `hearth serve` still starts.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import re
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.residency.runner_spec import runner_args_problem
from app.store.models import Model, RequestClass, Setting, utcnow

log = logging.getLogger(__name__)

Kind = Literal["int", "float", "bool", "str", "path", "choice"]
SECTIONS = ("Memory", "Models and runners", "Gateway", "Telemetry", "Network and access", "Bench verdict")
# What a boolean may be typed as on the command line (the dashboard's checkbox sends "on").
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):(\d{1,5})$")


class Invalid(ValueError):
    """A value a setting cannot take; the message names the setting and the bound it broke."""


class UnknownSetting(KeyError):
    """A setting name that is not in the registry."""


def _number(x: float) -> str:
    """A bound as the admin types it: 1048576, 0.5 (not 1.04858e+06)."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


_ORIGIN = re.compile(r"^https?://[A-Za-z0-9.\-]+(:[0-9]{1,5})?$|^https?://\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?$")


def cors_origins(value: str | None) -> tuple[str, ...]:
    """The origins of an api_cors_origins value, as browsers send them (lower case, no trailing slash)."""
    return tuple(o.strip().rstrip("/").lower() for o in (value or "").split(",") if o.strip())


def _origins(value: str) -> str | None:
    """The problem with an api_cors_origins value, or None."""
    for origin in cors_origins(value):
        if origin != "*" and not _ORIGIN.match(origin):
            return (f"'{origin}' is not an origin: write scheme://host[:port] (e.g. http://192.168.1.20:3000), "
                    "comma-separated, or * for any")
    return None


def _host_port(value: str) -> str | None:
    """The problem with a host:port, or None."""
    match = _HOST_PORT.match(value)
    if match and 1 <= int(match.group(2)) <= 65535:
        return None
    return "must be host:port, e.g. 0.0.0.0:8080 for the whole LAN or 127.0.0.1:8080 for this machine only"


# A host name as allowed_hosts lists it: letters, digits, dots and dashes, optionally "*." for every name below one.
_HOST_NAME = re.compile(r"^(\*\.)?[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$")


def host_names(value: str | None) -> tuple[str, ...]:
    """The names of an allowed_hosts value (lower case, no trailing dot)."""
    return tuple(n.strip().lower().rstrip(".") for n in (value or "").split(",") if n.strip())


def _wyoming_member(value: str) -> str | None:
    """A member name Wyoming can count as: a name, not a path of people ('/') or control characters."""
    text = str(value or "")
    if not text.strip() or len(text) > 128 or "/" in text or any(ord(c) < 32 for c in text):
        return "a member name of 1 to 128 characters, without '/'"
    return None


def _wyoming_allow(value: str) -> str | None:
    for entry in (e.strip() for e in (value or "").split(",")):
        if not entry:
            continue
        try:
            ipaddress.ip_network(entry, strict=False)
        except ValueError:
            return f"{entry!r} is no IP address or network (e.g. 192.168.1.20 or 192.168.1.0/24)"
    return None


def _allowed_hosts(value: str) -> str | None:
    """The problem with an allowed_hosts value, or None."""
    for name in host_names(value):
        if name != "*" and not _HOST_NAME.match(name):
            return (f"'{name}' is not a host name: write names such as nas.example.org or *.home.arpa (no scheme, "
                    "no port), comma-separated, or * for any")
    return None


def _pull_hosts(value: str) -> str | None:
    """The problem with a pull_allowed_hosts value, or None."""
    from app.residency.fetch import allowed_hosts_problem

    return allowed_hosts_problem(value)


@dataclass(frozen=True)
class SettingDef:
    """One setting: its name, default and what it does, and the rules a value must keep."""

    name: str
    default: Any  # None: worked out at run time (the help says how)
    help: str
    kind: Kind
    section: str
    label: str  # what the dashboard calls it
    unit: str = ""
    minimum: float | None = None
    maximum: float | None = None
    # A "choice" whose options exist only at run time (models, classes) gets them from the caller.
    choices: tuple[str, ...] = ()
    restart: bool = False  # read once when hearth serve starts
    env: str | None = None  # an environment variable that wins over the stored value
    check: Callable[[str], str | None] | None = None  # a "str" value's extra rule: the problem, or None
    special: str = ""  # what the values at the bounds' edge mean ("-1: no limit, 0: off"), said with a refusal

    def bounds(self) -> str:
        """The allowed range in words ("256 to 1048576 cells"), or "" when there is none."""
        unit = f" {self.unit}" if self.unit else ""
        if self.minimum is not None and self.maximum is not None:
            return f"{_number(self.minimum)} to {_number(self.maximum)}{unit}"
        if self.minimum is not None:
            return f"at least {_number(self.minimum)}{unit}"
        if self.maximum is not None:
            return f"at most {_number(self.maximum)}{unit}"
        return ""


MIB_MAX = 16 * 1024 * 1024  # 16 TiB in MiB: larger is a typo
REGISTRY = {
    s.name: s
    for s in [
        SettingDef("default_model", None, "model used when a request and its class name none (default: the embedded model)",
                   "choice", "Models and runners", "Default model"),
        SettingDef("memory_limit_mb", None, "memory resident models may use, in MiB (default: detected RAM/VRAM minus a reserve)",
                   "int", "Memory", "Memory budget", "MiB", 256, MIB_MAX),
        SettingDef("memory_reserve_mb", None, "memory kept free for everything else, in MiB (default: 10 %, at least 512)",
                   "int", "Memory", "Memory reserve", "MiB", 0, MIB_MAX),
        SettingDef("max_in_flight_total", 64, "requests the gateway relays at once, all classes together",
                   "int", "Gateway", "Requests in flight", "requests", 1, 100_000, restart=True),
        # Every wait a client can impose on serve has a deadline (app/serve.py's HearthWorker).
        SettingDef("header_timeout_s", 5.0, "a new connection must send its request headers within this time, or it is closed (half-open connections cannot pile up)",
                   "float", "Gateway", "Request header timeout", "s", 0.5, 120, restart=True),
        SettingDef("keepalive_s", 10.0, "an idle keep-alive connection waits this long for its next request, then is closed",
                   "float", "Gateway", "Idle keep-alive", "s", 1, 3600, restart=True),
        SettingDef("client_stall_s", 30.0, "a client that neither reads nor sends for this long is dropped; a stalled stream reader's request is cancelled (slot, model lease and runner sequence freed) and logged as client_stalled",
                   "float", "Gateway", "Stalled client timeout", "s", 1, 3600, restart=True),
        SettingDef("max_connections", 4096, "client connections hearth serve holds at once (each costs a descriptor and a greenlet, not a thread)",
                   "int", "Gateway", "Connections at once", "connections", 64, 100_000, restart=True),
        # ≥ 256: a chat template, a short prompt and its answer; 2^20 cells is beyond any GGUF's trained context.
        SettingDef("runner_ctx", None, "default KV cells per local runner, shared by its slots (default: sized "
                   "from the memory budget and the model, shown on the Models page)",
                   "int", "Models and runners", "KV cells per runner", "cells", 256, 1 << 20),
        # ≤ 256: llama.cpp's own limit on sequences per context (LLAMA_MAX_SEQ).
        SettingDef("runner_parallel", None, "default sequence slots per local runner (default: sized from the "
                   "memory budget and the model, shown on the Models page)",
                   "int", "Models and runners", "Sequence slots per runner", "slots", 1, 256),
        SettingDef("runner_batch", 512, "default n_batch per local runner (at least runner_parallel: one token per slot)",
                   "int", "Models and runners", "Batch size (n_batch)", "tokens", 32, 65536),
        # Speech out (app.speech): Piper's process runs beside the LLM's runners on the same cores.
        SettingDef("tts_threads", None, "CPU threads of the text-to-speech process (Piper); default: half the cores, at "
                   "least one, so the LLM keeps the rest; taken when the process next starts",
                   "int", "Models and runners", "CPU threads for speech", "threads", 1, 1024),
        SettingDef("tts_keep_alive_s", 600, "how long the text-to-speech process keeps its voices after the last "
                   "sentence before it stops and gives their RAM back (a voice loads again in about a second)",
                   "int", "Models and runners", "Speech keep-alive", "s", 10, 86400),
        SettingDef("runner_threads", None, "CPU threads per local runner (default: all cores)",
                   "int", "Models and runners", "CPU threads per runner", "threads", 1, 1024),
        SettingDef("runner_args", None, "extra command-line arguments of a model's local runner (hearth runner or stock "
                   "llama-server), as JSON: model name to a list, e.g. {\"qwen3-8b\": [\"--reasoning-format\", \"none\"]}; "
                   "applies when the runner next starts; the flags serve sets itself are refused",
                   "str", "Models and runners", "Runner arguments per model", check=runner_args_problem),
        SettingDef("api_open_on_lan", False, "answer API requests without a token from private-network (LAN) addresses, as member 'lan' in class api_open_class; a presented token is still checked",
                   "bool", "Network and access", "Open API on the LAN"),
        SettingDef("api_cors_origins", None, "web pages (origins, comma-separated, e.g. http://192.168.1.20:3000; * for any) "
                   "whose browser code may call the API with a token (CORS); default: none. The admin's login cookie is never "
                   "accepted from them",
                   "str", "Network and access", "API origins for browser apps", check=_origins),
        SettingDef("api_open_class", "chat", "class of tokenless LAN requests when api_open_on_lan is on",
                   "choice", "Network and access", "Class of LAN requests"),
        # DNS rebinding: another site's name pointed at the NAS must not reach serve (app.gateway.lan).
        SettingDef("allowed_hosts", None, "host names hearth serve answers to besides its addresses, localhost and this "
                   "machine's own names (hostname, fully qualified name, <hostname>.local), comma-separated, e.g. "
                   "nas.example.org, *.home.arpa; * for any (not advised: a web page can then reach serve through a "
                   "name of its own); other names get 421",
                   "str", "Network and access", "Host names serve answers to", env="HEARTH_ALLOWED_HOSTS",
                   check=_allowed_hosts),
        # Home Assistant's speech-to-text (app.gateway.wyoming): Wyoming has no authentication of its own.
        SettingDef("wyoming_port", 0, "TCP port of the Wyoming speech-to-text server for Home Assistant (10300 is "
                   "Wyoming's usual port); 0: off",
                   "int", "Network and access", "Wyoming port", "", 0, 65535, restart=True, special="0: off"),
        SettingDef("wyoming_bind", "0.0.0.0", "address the Wyoming server listens on (0.0.0.0: every interface; the "
                   "allow list still decides who is answered)",
                   "str", "Network and access", "Wyoming address", restart=True),
        SettingDef("wyoming_allow", None, "Wyoming clients allowed (comma-separated IPs or networks, e.g. "
                   "192.168.1.20, 192.168.1.0/24); empty: the private ranges and loopback. Others get an error event",
                   "str", "Network and access", "Wyoming allow list", check=_wyoming_allow),
        SettingDef("wyoming_class", "voice", "class of Wyoming transcriptions",
                   "choice", "Network and access", "Class of Wyoming requests"),
        SettingDef("wyoming_member", "wyoming", "member Wyoming transcriptions count as (its limits, its request-log "
                   "rows and cached prompts, removed with it); created when Wyoming first uses it",
                   "str", "Network and access", "Member of Wyoming requests", check=_wyoming_member),
        SettingDef("wyoming_event_timeout_s", 30, "time a Wyoming client has to send each whole event (a client that "
                   "trickles bytes is closed when it runs out)",
                   "int", "Network and access", "Wyoming event deadline", "s", 1, 600),
        SettingDef("wyoming_utterance_timeout_s", 90, "time from a Wyoming client's audio-start to its audio-stop",
                   "int", "Network and access", "Wyoming utterance deadline", "s", 1, 3600),
        SettingDef("rescan_interval_s", 60, "how often the models folder is rescanned",
                   "int", "Models and runners", "Models folder rescan", "s", 1, 86400, restart=True),
        SettingDef("models_dir", None, "folder scanned for .gguf models (default: <data>/models; $HEARTH_MODELS_DIR wins)",
                   "path", "Models and runners", "Models folder", restart=True, env="HEARTH_MODELS_DIR"),
        SettingDef("bind", None, "host:port hearth serve listens on (default 127.0.0.1:8080; --bind and $HEARTH_BIND win)",
                   "str", "Network and access", "Bind address", restart=True, env="HEARTH_BIND", check=_host_port),
        SettingDef("status_public", False, "show the phone status page (/status) without the admin login",
                   "bool", "Network and access", "Public status page"),
        # Which models and classes are busy tells who is home: off the machine, /metrics wants a token by default.
        SettingDef("metrics_require_token", "off_machine", "when hearth serve's /metrics asks for an API token "
                   "(Authorization: Bearer): 'always', 'off_machine' (every client but this machine's own, e.g. a "
                   "Prometheus beside it) or 'never' (anyone who can reach the port)",
                   "choice", "Network and access", "Token for /metrics", choices=("always", "off_machine", "never")),
        SettingDef("proxy_hops", 0, "reverse proxies in front of hearth serve whose X-Forwarded-* headers are trusted (0: none)",
                   "int", "Network and access", "Trusted reverse proxies", "proxies", 0, 10, restart=True),
        SettingDef("verdict_min_gain", 1.3, "throughput gain of continuous over serial batching, at the household's typical overlap, that justifies continuous batching",
                   "float", "Bench verdict", "Gain that justifies batching", "×", 1, 100),
        SettingDef("verdict_rare_overlap_share", 0.1, "below this share of busy time with 2 or more requests active, requests 'rarely overlap' and residency comes first",
                   "float", "Bench verdict", "Rare-overlap share", "", 0, 1),
        SettingDef("size_targets_from_hardware", True, "once, when a new store's first model has measured its costs, raise the TPOT targets a full batch cannot keep (still at their shipped values) to the pace it can",
                   "bool", "Bench verdict", "Size targets from the hardware"),
        SettingDef("verdict_default_overlap", 4, "overlap level the verdict uses when the request log has no traffic yet",
                   "int", "Bench verdict", "Default overlap level", "requests", 1, 64),
        SettingDef("verdict_interactive_max_priority", 1, "classes with this priority or lower are interactive: their p95 TTFT must stay within target",
                   "int", "Bench verdict", "Interactive up to priority", "", 0, 100),
        SettingDef("verdict_flat_gain", 1.1, "throughput step between measured slot counts below which more parallel slots stop paying",
                   "float", "Bench verdict", "Flat gain step", "×", 1, 100),
        SettingDef("runner_core_yield", True, "while a local runner (or a voice being spoken) serves a request of a class that is not preemptible, the other local runners pause their work when all of it is of preemptible classes less urgent than it (documents, background by default), so the two do not share the CPU: a voice transcription beside a background summary on another model took 5-7 s instead of 0.5 s on a 2-core box",
                   "bool", "Models and runners", "Urgent requests get the CPU"),
        SettingDef("runner_prefix_cache", True, "local hearth runners reuse the KV cells of prompt prefixes shared across requests (a resent system prompt, a growing chat); applies when a runner starts",
                   "bool", "Models and runners", "Prefix cache", restart=True),
        SettingDef("runner_cache_ram_mib", 2048, "host RAM each local hearth runner may keep prefix-cache entries in after they leave the KV cache, so a prompt seen before is restored instead of prefilled (llama-server's --cache-ram: -1 no limit, 0 off); counted in the runner's memory estimate under a RAM budget; applies when a runner starts",
                   "int", "Models and runners", "KV kept in RAM per runner", "MiB", -1, 1_048_576,
                   special="-1: no limit, 0: off"),
        SettingDef("runner_cache_disk_mib", 4096, "disk space on the data volume each model's cached prefixes may take, so a stable system prompt survives model swaps and restarts (0 off, -1 no limit); applies when a runner starts",
                   "int", "Models and runners", "KV kept on disk per model", "MiB", -1, 1_048_576,
                   special="-1: no limit, 0: off"),
        SettingDef("runner_cache_disk_max_age_h", 72.0, "a prefix kept on disk that no request used for this long is deleted, by its runner and by serve's hourly check (a conversation's words do not lie on the data volume for good; a system prompt in daily use stays); 0 never",
                   "float", "Models and runners", "KV kept on disk at most", "h", 0, 8760, special="0: never"),
        SettingDef("model_swap_wait_s", 30.0, "a request for a model that does not fit beside the resident ones waits this long for the busy models in its way to finish their requests (then they are evicted), instead of being refused with 503 at once",
                   "float", "Models and runners", "Wait for a busy model to swap", "s", 0, 600),
        SettingDef("runner_image_url_fetch", False, "local hearth runners of vision models fetch the http(s) image URLs "
                   "a request names (default: off, images must come inside the request as base64, and serve refuses a "
                   "URL before any runner sees it); public hosts only, unless runner_image_url_hosts allows a LAN one "
                   "(a model on a stock llama-server or a remote node fetches URLs itself, without these checks); "
                   "applies when a runner starts",
                   "bool", "Network and access", "Fetch image URLs", restart=True),
        SettingDef("runner_image_url_hosts", None, "hosts an image URL may reach although they are on the LAN or this "
                   "machine, e.g. a camera: names, addresses or networks, comma-separated (default: none); applies when "
                   "a runner starts", "str", "Network and access", "Image URLs may reach these LAN hosts",
                   restart=True, check=_pull_hosts),
        SettingDef("hf_endpoint", None, "Hugging Face endpoint models are pulled from (a mirror's URL; default: $HF_ENDPOINT, else huggingface.co)",
                   "str", "Models and runners", "Hugging Face endpoint"),
        SettingDef("pull_allowed_hosts", None, "hosts a model pull may reach although they are on the LAN or this machine "
                   "(private, loopback, link-local addresses), e.g. a LAN mirror: names (mirror.lan), addresses (192.168.1.20) "
                   "or networks (192.168.1.0/24), comma-separated; default: none, pulls reach public hosts only (and the "
                   "Hugging Face endpoint set above)",
                   "str", "Network and access", "Pulls may reach these LAN hosts", check=_pull_hosts),
        SettingDef("api_manage_models", False, "let the API tokens given the manage permission (Members page, `hearth token set ID --manage`) pull, copy, delete, load and unload models through Ollama's /api/pull, /api/copy, /api/delete and keep_alive; other tokens and tokenless LAN clients never can (the dashboard and `hearth models pull` always can)",
                   "bool", "Network and access", "Manage tokens manage models"),
        # A member's own limits (Members page, `hearth token member NAME`) win over these defaults.
        SettingDef("member_class_share", 0.5, "share of each class's running places and queue one member may hold unless the member's own limits say otherwise (at least one place each), so one person or runaway script never takes a whole class",
                   "float", "Gateway", "One member's share of a class", "", 0.05, 1),
        SettingDef("member_max_requests_per_min", None, "requests a member may start per minute, all classes together, unless the member's own limit says otherwise (default: no limit)",
                   "int", "Gateway", "Requests per member per minute", "requests", 1, 1_000_000),
        SettingDef("member_max_tokens_per_min", None, "prompt and generated tokens a member may use per minute unless the member's own limit says otherwise (default: no limit)",
                   "int", "Gateway", "Tokens per member per minute", "tokens", 1, 1_000_000_000),
        SettingDef("member_max_tokens_per_day", None, "prompt and generated tokens a member may use per 24 hours unless the member's own limit says otherwise (default: no limit)",
                   "int", "Gateway", "Tokens per member per day", "tokens", 1, 1_000_000_000_000),
        SettingDef("verdict_burst_overlap", 8, "this many requests at once or more in the request log is a burst (a batch job, agent branches): named apart, left out of the typical overlap, and the verdict must hold at its peak",
                   "int", "Bench verdict", "Burst: requests at once", "requests", 2, 1024),
        SettingDef("requests_retention_days", 90, "days of the request log kept (one row per answered request; refusals are counted per minute instead); older rows are pruned hourly",
                   "int", "Telemetry", "Keep the request log", "days", 1, 3650),
        SettingDef("samples_retention_h", 48, "hours of 1-second telemetry samples kept; longer ranges read 1-minute rollups (kept 30 days) and hourly ones (365 days)",
                   "float", "Telemetry", "Keep 1-second samples", "h", 1, 24 * 365),
    ]
}


def definition(name: str) -> SettingDef:
    """The registry entry of `name`; UnknownSetting when there is none."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownSetting(name) from None


def _typed(d: SettingDef, raw: Any) -> Any:
    """`raw` (text from a form or a shell, or an already typed value) as the setting's kind."""
    text = raw.strip() if isinstance(raw, str) else raw
    if d.kind == "bool":
        if isinstance(text, bool):
            return text
        if isinstance(text, int) and text in (0, 1):  # JSON 1/0, as older `hearth settings set` stored them
            return bool(text)
        if isinstance(text, str) and text.lower() in TRUE_WORDS + FALSE_WORDS:
            return text.lower() in TRUE_WORDS
        raise Invalid(f"{d.name} must be true or false (got {raw})")
    if d.kind == "int":
        if isinstance(text, bool):
            raise Invalid(f"{d.name} must be a whole number (got {raw})")
        if isinstance(text, int):
            return text
        if isinstance(text, float) and text.is_integer():
            return int(text)
        try:
            return int(text)
        except (TypeError, ValueError):
            raise Invalid(f"{d.name} must be a whole number (got {raw})") from None
    if d.kind == "float":
        try:
            value = float(text) if isinstance(text, str | int | float) and not isinstance(text, bool) else math.nan
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise Invalid(f"{d.name} must be a number (got {raw})")
        return value
    if not isinstance(text, str):
        raise Invalid(f"{d.name} must be text (got {raw})")
    return text


def _within(d: SettingDef, value: Any, raw: Any) -> None:
    """Raise Invalid when a typed value breaks the setting's bounds or rules (no I/O, no run-time choices)."""
    if d.kind in ("int", "float"):
        meaning = f" ({d.special})" if d.special else ""
        if d.minimum is not None and value < d.minimum:
            raise Invalid(f"{d.name} must be at least {_number(d.minimum)}{meaning} (got {raw})")
        if d.maximum is not None and value > d.maximum:
            raise Invalid(f"{d.name} must be at most {_number(d.maximum)}{meaning} (got {raw})")
    if d.kind == "choice" and d.choices and value not in d.choices:
        raise Invalid(f"{d.name} must be one of {', '.join(d.choices)} (got {raw})")
    if d.kind == "path" and not Path(value).expanduser().is_absolute():
        raise Invalid(f"{d.name} must be an absolute path, e.g. /srv/models (got {raw})")
    if d.check is not None:
        problem = d.check(value)
        if problem:
            raise Invalid(f"{d.name} {problem} (got {raw})")


def validate(name: str, raw: Any, choices: Collection[str] | None = None) -> Any:
    """The value `raw` gives setting `name` (None: back to the default, for an empty text); Invalid names the bound.

    `raw` is text from `hearth settings set` or the Settings form, or a typed value. `choices` are the
    options of a "choice" setting known only at run time (the models, the classes); None leaves them
    unchecked. A path must name a folder on this machine.
    """
    d = definition(name)
    if raw is None or (isinstance(raw, str) and raw.strip() == ""):
        return None
    value = _typed(d, raw)
    _within(d, value, raw)
    if d.kind == "path":
        path = Path(value).expanduser()
        if not path.is_dir():
            raise Invalid(f"{name} must be a folder on this machine ({path} is not one)")
        value = str(path)
    if d.kind == "choice" and not d.choices and choices is not None and value not in choices:
        known = ", ".join(sorted(choices)) or "none yet"
        raise Invalid(f"{name} must be one of: {known} (got {raw})")
    return value


def conflicts(values: Mapping[str, Any]) -> dict[str, str]:
    """Rules between settings, on effective values (None = the default): {setting: what is wrong}."""
    def value(name: str) -> Any:
        v = values.get(name)
        return REGISTRY[name].default if v is None else v

    problems = {}
    batch, parallel = value("runner_batch"), value("runner_parallel")
    # Sized slots (None) never exceed the batch: app.residency.estimate.size_runner caps them.
    if parallel is not None and batch < parallel:
        # The engine's token budget is n_batch and each running sequence needs one token of it per iteration.
        problems["runner_batch"] = (f"runner_batch must be at least runner_parallel ({parallel}): every slot "
                                    f"decodes one token of each batch (got {batch})")
    return problems


def run_time_choices(session: Session, name: str) -> Collection[str] | None:
    """The options the store knows for a run-time "choice" setting (catalogued models, classes); None for others."""
    if name == "default_model":
        rows = session.execute(select(Model.name, Model.alias).where(Model.usable)).all()
        return {n for n, _ in rows} | {a for _, a in rows if a}
    if name in ("api_open_class", "wyoming_class"):
        return set(session.scalars(select(RequestClass.name)))
    return None


_warned_stored: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def get_setting(session: Session, name: str) -> Any:
    """The stored value, or the registry default (also for a stored value that breaks the setting's bounds)."""
    d = definition(name)
    row = session.get(Setting, name)
    if row is None or row.value is None:
        return d.default
    try:
        value = _typed(d, row.value)
        _within(d, value, row.value)
    except Invalid as problem:
        key = (name, repr(row.value))
        with _warned_lock:
            first = key not in _warned_stored
            _warned_stored.add(key)
        if first:
            log.warning("stored setting ignored, the default %r is used: %s; fix it with `hearth settings set %s …`",
                        d.default, problem, name)
        return d.default
    return value


def set_setting(session: Session, name: str, value: Any) -> None:
    """Store a value (None restores the default) after the registry's checks; the caller commits."""
    value = validate(name, value)
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
