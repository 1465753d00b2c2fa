"""Members and their API tokens in the store: create (shown once), list, revoke, look up."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from app.gateway.auth import PREFIX_CHARS, Principal, hash_token, new_token
from app.store.models import ApiToken, Member, RequestClass, RequestRecord, utcnow


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


def _check_classes(session: Session, names: list[str]) -> None:
    known = set(session.scalars(select(RequestClass.name)))
    unknown = [n for n in names if n not in known]
    if unknown:
        raise TokenError(f"unknown class(es) {', '.join(unknown)}; known: {', '.join(sorted(known))}")


def create_token(session: Session, member: str, default_class: str, allow: list[str] | None = None) -> tuple[str, TokenInfo]:
    """Create a token for a member (created if new); returns the token, which is never shown again."""
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
                   default_class=default_class, allowed_classes=allowed)
    session.add(row)
    session.commit()
    return token, _info(row, m.name)


def _info(row: ApiToken, member: str, last_used_at=None) -> TokenInfo:
    used = max((t for t in (row.last_used_at, last_used_at) if t is not None), default=None)
    return TokenInfo(row.id, member, row.prefix, row.default_class, tuple(row.allowed_classes),
                     row.created_at.isoformat(timespec="seconds"), row.revoked_at is not None,
                     used.isoformat(timespec="seconds") if used else None)


def list_tokens(session: Session) -> list[TokenInfo]:
    """Every token, newest first, with its last use taken from the request log."""
    # The request log already holds every use; one grouped scan beats a write per request.
    last_used = dict(session.execute(
        select(RequestRecord.token_id, func.max(RequestRecord.arrival_at))
        .where(RequestRecord.token_id.is_not(None)).group_by(RequestRecord.token_id)).all())
    rows = session.execute(select(ApiToken, Member.name).join(Member).order_by(ApiToken.id.desc()))
    return [_info(t, name, last_used.get(t.id)) for t, name in rows]


def revoke_token(session: Session, ident: str) -> TokenInfo:
    """Revoke a token by id or by its shown prefix."""
    query = select(ApiToken, Member.name).join(Member)
    query = query.where(ApiToken.id == int(ident)) if ident.isdigit() else query.where(ApiToken.prefix == ident)
    found = session.execute(query).all()
    if not found:
        raise TokenError(f"no token with id or prefix '{ident}' (see `hearth token list`)")
    row, member = found[0]
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        session.commit()
    return _info(row, member)


def principal_loader(sessions: sessionmaker):
    """A function mapping a token hash to its Principal (None when unknown or revoked)."""

    def load(token_hash: str) -> Principal | None:
        with sessions() as session:
            found = session.execute(
                select(ApiToken, Member.name).join(Member).where(ApiToken.token_hash == token_hash)
            ).first()
            if found is None or found[0].revoked_at is not None:
                return None
            row, member = found
            return Principal(row.id, member, row.default_class, tuple(row.allowed_classes))

    return load
