"""The Members page: family members and apps with their API tokens; create a token (shown once), revoke one.

Creating and revoking go through app.gateway.tokens, as `hearth token create|revoke` does. The
token itself is only ever in the response to the POST that created it (marked no-store): the
store keeps its hash, so no later page can show it again.
"""

from __future__ import annotations

from flask import Blueprint, abort, current_app, render_template, request

from app.gateway.context import services
from app.gateway.tokens import TokenError, create_token, revoke_token
from app.web.auth import login_required
from app.web.queries import class_rows, members_with_tokens

bp = Blueprint("members", __name__)

MAX_MEMBER_NAME = 128


def _context(**extra) -> dict:
    with services().sessions() as s:
        members = members_with_tokens(s)
        classes = [c.name for c in class_rows(s)]
    ctx = {"members": members, "classes": classes, "form": {"member": "", "default_class": "chat" if "chat" in classes
                                                            else (classes[0] if classes else ""), "allow": []},
           "errors": {}, "created": None, "revoked": None}
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


@bp.get("/members")
@login_required
def index():
    """Members and their tokens."""
    return render_template("members/index.html", **_context())


@bp.post("/members/tokens")
@login_required
def create():
    """Create a token for a member (created if new); the token is in this response and nowhere else."""
    member = request.form.get("member", "").strip()
    default_class = request.form.get("default_class", "").strip()
    allow = [c for c in request.form.getlist("allow") if c]
    form = {"member": member, "default_class": default_class, "allow": allow}
    errors = {}
    if not member:
        errors["member"] = "Enter who the token is for: a person (alice) or an app (kitchen-speaker)."
    elif len(member) > MAX_MEMBER_NAME:
        errors["member"] = f"Use at most {MAX_MEMBER_NAME} characters."
    if not default_class:
        errors["default_class"] = "Choose the class this token's requests get by default."
    if not errors:
        try:
            with services().sessions() as s:
                token, info = create_token(s, member, default_class, allow)
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
            token = next((t for m in members_with_tokens(s) for t in m.tokens if t.id == token_id), None)
        if token is None:
            abort(404, description=f"no token with id {token_id}")
        return render_template("members/confirm_revoke.html", token=token)
    try:
        with services().sessions() as s:
            info = revoke_token(s, str(token_id))
    except TokenError as exc:
        abort(404, description=str(exc))
    # The gateway caches tokens for a few seconds: forget them so the revocation applies now.
    services().tokens.clear()
    return _render(revoked=info)
