"""Members and their API tokens in the store: create (shown once), list, revoke, grant, look up; members' limits."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from app.gateway.auth import PREFIX_CHARS, Principal, hash_token, new_token
from app.gateway.members import LIMIT_FIELDS, MAX_LIMIT, MemberLimits
from app.store.models import ApiToken, Member, RequestClass, RequestRecord, utcnow

# The smallest value each limit takes: a member needs one running place to be served at all, may be
# allowed no waiting (refused at once when their places are taken), and a rate of 0 would lock them out.
LIMIT_MINIMUM = {"max_concurrent": 1, "max_queue": 0, "max_requests_per_min": 1, "max_tokens_per_min": 1,
                 "max_tokens_per_day": 1}


class TokenError(ValueError):
    """A token command that cannot be carried out (the message says why)."""


@dataclass(frozen=True)
class TokenInfo:
    """A token as lists show it: never the token itself."""

    id: int
    member: str
    prefix: str
    default_class: str
    allowed_classes: tuple[str, ...]
    created_at: str
    revoked: bool
    last_used_at: str | None
    may_manage: bool = False
    trust_user_headers: bool = False


def _check_classes(session: Session, names: list[str]) -> None:
    known = set(session.scalars(select(RequestClass.name)))
    unknown = [n for n in names if n not in known]
    if unknown:
        raise TokenError(f"unknown class(es) {', '.join(unknown)}; known: {', '.join(sorted(known))}")


def create_token(session: Session, member: str, default_class: str, allow: list[str] | None = None, *,
                 may_manage: bool = False, trust_user_headers: bool = False) -> tuple[str, TokenInfo]:
    """Create a token for a member (created if new); returns the token, which is never shown again.

    `may_manage`: it may pull, delete, copy, load and unload models (while api_manage_models is on);
    `trust_user_headers`: its X-OpenWebUI-User-* headers name the person behind each request.
    """
    member = member.strip()
    if not member:
        raise TokenError("the member name is empty")
    allowed = sorted({c.strip() for c in (allow or []) if c.strip()} | {default_class})
    _check_classes(session, allowed)
    m = session.scalar(select(Member).where(Member.name == member))
    if m is None:
        m = Member(name=member)
        session.add(m)
        session.flush()
    token = new_token()
    row = ApiToken(member_id=m.id, prefix=token[:PREFIX_CHARS], token_hash=hash_token(token),
                   default_class=default_class, allowed_classes=allowed, may_manage=may_manage,
                   trust_user_headers=trust_user_headers)
    session.add(row)
    session.commit()
    return token, _info(row, m.name)


def _info(row: ApiToken, member: str, last_used_at=None) -> TokenInfo:
    used = max((t for t in (row.last_used_at, last_used_at) if t is not None), default=None)
    return TokenInfo(row.id, member, row.prefix, row.default_class, tuple(row.allowed_classes),
                     row.created_at.isoformat(timespec="seconds"), row.revoked_at is not None,
                     used.isoformat(timespec="seconds") if used else None, bool(row.may_manage),
                     bool(row.trust_user_headers))


def list_tokens(session: Session) -> list[TokenInfo]:
    """Every token, newest first, with its last use taken from the request log."""
    # The request log already holds every use; one grouped scan beats a write per request.
    last_used = dict(session.execute(
        select(RequestRecord.token_id, func.max(RequestRecord.arrival_at))
        .where(RequestRecord.token_id.is_not(None)).group_by(RequestRecord.token_id)).all())
    rows = session.execute(select(ApiToken, Member.name).join(Member).order_by(ApiToken.id.desc()))
    return [_info(t, name, last_used.get(t.id)) for t, name in rows]


def _token_row(session: Session, ident: str) -> tuple[ApiToken, str]:
    query = select(ApiToken, Member.name).join(Member)
    query = query.where(ApiToken.id == int(ident)) if ident.isdigit() else query.where(ApiToken.prefix == ident)
    found = session.execute(query).first()
    if found is None:
        raise TokenError(f"no token with id or prefix '{ident}' (see `hearth token list`)")
    return found[0], found[1]


def revoke_token(session: Session, ident: str) -> TokenInfo:
    """Revoke a token by id or by its shown prefix."""
    row, member = _token_row(session, ident)
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        session.commit()
    return _info(row, member)


def set_token(session: Session, ident: str, *, may_manage: bool | None = None,
              trust_user_headers: bool | None = None) -> TokenInfo:
    """Grant or withdraw a token's permissions by id or prefix (None leaves one as it is)."""
    row, member = _token_row(session, ident)
    if row.revoked_at is not None and (may_manage or trust_user_headers):
        raise TokenError(f"token {row.id} ({row.prefix}…) is revoked; create a new one for {member}")
    if may_manage is not None:
        row.may_manage = may_manage
    if trust_user_headers is not None:
        row.trust_user_headers = trust_user_headers
    session.commit()
    return _info(row, member)


