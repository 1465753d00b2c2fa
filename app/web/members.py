"""The Members page: family members and apps with their API tokens, limits and use now.

Creating, revoking and granting go through app.gateway.tokens, as `hearth token create|revoke|set`
does; limits as `hearth token member`. The token itself is only ever in the response to the POST
that created it (marked no-store): the store keeps its hash, so no later page can show it again.
Each member's use against their limits (running and waiting places, requests and tokens in their
windows, refusals) comes from the gateway's own counters, polled every few seconds: the page reads
them, it never drives them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from flask import Blueprint, abort, current_app, render_template, request

from app.gateway.context import services
from app.gateway.members import LIMIT_FIELDS, LIMIT_LABELS, RATE_SETTINGS, MemberLimits, class_quota, rate_limits
from app.gateway.pipeline import LAN_MEMBER
from app.gateway.refusals import REFUSAL_REASONS
from app.gateway.tokens import (
    MemberInfo,
    TokenError,
    check_limits,
    create_token,
    list_members,
    revoke_token,
    set_member_limits,
    set_token,
)
from app.services.privacy import remove_member
from app.web.auth import login_required
from app.web.queries import class_rows

bp = Blueprint("members", __name__)

MAX_MEMBER_NAME = 128
REFUSALS_WINDOW_S = 3600  # the page's "refused" column: the last hour
PERMISSIONS = {"may_manage": "manage models", "trust_user_headers": "name the people behind it"}


@dataclass
class UseRow:
    """One member's use now against the limits in force."""

    name: str
    running: int = 0
    waiting: int = 0
    # (class, running, waiting, running places, waiting places) for each class the member uses now
    classes: list[tuple[str, int, int, int, int]] = field(default_factory=list)
    requests_per_min: int = 0
    tokens_per_min: int = 0
    tokens_per_day: int = 0
    limits: dict[str, int] = field(default_factory=dict)  # the rate limits in force
    refused: dict[str, int] = field(default_factory=dict)  # by reason, last hour

    @property
    def num_refused(self) -> int:
        """Refusals in the last hour, all reasons."""
        return sum(self.refused.values())

    @property
    def busy(self) -> bool:
        """Anything to show."""
        return bool(self.running or self.waiting or self.requests_per_min or self.tokens_per_day or self.refused)


def use_rows(members: list[MemberInfo]) -> list[UseRow]:
    """Every member with recent use (and the LAN's tokenless clients), from the gateway's live counters."""
    svc = services()
    share = float(svc.settings.get("member_class_share"))
    limits = {m.name: m.limits for m in members}
    places = svc.admission.member_snapshot()
    usage = svc.usage.snapshot()
    with svc.sessions() as s:
        refused = svc.refusals.recent(s, time.time() - REFUSALS_WINDOW_S)
    order = [m.name for m in members] + sorted(({LAN_MEMBER} | set(places) | set(usage) | set(refused))
                                               - {m.name for m in members})
    rows = []
    for name in order:
        own = limits.get(name, MemberLimits())
        row = UseRow(name, limits=rate_limits(own, svc.settings.get), refused=refused.get(name, {}))
        for klass, now in sorted(places.get(name, {}).items()):
            policy = svc.classes.get(klass)
            quota = class_quota(own, policy, share) if policy else None
            row.running += now["in_flight"]
            row.waiting += now["waiting"]
            row.classes.append((klass, now["in_flight"], now["waiting"], quota.max_concurrent if quota else 0,
                                quota.max_queue if quota else 0))
        for key, value in usage.get(name, {}).items():
            setattr(row, key, value)
        if row.busy:
            rows.append(row)
    return rows


def _defaults() -> dict[str, str]:
    """What an empty limit field means, as its placeholder says."""
    svc = services()
    share = float(svc.settings.get("member_class_share"))
    out = {"max_concurrent": f"{share:g} of each class's", "max_queue": f"{share:g} of each class's"}
    for name, setting in RATE_SETTINGS.items():
        value = svc.settings.get(setting)
        out[name] = "no limit" if value is None else str(value)
    return out


def _context(**extra) -> dict:
    svc = services()
    with svc.sessions() as s:
        members = list_members(s)
        classes = [c.name for c in class_rows(s)]
    ctx = {"members": members, "classes": classes,
           "form": {"member": "", "default_class": "chat" if "chat" in classes else (classes[0] if classes else ""),
                    "allow": [], "may_manage": False, "trust_user_headers": False},
           "errors": {}, "created": None, "revoked": None, "changed": None, "limit_errors": {}, "limit_form": {},
           "use": use_rows(members), "limit_fields": LIMIT_FIELDS, "limit_labels": LIMIT_LABELS,
           "limit_defaults": _defaults(), "permissions": PERMISSIONS, "reasons": REFUSAL_REASONS,
           "manage_on": bool(svc.settings.get("api_manage_models"))}
    ctx.update(extra)
    return ctx


def _render(status: int = 200, **extra):
    partial = request.headers.get("HX-Request") is not None
    template = "members/_body.html" if partial else "members/index.html"
    response = current_app.make_response((render_template(template, **_context(**extra)), status))
    # A page carrying a fresh token must not be kept by the browser or any proxy.
    if extra.get("created"):
        response.headers["Cache-Control"] = "no-store"
    return response


@bp.app_context_processor
def _lan_warnings() -> dict:
    """`lan_warnings()` for every page's templates (the Overview and Settings pages include members/_lan.html)."""
    def lan_warnings() -> list[str]:
        try:
            return services().proxy_watch.warnings()
        except KeyError:  # an app without the gateway's services (some page tests)
            return []

    return {"lan_warnings": lan_warnings}


