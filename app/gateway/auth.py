"""API tokens: created once (shown once), stored hashed, looked up per request through a short cache."""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

TOKEN_PREFIX = "hth_"
PREFIX_CHARS = 12  # what lists show of a token: enough to recognise it, useless to use it


def new_token() -> str:
    """A fresh random API token."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """The stored form of a token (sha256: tokens are long random strings, no salt or KDF needed)."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who is asking: the member behind a valid token and the classes it may use."""

    token_id: int | None  # None: a tokenless LAN request (api_open_on_lan)
    member: str
    default_class: str
    allowed_classes: tuple[str, ...]

    def may_use(self, class_name: str) -> bool:
        """True when the token allows this class."""
        return class_name == self.default_class or class_name in self.allowed_classes


class TokenCache:
    """Maps token hashes to principals; entries expire after ttl_s so revocations apply quickly."""

    def __init__(self, load: Callable[[str], Principal | None], ttl_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self._load = load
        self._ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[float, Principal | None]] = {}

    def lookup(self, token: str) -> Principal | None:
        """The principal for a presented token, or None when it is unknown or revoked."""
        key = hash_token(token)
        now = self._clock()
        with self._lock:
            hit = self._entries.get(key)
            if hit and now - hit[0] < self._ttl_s:
                return hit[1]
        principal = self._load(key)
        with self._lock:
            self._entries[key] = (now, principal)
        return principal

    def clear(self) -> None:
        """Forget everything (after a revocation made in this process)."""
        with self._lock:
            self._entries.clear()


def bearer_token(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer …` header."""
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()