@dataclass(frozen=True)
class MemberInfo:
    """A member as the Members page and `hearth token member` show it: their own limits and their tokens."""

    id: int
    name: str
    created_at: datetime | None
    limits: MemberLimits
    parent: str | None = None  # the token's member, for a person behind a trusted token
    external_id: str | None = None
    tokens: tuple[TokenInfo, ...] = ()
    people: tuple[str, ...] = ()  # persons named by this member's trusted tokens

    @property
    def active(self) -> int:
        """Tokens not revoked."""
        return sum(1 for t in self.tokens if not t.revoked)


def check_limits(values: dict[str, int | None]) -> dict[str, str]:
    """What is wrong with member limit values (None clears one): {field: message}."""
    problems = {}
    for name, value in values.items():
        if name not in LIMIT_FIELDS:
            problems[name] = f"unknown limit '{name}'; known: {', '.join(LIMIT_FIELDS)}"
        elif value is not None and not (LIMIT_MINIMUM[name] <= value <= MAX_LIMIT):
            problems[name] = f"{name} must be {LIMIT_MINIMUM[name]} to {MAX_LIMIT}, or empty for the default (got {value})"
    return problems


def _member_row(session: Session, name: str) -> Member:
    row = session.scalar(select(Member).where(Member.name == name))
    if row is None:
        known = ", ".join(session.scalars(select(Member.name).order_by(Member.name)).all()) or "none yet"
        raise TokenError(f"no member '{name}' (known: {known}); `hearth token create --member {name} …` creates one")
    return row


def set_member_limits(session: Session, name: str, values: dict[str, int | None]) -> MemberInfo:
    """Set (or with None, clear back to the default) some of a member's own limits."""
    problems = check_limits(values)
    if problems:
        raise TokenError("; ".join(problems.values()))
    row = _member_row(session, name)
    for key, value in values.items():
        setattr(row, key, value)
    session.commit()
    return member_info(session, name)


def member_info(session: Session, name: str) -> MemberInfo:
    """One member with their limits and tokens."""
    row = _member_row(session, name)
    return next(m for m in list_members(session) if m.id == row.id)


def list_members(session: Session) -> list[MemberInfo]:
    """Every member with their limits and tokens, each person behind a trusted token after their member."""
    rows = list(session.scalars(select(Member).order_by(Member.name)))
    by_id = {r.id: r for r in rows}
    tokens: dict[str, list[TokenInfo]] = {}
    for t in list_tokens(session):
        tokens.setdefault(t.member, []).append(t)
    people: dict[int, list[str]] = {}
    for r in rows:
        if r.parent_id is not None:
            people.setdefault(r.parent_id, []).append(r.name)
    out = []
    for r in rows:
        if r.parent_id is not None:
            continue
        out.append(_member_info(r, None, tokens, people))
        out.extend(_member_info(by_id[p], r.name, tokens, people) for p in
                   sorted((x.id for x in rows if x.parent_id == r.id), key=lambda i: by_id[i].name))
    return out


def _member_info(r: Member, parent: str | None, tokens: dict[str, list[TokenInfo]],
                 people: dict[int, list[str]]) -> MemberInfo:
    return MemberInfo(r.id, r.name, r.created_at, MemberLimits.of(r), parent, r.external_id,
                      tuple(tokens.get(r.name, ())), tuple(people.get(r.id, ())))


def principal_loader(sessions: sessionmaker):
    """A function mapping a token hash to its Principal (None when unknown or revoked)."""

    def load(token_hash: str) -> Principal | None:
        with sessions() as session:
            found = session.execute(
                select(ApiToken, Member).join(Member).where(ApiToken.token_hash == token_hash)
            ).first()
            if found is None or found[0].revoked_at is not None:
                return None
            row, member = found
            return Principal(row.id, member.name, row.default_class, tuple(row.allowed_classes),
                             limits=MemberLimits.of(member), may_manage=bool(row.may_manage),
                             trust_user_headers=bool(row.trust_user_headers), member_id=member.id)

    return load
