"""Trusted user headers: a token the admin trusts to name its users makes the person behind each request the
member (their own limits and rows); any other token's headers are ignored."""

from sqlalchemy import select, update

from app.gateway import people as people_module
from app.gateway.context import services
from app.gateway.members import Quota
from app.gateway.people import USER_ID_HEADER, USER_NAME_HEADER, clean
from app.store.models import Member, RequestClass, RequestRecord

HELLO = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
BOB = {USER_ID_HEADER: "7c1e-bob", USER_NAME_HEADER: "Bob", "X-OpenWebUI-User-Email": "bob@example.org",
       "X-OpenWebUI-User-Role": "user"}


def _members(app) -> list[tuple]:
    svc = services(app)
    assert svc.writer.flush(timeout_s=10)
    with svc.sessions() as s:
        parents = {m.id: m.name for m in s.scalars(select(Member))}
        return sorted((m.name, parents.get(m.parent_id), m.external_id) for m in s.scalars(select(Member)))


def _requests(app) -> list[tuple]:
    svc = services(app)
    assert svc.writer.flush(timeout_s=10)
    with svc.sessions() as s:
        return [tuple(r) for r in s.execute(select(RequestRecord.member_name, RequestRecord.status)
                                            .order_by(RequestRecord.id))]


def test_a_trusted_token_makes_the_person_the_member(gateway_app, make_token):
    headers = make_token("openwebui", trust_user_headers=True)
    client = gateway_app.test_client()
    client.post("/v1/chat/completions", json=HELLO, headers={**headers, **BOB})
    # The person is a member of their own under the token's member; no e-mail or role is stored.
    assert _members(gateway_app) == [("openwebui", None, None), ("openwebui/Bob", "openwebui", "7c1e-bob")]
    assert [m for m, _ in _requests(gateway_app)] == ["openwebui/Bob"]
    # Seen again (after the cache): the same member, read from the store.
    services(gateway_app).forget_members()
    client.post("/v1/chat/completions", json=HELLO, headers={**headers, **BOB})
    # Another person of the same name is told apart by their id; no header at all is the token's member.
    client.post("/v1/chat/completions", json=HELLO, headers={**headers, USER_ID_HEADER: "99aa", USER_NAME_HEADER: "Bob"})
    client.post("/v1/chat/completions", json=HELLO, headers=headers)
    assert _members(gateway_app) == [("openwebui", None, None), ("openwebui/Bob", "openwebui", "7c1e-bob"),
                                     ("openwebui/Bob#99aa", "openwebui", "99aa")]
    assert [m for m, _ in _requests(gateway_app)] == ["openwebui/Bob", "openwebui/Bob", "openwebui/Bob#99aa",
                                                      "openwebui"]


def test_an_untrusted_tokens_headers_are_ignored(gateway_app, make_token):
    client = gateway_app.test_client()
    client.post("/v1/chat/completions", json=HELLO, headers={**make_token("kid"), **BOB})
    assert _members(gateway_app) == [("kid", None, None)]
    assert [m for m, _ in _requests(gateway_app)] == ["kid"]


def test_each_person_has_their_own_share_of_a_class(gateway_app, make_token):
    svc = services(gateway_app)
    with svc.sessions() as s:
        s.execute(update(RequestClass).where(RequestClass.name == "chat").values(max_concurrent=4, max_queue=0))
        s.commit()
    svc.classes.invalidate()
    headers = make_token("openwebui", trust_user_headers=True)
    client = gateway_app.test_client()
    client.post("/v1/chat/completions", json=HELLO, headers={**headers, **BOB})  # Bob is now a member
    held = [svc.admission.admit(svc.classes.get("chat"), "openwebui/Bob", Quota(2, 0)) for _ in range(2)]
    r = client.post("/v1/chat/completions", json=HELLO, headers={**headers, **BOB})
    assert r.status_code == 429 and "member 'openwebui/Bob'" in r.json["error"]["message"]
    # Carol, behind the same token, is not held up by Bob's share.
    r = client.post("/v1/chat/completions", json=HELLO, headers={**headers, USER_ID_HEADER: "c4", USER_NAME_HEADER: "Carol"})
    assert r.status_code != 429, r.text
    for t in held:
        svc.admission.release(t)


def test_a_member_has_at_most_so_many_people(gateway_app, make_token, monkeypatch):
    monkeypatch.setattr(people_module, "MAX_PEOPLE_PER_MEMBER", 2)
    headers = make_token("openwebui", trust_user_headers=True)
    client = gateway_app.test_client()
    for i in range(4):
        client.post("/v1/chat/completions", json=HELLO, headers={**headers, USER_ID_HEADER: f"id{i}"})
        services(gateway_app).writer.flush(timeout_s=10)
    assert [m for m, _ in _requests(gateway_app)] == ["openwebui/id0", "openwebui/id1", "openwebui", "openwebui"]


def test_header_values_become_safe_names():
    assert clean(" Ann\x00\r\n  Marie/Sky ", 48) == "Ann Marie-Sky"
    assert clean("x" * 100, 48) == "x" * 48
    assert clean(None, 48) == ""
