"""`hearth token`'s command line: API tokens and members' limits, from the console."""

from __future__ import annotations

import argparse
import sys


def add_arguments(sub: argparse._SubParsersAction) -> None:
    """`hearth token ...`: API tokens."""
    token = sub.add_parser("token", help="API tokens of family members and apps")
    token_sub = token.add_subparsers(dest="token_command", required=True)
    create = token_sub.add_parser("create", help="create a token (shown once)")
    create.add_argument("--member", required=True, help="family member or app the token belongs to")
    create.add_argument("--class", dest="default_class", required=True, help="its default request class")
    create.add_argument("--allow", default="", help="comma-separated further classes it may ask for")
    create.add_argument("--manage", action="store_true",
                        help="it may pull, delete, copy, load and unload models (while api_manage_models is on)")
    create.add_argument("--trust-user-headers", action="store_true",
                        help="its X-OpenWebUI-User-* headers name the person behind each request (Open WebUI)")
    token_sub.add_parser("list", help="list tokens (never the tokens themselves)")
    revoke = token_sub.add_parser("revoke", help="revoke a token by id or prefix")
    revoke.add_argument("token", help="token id or prefix as `hearth token list` shows it")
    tset = token_sub.add_parser("set", help="grant or withdraw a token's permissions")
    tset.add_argument("token", help="token id or prefix as `hearth token list` shows it")
    tset.add_argument("--manage", action=argparse.BooleanOptionalAction, default=None,
                      help="may pull, delete, copy, load and unload models (while api_manage_models is on)")
    tset.add_argument("--trust-user-headers", action=argparse.BooleanOptionalAction, default=None,
                      help="its X-OpenWebUI-User-* headers name the person behind each request")
    member = token_sub.add_parser("member", help="show a member's limits and use, or set them")
    member.add_argument("name", help="the member (a person behind a trusted token is MEMBER/PERSON)")
    for flag, what in (("--max-concurrent", "running places in any one class"),
                       ("--max-queue", "waiting places in any one class"),
                       ("--max-requests-per-min", "requests started per minute"),
                       ("--max-tokens-per-min", "prompt + generated tokens per minute"),
                       ("--max-tokens-per-day", "prompt + generated tokens per 24 hours")):
        member.add_argument(flag, metavar="N|default", help=f"{what} ('default': the household's default)")


def _permissions(info) -> str:
    """A token's permissions as `hearth token` prints them after its classes."""
    granted = [what for what, on in (("may manage models", info.may_manage),
                                     ("names the people behind it", info.trust_user_headers)) if on]
    return f"; {', '.join(granted)}" if granted else ""


def _limit_value(flag: str, text: str) -> int | None:
    """A `hearth token member` limit as typed: a whole number, or 'default' (None)."""
    if text.strip().lower() in ("default", "none", ""):
        return None
    try:
        return int(text)
    except ValueError:
        raise SystemExit(f"hearth token member: --{flag.replace('_', '-')} takes a whole number or 'default' "
                         f"(got {text!r})") from None


def _token_member(session, args) -> None:
    from app.gateway.members import LIMIT_FIELDS, LIMIT_LABELS, RATE_SETTINGS
    from app.gateway.tokens import member_info, set_member_limits
    from app.store.settings import get_setting

    values = {f: _limit_value(f, getattr(args, f)) for f in LIMIT_FIELDS if getattr(args, f) is not None}
    info = set_member_limits(session, args.name, values) if values else member_info(session, args.name)
    share = float(get_setting(session, "member_class_share"))
    print(f"member {info.name}{f' (a person behind {info.parent})' if info.parent else ''}")
    for f in LIMIT_FIELDS:
        own = getattr(info.limits, f)
        if own is not None:
            shown = str(own)
        elif f in RATE_SETTINGS:
            default = get_setting(session, RATE_SETTINGS[f])
            shown = f"default ({default if default is not None else 'no limit'}, setting {RATE_SETTINGS[f]})"
        else:
            shown = f"default ({share:g} of each class's, setting member_class_share)"
        print(f"  {f:<22} {shown}   {LIMIT_LABELS[f]}")
    if values:
        print("(hearth serve applies it within 5 s)", file=sys.stderr)


def run(args) -> int:
    """`hearth token ...`: create, list, revoke or change a token, or a member's limits."""
    from app.gateway.tokens import TokenError, create_token, list_tokens, revoke_token, set_token
    from app.paths import data_dir
    from app.store.db import open_store, writing_sessions

    db_engine, _ = open_store(data_dir())
    try:
        # The write lock first: serve's writer committing between this command's read and its write cannot
        # make SQLite refuse the write.
        with writing_sessions(db_engine)() as session:
            if args.token_command == "create":
                allow = [c for c in args.allow.split(",") if c.strip()]
                token, info = create_token(session, args.member, args.default_class, allow, may_manage=args.manage,
                                           trust_user_headers=args.trust_user_headers)
                print(token)
                print(f"token {info.id} for {info.member}: default class {info.default_class}, may use "
                      f"{', '.join(info.allowed_classes)}{_permissions(info)}. Store it now: it is not shown again.",
                      file=sys.stderr)
            elif args.token_command == "list":
                rows = list_tokens(session)
                print(f"{'id':>4}  {'prefix':<13} {'member':<16} {'class':<11} {'allowed':<30} {'created':<20} "
                      f"{'state':<8} permissions")
                for t in rows:
                    perms = ",".join(p for p, on in (("manage", t.may_manage), ("names-users", t.trust_user_headers))
                                     if on) or "-"
                    print(f"{t.id:>4}  {t.prefix:<13} {t.member:<16} {t.default_class:<11} "
                          f"{','.join(t.allowed_classes):<30} {t.created_at:<20} "
                          f"{'revoked' if t.revoked else 'active':<8} {perms}")
            elif args.token_command == "revoke":
                info = revoke_token(session, args.token)
                print(f"revoked token {info.id} ({info.prefix}…) of {info.member}")
            elif args.token_command == "set":
                if args.manage is None and args.trust_user_headers is None:
                    raise TokenError("say what to change: --manage/--no-manage, "
                                     "--trust-user-headers/--no-trust-user-headers")
                info = set_token(session, args.token, may_manage=args.manage,
                                 trust_user_headers=args.trust_user_headers)
                print(f"token {info.id} ({info.prefix}…) of {info.member}{_permissions(info) or ': no permissions'} "
                      "(hearth serve applies it within 5 s)")
            elif args.token_command == "member":
                _token_member(session, args)
    except TokenError as exc:
        print(f"hearth token: {exc}", file=sys.stderr)
        return 2
    finally:
        db_engine.dispose()
    return 0
