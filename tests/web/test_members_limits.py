"""The Members page's limits, permissions and live use: each member's own limits saved (empty: the default),
bad values explained, a permission granted and withdrawn, the use now read from the gateway's counters."""

import re

from sqlalchemy import select

from app.gateway.context import services
from app.gateway.members import MemberLimits, Quota
from app.gateway.tokens import create_token
from app.store.models import ApiToken, Member


def _member(app, name="alice"):
    with services(app).sessions() as s:
        return s.scalars(select(Member).where(Member.name == name)).one()


def _new_token(app, member="alice", **permissions):
    with services(app).sessions() as s:
        token, info = create_token(s, member, "chat", **permissions)
    return token, info


def test_limits_are_saved_and_an_empty_field_is_the_default(app, admin, csrf_token):
    token, _ = _new_token(app)
    member = _member(app)
    page = admin.get("/members").get_data(as_text=True)
    assert f'action="/members/{member.id}/limits"' in page and 'placeholder="default: 0.5 of each class' in page
    assert 'placeholder="default: no limit"' in page
    r = admin.post(f"/members/{member.id}/limits", data={"max_concurrent": "3", "max_queue": "", "max_requests_per_min": "30",
                                                          "csrf_token": csrf_token(admin, "/members")},
                   headers={"HX-Request": "true"})
    assert r.status_code == 200 and "Limits of alice saved" in r.get_data(as_text=True)
    assert MemberLimits.of(_member(app)) == MemberLimits(max_concurrent=3, max_requests_per_min=30)
    # The gateway reads them at once (its token cache was cleared).
    assert services(app).tokens.lookup(token).limits.max_concurrent == 3
    # Emptied again: back to the defaults.
    admin.post(f"/members/{member.id}/limits", data={"csrf_token": csrf_token(admin, "/members")})
    assert MemberLimits.of(_member(app)) == MemberLimits()


def test_bad_limits_are_explained_and_nothing_is_saved(app, admin, csrf_token):
    _new_token(app)
    member = _member(app)
    r = admin.post(f"/members/{member.id}/limits", data={"max_concurrent": "0", "max_queue": "two",
                                                          "max_tokens_per_day": "500",
                                                          "csrf_token": csrf_token(admin, "/members")})
    assert r.status_code == 422
    html = r.get_data(as_text=True)
    assert "The limits were not saved" in html and "A whole number, or empty for the default." in html
    assert "max_concurrent must be 1 to" in html and 'value="two"' in html
    assert MemberLimits.of(_member(app)) == MemberLimits()
    assert admin.post("/members/999/limits", data={"csrf_token": csrf_token(admin, "/members")}).status_code == 404


def test_a_permission_is_granted_and_withdrawn(app, admin, csrf_token):
    token, info = _new_token(app)
    html = admin.get("/members").get_data(as_text=True)
    assert re.search(r'data-permission="may_manage" data-granted="no"', html)
    r = admin.post(f"/members/tokens/{info.id}/permissions", data={"permission": "may_manage", "grant": "yes",
                                                                   "csrf_token": csrf_token(admin, "/members")})
    assert r.status_code == 200 and "may now manage models" in r.get_data(as_text=True)
    assert services(app).tokens.lookup(token).may_manage is True
    admin.post(f"/members/tokens/{info.id}/permissions", data={"permission": "may_manage", "grant": "no",
                                                               "csrf_token": csrf_token(admin, "/members")})
    assert services(app).tokens.lookup(token).may_manage is False
    assert admin.post(f"/members/tokens/{info.id}/permissions", data={"permission": "root", "grant": "yes",
                                                                      "csrf_token": csrf_token(admin, "/members")}
                      ).status_code == 400


def test_a_new_token_can_be_trusted_to_name_its_users(app, admin, csrf_token):
    r = admin.post("/members/tokens", data={"member": "openwebui", "default_class": "chat", "trust_user_headers": "on",
                                            "csrf_token": csrf_token(admin, "/members")})
    assert r.status_code == 201
    with services(app).sessions() as s:
        row = s.scalars(select(ApiToken)).one()
        assert (row.may_manage, row.trust_user_headers) == (False, True)
    r = admin.post("/members/tokens", data={"member": "a/b", "default_class": "chat",
                                            "csrf_token": csrf_token(admin, "/members")})
    assert r.status_code == 422 and "A name without &#39;/&#39;" in r.get_data(as_text=True)


def test_use_now_shows_places_rates_and_refusals_against_the_limits(app, admin):
    svc = services(app)
    _new_token(app)
    with svc.sessions() as s:
        s.scalars(select(Member).where(Member.name == "alice")).one().max_requests_per_min = 60
        s.commit()
    chat = svc.classes.get("chat")
    held = svc.admission.admit(chat, "alice", Quota(2, 2))
    svc.usage.check_and_count("alice", {})
    svc.usage.add_tokens("alice", 42)
    for _ in range(3):
        svc.refusals.count("alice", "chat", "member_queue_full")
    r = admin.get("/partials/members/use")
    assert r.status_code == 200
    html = r.get_data(as_text=True)
    row = html[html.index('id="use-alice"'):]
    row = row[:row.index("</tr>")]
    share = min(chat.max_concurrent, max(1, chat.max_concurrent // 2))
    assert '<td class="num" data-use="running">1</td>' in row
    assert f"chat 1/{share}" in row
    assert 'data-use="requests_per_min">1 / 60<' in row and 'data-use="tokens_per_day">42<' in row
    assert 'title="member_queue_full: 3">3<' in row
    assert 'hx-trigger="every 3s"' in html
    svc.admission.release(held)


def test_the_people_behind_a_trusted_token_are_listed_under_its_member(app, admin):
    _new_token(app, "openwebui", trust_user_headers=True)
    with services(app).sessions() as s:
        parent = s.scalars(select(Member).where(Member.name == "openwebui")).one()
        s.add(Member(name="openwebui/Bob", parent_id=parent.id, external_id="7c1e", max_tokens_per_day=1000))
        s.commit()
    html = admin.get("/members").get_data(as_text=True)
    assert "1 person behind its trusted tokens" in html
    bob = html[html.index('id="member-openwebui/Bob"'):]
    assert "a person behind a trusted token of openwebui" in bob and "<code>7c1e</code>" in bob
    assert "Limits: tokens per day 1000" in bob
    assert html.index('id="member-openwebui"') < html.index('id="member-openwebui/Bob"')
