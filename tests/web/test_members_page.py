"""The Members page: members and tokens, a token shown once, revoke with confirmation, CSRF, bad input."""

import re

from app.gateway.auth import hash_token
from app.gateway.context import services
from app.store.models import ApiToken

TOKEN = re.compile(r'id="token-value">([^<]+)</code>')


def _token_rows(app):
    with services(app).sessions() as s:
        return s.query(ApiToken).order_by(ApiToken.id).all()


def test_empty_state_says_what_to_do(admin):
    html = admin.get("/members").get_data(as_text=True)
    assert "No members yet" in html and "Create the first token above" in html
    assert 'name="member"' in html and 'value="voice"' in html


def test_token_is_shown_once_and_never_again(app, admin, csrf_token):
    r = admin.post("/members/tokens", data={"member": "alice", "default_class": "voice", "allow": ["chat", "coding"],
                                            "csrf_token": csrf_token(admin, "/members")})
    assert r.status_code == 201
    assert r.headers["Cache-Control"] == "no-store"
    html = r.get_data(as_text=True)
    token = TOKEN.search(html).group(1)
    assert token.startswith("hth_") and "shown only this once" in html and 'data-copy="token-value"' in html
    row = _token_rows(app)[0]
    assert row.token_hash == hash_token(token) and row.allowed_classes == ["chat", "coding", "voice"]
    # The gateway accepts it.
    assert services(app).tokens.lookup(token).member == "alice"
    # Never again: not on the page, not in any partial.
    again = admin.get("/members").get_data(as_text=True)
    assert token not in again and token[:12] in again and 'id="member-alice"' in again
    assert "token-value" not in again


def test_htmx_create_returns_the_partial(admin, csrf_token):
    r = admin.post("/members/tokens", data={"member": "kitchen-speaker", "default_class": "voice",
                                            "csrf_token": csrf_token(admin, "/members")}, headers={"HX-Request": "true"})
    assert r.status_code == 201
    html = r.get_data(as_text=True)
    assert html.startswith('<div id="members-body">') and "<html" not in html and TOKEN.search(html)


def test_bad_input_is_explained_and_kept(app, admin, csrf_token):
    r = admin.post("/members/tokens", data={"member": "  ", "default_class": "voice", "allow": ["chat"],
                                            "csrf_token": csrf_token(admin, "/members")})
    assert r.status_code == 422
    html = r.get_data(as_text=True)
    assert "Enter who the token is for" in html and "No token was created" in html
    assert re.search(r'value="chat" checked', html)  # the ticked class stays ticked
    r = admin.post("/members/tokens", data={"member": "bob", "default_class": "poetry",
                                            "csrf_token": csrf_token(admin, "/members")})
    assert r.status_code == 422
    assert "unknown class(es) poetry" in r.get_data(as_text=True) and 'value="bob"' in r.get_data(as_text=True)
    assert _token_rows(app) == []


def test_revoke_confirms_then_revokes(app, admin, csrf_token):
    hearth = services(app)
    created = admin.post("/members/tokens", data={"member": "bob", "default_class": "chat",
                                                  "csrf_token": csrf_token(admin, "/members")})
    token = TOKEN.search(created.get_data(as_text=True)).group(1)
    assert hearth.tokens.lookup(token).member == "bob"  # now in the gateway's few-second cache
    row = _token_rows(app)[0]
    # Without JavaScript: a confirmation page first, nothing revoked yet.
    page = admin.post(f"/members/tokens/{row.id}/revoke", data={"csrf_token": csrf_token(admin, "/members")})
    assert page.status_code == 200 and "cannot be undone" in page.get_data(as_text=True)
    assert _token_rows(app)[0].revoked_at is None
    html_form = admin.get("/members").get_data(as_text=True)
    assert "hx-confirm=\"Revoke token" in html_form
    r = admin.post(f"/members/tokens/{row.id}/revoke", data={"confirm": "yes", "csrf_token": csrf_token(admin, "/members")},
                   headers={"HX-Request": "true"})
    assert r.status_code == 200
    html = r.get_data(as_text=True)
    assert "revoked: requests with it are refused" in html and "badge-bad" in html
    assert _token_rows(app)[0].revoked_at is not None
    assert hearth.tokens.lookup(token) is None  # refused at once, not after the cache expires
    assert admin.post("/members/tokens/999/revoke", data={"confirm": "yes",
                                                          "csrf_token": csrf_token(admin, "/members")}).status_code == 404


def test_mutations_need_csrf_and_login(app, admin, client):
    assert admin.post("/members/tokens", data={"member": "eve", "default_class": "chat"}).status_code == 400
    assert _token_rows(app) == []
    assert client.get("/members").status_code == 302
    r = client.post("/members/tokens", data={"member": "eve", "default_class": "chat"}, headers={"HX-Request": "true"})
    assert r.status_code in (400, 401)
    assert _token_rows(app) == []