@bp.get("/members")
@login_required
def index():
    """Members, their tokens and limits, and their use now."""
    return render_template("members/index.html", **_context())


@bp.get("/partials/members/use")
@login_required
def use():
    """The use-now table, polled by htmx every 3 s."""
    with services().sessions() as s:
        members = list_members(s)
    return render_template("members/_use.html", use=use_rows(members), reasons=REFUSAL_REASONS)


@bp.post("/members/tokens")
@login_required
def create():
    """Create a token for a member (created if new); the token is in this response and nowhere else."""
    member = request.form.get("member", "").strip()
    default_class = request.form.get("default_class", "").strip()
    allow = [c for c in request.form.getlist("allow") if c]
    may_manage = request.form.get("may_manage") == "on"
    trust = request.form.get("trust_user_headers") == "on"
    form = {"member": member, "default_class": default_class, "allow": allow, "may_manage": may_manage,
            "trust_user_headers": trust}
    errors = {}
    if not member:
        errors["member"] = "Enter who the token is for: a person (alice) or an app (kitchen-speaker)."
    elif len(member) > MAX_MEMBER_NAME:
        errors["member"] = f"Use at most {MAX_MEMBER_NAME} characters."
    elif "/" in member:
        errors["member"] = "A name without '/': it separates a member from the people behind their trusted tokens."
    if not default_class:
        errors["default_class"] = "Choose the class this token's requests get by default."
    if not errors:
        try:
            with services().write_sessions() as s:
                token, info = create_token(s, member, default_class, allow, may_manage=may_manage,
                                           trust_user_headers=trust)
        except TokenError as exc:
            errors["default_class"] = str(exc)
    if errors:
        return _render(422, form=form, errors=errors)
    return _render(201, created={"token": token, "info": info})


@bp.post("/members/tokens/<int:token_id>/revoke")
@login_required
def revoke(token_id: int):
    """Revoke a token (confirmed in the browser; without JavaScript, a confirmation page first)."""
    if request.form.get("confirm") != "yes":
        with services().sessions() as s:
            token = next((t for m in list_members(s) for t in m.tokens if t.id == token_id), None)
        if token is None:
            abort(404, description=f"no token with id {token_id}")
        return render_template("members/confirm_revoke.html", token=token)
    try:
        with services().write_sessions() as s:
            info = revoke_token(s, str(token_id))
    except TokenError as exc:
        abort(404, description=str(exc))
    # The gateway caches tokens for a few seconds: forget them so the revocation applies now.
    services().forget_members()
    return _render(revoked=info)


@bp.post("/members/tokens/<int:token_id>/permissions")
@login_required
def permissions(token_id: int):
    """Grant or withdraw one permission of a token: `permission` (may_manage, trust_user_headers), `grant` yes/no."""
    permission = request.form.get("permission", "")
    if permission not in PERMISSIONS:
        abort(400, description=f"unknown permission '{permission}'; known: {', '.join(PERMISSIONS)}")
    grant = request.form.get("grant") == "yes"
    try:
        with services().write_sessions() as s:
            info = set_token(s, str(token_id), **{permission: grant})
    except TokenError as exc:
        abort(404 if "no token" in str(exc) else 409, description=str(exc))
    services().forget_members()
    verb = "may now" if grant else "may no longer"
    return _render(changed=f"Token {info.prefix}… of {info.member} {verb} {PERMISSIONS[permission]}.")


@bp.post("/members/<int:member_id>/limits")
@login_required
def limits(member_id: int):
    """Set a member's own limits; an empty field is the household's default."""
    with services().sessions() as s:
        member = next((m for m in list_members(s) if m.id == member_id), None)
    if member is None:
        abort(404, description=f"no member with id {member_id}")
    raw = {f: request.form.get(f, "").strip() for f in LIMIT_FIELDS}
    values, errors = {}, {}
    for name, text in raw.items():
        if not text:
            values[name] = None
        elif not text.isdigit():
            errors[name] = "A whole number, or empty for the default."
        else:
            values[name] = int(text)
    errors.update({k: v for k, v in check_limits({k: v for k, v in values.items() if k not in errors}).items()})
    if errors:
        return _render(422, limit_errors={member_id: errors}, limit_form={member_id: raw})
    with services().write_sessions() as s:
        set_member_limits(s, member.name, values)
    services().forget_members()
    return _render(changed=f"Limits of {member.name} saved: they apply to their next request.")


@bp.post("/members/<int:member_id>/remove")
@login_required
def remove(member_id: int):
    """Remove a member (confirmed): their tokens, the people behind them, their request-log text, their KV disk entries."""
    svc = services()
    with svc.sessions() as s:
        member = next((m for m in list_members(s) if m.id == member_id), None)
    if member is None:
        abort(404, description=f"no member with id {member_id}")
    if request.form.get("confirm") != "yes":
        return render_template("members/confirm_remove.html", member=member)
    with svc.write_sessions() as s:
        removal = remove_member(s, svc.data_dir, member.name)
    svc.forget_members()
    people = f", {len(removal.names) - 1} people behind their tokens" if len(removal.names) > 1 else ""
    return _render(changed=f"{member.name} removed{people}: their tokens no longer work, the request log keeps "
                           f"{removal.requests_cleared} of their requests' figures without their name or error text, "
                           f"and {removal.kv_entries} of their cached prompts were deleted from disk.")
