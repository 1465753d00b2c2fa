"""The people behind a token trusted to name its users: Open WebUI's X-OpenWebUI-User-* headers.

Open WebUI (with ENABLE_FORWARD_USER_INFO_HEADERS) sends `X-OpenWebUI-User-Id`, `-Name`, `-Email`
and `-Role` with every request it makes for a person. For a token the admin marked as trusted to
name its users, that person is the member: their own limits, their rows in the request log, their
line on the dashboard. For any other token the headers are ignored: a family app cannot claim to
be someone else.

A person is a member row of its own, created on first sight (through the store writer) as a
sub-member of the token's member: `parent_id` the token's member, `external_id` the client's user id,
named `<member>/<user name>`. A member row rather than a `person` column on the request log,
because limits, the Members page and every per-member figure then work for people unchanged. The
e-mail and role are not stored. At most MAX_PEOPLE_PER_MEMBER people per member: past that (a
misbehaving client inventing ids), requests count as the token's member, and the log says so once.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from cachetools import TTLCache
from sqlalchemy import func, insert, select
from sqlalchemy.orm import Session, sessionmaker

from app.gateway.auth import Principal
from app.gateway.members import MemberLimits
from app.store.models import Member, utcnow
from app.store.writer import StoreWriter

log = logging.getLogger(__name__)

USER_ID_HEADER = "X-OpenWebUI-User-Id"
USER_NAME_HEADER = "X-OpenWebUI-User-Name"
MAX_PEOPLE_PER_MEMBER = 500
MAX_NAME_CHARS = 48  # of the person's part of the member name
MAX_ID_CHARS = 128
MAX_CACHED_PEOPLE = 4096
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f]+")


def clean(value: str | None, limit: int) -> str:
    """A header value as a name: no control characters, single spaces, no '/', at most `limit` characters."""
    text = _UNPRINTABLE.sub(" ", value or "").replace("/", "-")
    return " ".join(text.split())[:limit]


@dataclass(frozen=True)
class _Person:
    name: str
    member_id: int | None  # None until the writer has stored the row
    limits: MemberLimits


class People:
    """Principals for the people a trusted token names, cached for ttl_s (limits edited elsewhere apply then)."""

    def __init__(self, sessions: sessionmaker, writer: StoreWriter, ttl_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self._sessions = sessions
        self._writer = writer
        self._lock = threading.Lock()
        self._cache: TTLCache = TTLCache(maxsize=MAX_CACHED_PEOPLE, ttl=ttl_s, timer=clock)
        self._warned: set[int] = set()

    def behind(self, principal: Principal, headers: Mapping[str, str]) -> Principal:
        """The principal of the person a trusted token names in `headers`, else `principal` as it is."""
        if not principal.trust_user_headers or principal.member_id is None:
            return principal
        user_name = clean(headers.get(USER_NAME_HEADER), MAX_NAME_CHARS)
        user_id = clean(headers.get(USER_ID_HEADER), MAX_ID_CHARS) or user_name
        if not user_id:
            return principal
        key = (principal.member_id, user_id)
        with self._lock:
            person = self._cache.get(key)
        if person is None:
            person = self._load(principal, user_id, user_name or user_id)
            if person is None:
                return principal
            with self._lock:
                self._cache[key] = person
        return replace(principal, member=person.name, limits=person.limits, member_id=person.member_id)

    def clear(self) -> None:
        """Forget every cached person (after their limits were edited in this process)."""
        with self._lock:
            self._cache.clear()

    def _load(self, principal: Principal, user_id: str, user_name: str) -> _Person | None:
        with self._sessions() as s:
            row = s.scalar(select(Member).where(Member.parent_id == principal.member_id,
                                                Member.external_id == user_id))
            if row is not None:
                return _Person(row.name, row.id, MemberLimits.of(row))
            num_people = s.scalar(select(func.count()).select_from(Member)
                                  .where(Member.parent_id == principal.member_id))
            if num_people >= MAX_PEOPLE_PER_MEMBER:
                if principal.member_id not in self._warned:
                    self._warned.add(principal.member_id)
                    log.warning("member %s already has %d people behind its trusted tokens; requests for new "
                                "people count as %s", principal.member, num_people, principal.member)
                return None
            name = _free_name(s, f"{principal.member}/{user_name}"[:128], user_id)
        values = {"name": name, "parent_id": principal.member_id, "external_id": user_id}

        def store(session: Session) -> None:
            # OR IGNORE: a second first sight of the same person (or a name taken meanwhile) adds nothing.
            session.execute(insert(Member).prefix_with("OR IGNORE").values(created_at=utcnow(), **values))

        self._writer.submit(store)
        log.info("new person %s behind a trusted token of %s", name, principal.member)
        return _Person(name, None, MemberLimits())


def _free_name(session: Session, base: str, user_id: str) -> str:
    """`base`, or `base` with a piece of the user id when another member already has that name."""
    if session.scalar(select(Member.id).where(Member.name == base)) is None:
        return base
    return f"{base[:100]}#{user_id[:16]}"

