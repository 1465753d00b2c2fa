"""Pulling a Piper voice: an http(s) URL to its `.onnx` (Piper's voice files on Hugging Face, a mirror); its
`.onnx.json` is taken from beside it (the same URL with `.json` added to the path).

The same rules as a model pull (app.residency.fetch.open_url): each hop's host checked against the public-only
policy and the admin's pull_allowed_hosts, at the address checked. The config comes first and is checked as a Piper
voice's (app.speech.voices); the weights are bounded, checked for an ONNX model's first byte, and land beside the
config only when whole, so the Models page never lists half a voice.
"""

from __future__ import annotations

import http.client
import os
import re
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from app.residency.fetch import HostPolicy, PullError, open_url
from app.speech.voices import MAX_CONFIG_BYTES, ONNX_FIRST_BYTE, describe

# Piper's largest ("high") voices are about 115 MB.
MAX_VOICE_BYTES = 512 * 1024 * 1024
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,59}$")
READ_BYTES = 1 << 20


def is_voice_source(spec: str) -> bool:
    """Whether a pull's source names a Piper voice (an http(s) URL whose path ends in .onnx)."""
    spec = spec.strip()
    return spec.startswith(("http://", "https://")) and urlsplit(spec.partition("#")[0]).path.endswith(".onnx")


def pull_voice(spec: str, models_dir: Path, hosts: HostPolicy, state) -> Path:
    """Download the voice's config, then its weights, into the models folder; the .onnx's path."""
    url = spec.strip().partition("#")[0]
    parts = urlsplit(url)
    name = unquote(Path(parts.path).name)
    if not _NAME.match(name.removesuffix(".onnx")):
        raise PullError(f"a voice's file name must be letters, digits, '.', '_', '+' or '-' (at most 60), not "
                        f"{name[:80]!r}", refused=True, code="bad_source")
    target, config_target = models_dir / name, models_dir / f"{name}.json"
    if target.exists():
        raise PullError(f"{name} is already in the models folder", refused=True, code="exists")
    state.filename, state.state = name, "downloading"
    config = _read(urlunsplit(parts._replace(path=parts.path + ".json")), hosts, MAX_CONFIG_BYTES)
    part = models_dir / f".{name}.part"
    config_part = models_dir / f".{name}.json.part"
    try:
        config_part.write_bytes(config)
        _download(url, hosts, part, state)
        state.state = "verifying"
        voice = describe(name.removesuffix(".onnx"), part, config_part)
        if voice.error is not None:
            raise PullError(f"not a Piper voice: {voice.error.replace(part.name, name)}", refused=True, code="unservable")
        os.replace(config_part, config_target)
        os.replace(part, target)
    finally:
        for leftover in (part, config_part):
            leftover.unlink(missing_ok=True)
    state.state, state.path, state.finished_s = "done", target, time.monotonic()
    return target


def _read(url: str, hosts: HostPolicy, limit: int) -> bytes:
    conn, resp = open_url(url, {}, hosts)
    try:
        if resp.status != 200:
            raise PullError(f"{url} answered HTTP {resp.status}: a voice needs its .onnx.json beside the .onnx",
                            refused=resp.status == 404, code="not_found" if resp.status == 404 else "upstream")
        data = resp.read(limit + 1)
    except (OSError, http.client.HTTPException) as exc:
        raise PullError(f"reading {url} failed: {exc}")
    finally:
        conn.close()
    if len(data) > limit:
        raise PullError(f"{url} is over {limit:,} bytes: not a Piper voice config", refused=True, code="unservable")
    return data


def _download(url: str, hosts: HostPolicy, part: Path, state) -> None:
    conn, resp = open_url(url, {}, hosts)
    try:
        if resp.status != 200:
            raise PullError(f"{url} answered HTTP {resp.status}", refused=resp.status == 404,
                            code="not_found" if resp.status == 404 else "upstream")
        length = resp.getheader("Content-Length")
        state.total_bytes = int(length) if length and length.isdigit() else None
        if (state.total_bytes or 0) > MAX_VOICE_BYTES:
            raise PullError(f"{url} is {state.total_bytes:,} bytes, over a voice's {MAX_VOICE_BYTES:,}", refused=True,
                            code="unservable")
        with open(part, "wb") as out:
            while chunk := resp.read(READ_BYTES):
                if state.done_bytes == 0 and chunk[0] != ONNX_FIRST_BYTE:
                    raise PullError(f"{url} is not an ONNX model", refused=True, code="unservable")
                state.done_bytes += len(chunk)
                if state.done_bytes > MAX_VOICE_BYTES:
                    raise PullError(f"{url} is over a voice's {MAX_VOICE_BYTES:,} bytes", refused=True, code="unservable")
                out.write(chunk)
    except (OSError, http.client.HTTPException) as exc:
        raise PullError(f"downloading {url} failed: {exc}")
    finally:
        conn.close()
