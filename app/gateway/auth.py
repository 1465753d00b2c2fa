"""API tokens: created once (shown once), stored hashed, looked up per request through a short cache."""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cachetools import TTLCache

from app.gateway.members import MemberLimits

TOKEN_PREFIX = "hth_"
PREFIX_CHARS = 12  # what lists show of a token: enough to recognise it, useless to use it
MAX_CACHED_TOKENS = 1024  # a household has a few dozen tokens: room for all, a bound for safety


def new_token() -> str:
    """A fresh random API token."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """The stored form of a token (sha256: tokens are long random strings, no salt or KDF needed)."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who is asking: the member behind a valid token (or the person it names), the classes it may use,
    the member's own limits and the token's permissions."""

    token_id: int | None  # None: a tokenless LAN request (api_open_on_lan)
    member: str
    default_class: str
    allowed_classes: tuple[str, ...]
    limits: MemberLimits = field(default_factory=MemberLimits)
    may_manage: bool = False  # pull, delete, copy, load and unload models (with api_manage_models on)
    trust_user_headers: bool = False  # X-OpenWebUI-User-* name the person behind each request
    member_id: int | None = None  # None: the LAN's member, which is no row of the store

    def may_use(self, class_name: str) -> bool:
        """True when the token allows this class."""
        return class_name == self.default_class or class_name in self.allowed_classes


class TokenCache:
    """Maps token hashes to principals for ttl_s, so revocations made elsewhere (the CLI) apply quickly.

    Only known tokens are kept, at most max_entries of them (least recently used go first): a flood
    of random bearer tokens costs one indexed lookup each and no memory.
    """

    def __init__(self, load: Callable[[str], Principal | None], ttl_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, max_entries: int = MAX_CACHED_TOKENS):
        self._load = load
        self._lock = threading.Lock()
        self._entries: TTLCache = TTLCache(maxsize=max_entries, ttl=ttl_s, timer=clock)

    def lookup(self, token: str) -> Principal | None:
        """The principal for a presented token, or None when it is unknown or revoked."""
        key = hash_token(token)
        with self._lock:
            principal = self._entries.get(key)
        if principal is not None:
            return principal
        principal = self._load(key)
        if principal is not None:
            with self._lock:
                self._entries[key] = principal
        return principal

    def num_cached(self) -> int:
        """How many tokens are cached now."""
        with self._lock:
            return len(self._entries)

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
