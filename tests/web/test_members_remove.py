"""Removing a member on the Members page: their tokens stop working, the people behind their trusted tokens go
with them, the request log keeps their rows' figures without their name or error text, and their KV disk-tier
entries (the runners' cached prompts, which know whose they are) are deleted; another member's stay."""

from datetime import UTC, datetime

from sqlalchemy import select

from app.engine.kv_tiers import DiskTier, SavedPrefix, entry_owner
from app.gateway.context import services
from app.gateway.tokens import create_token
from app.store.models import ApiToken, Member, Refusal, RequestRecord

KEY = {"format": 1, "model": "m.gguf", "size": 1, "mtime_ns": 1, "template_sha256": "t"}


def _kv_entry(root, tokens, owner):
    disk = DiskTier(root, KEY, max_bytes=None)
    disk.submit(SavedPrefix(tokens, len(tokens), [bytearray(64)], 0.0, owner))
    assert disk.flush()
    disk.close()


def _row(s, member, error=None):
    s.add(RequestRecord(arrival_at=datetime.now(UTC), member_name=member, class_name="chat", status="ok",
                        prompt_tokens=5, completion_tokens=7, error=error))


def test_removing_a_member_removes_their_tokens_people_log_text_and_cached_prompts(app, admin, csrf_token):
    svc = services(app)
    with svc.sessions() as s:
        alice_token, _ = create_token(s, "alice", "chat", trust_user_headers=True)
        bob_token, _ = create_token(s, "bob", "chat")
        alice = s.scalars(select(Member).where(Member.name == "alice")).one()
        s.add(Member(name="alice/Kid", parent_id=alice.id, external_id="k1"))
        _row(s, "alice", error="the runner said: my secret diary entry was too long")
        _row(s, "alice/Kid")
        _row(s, "bob", error="bob's own error")
        s.add(Refusal(bucket=60, member_name="alice", class_name="chat", reason="member_quota", count=2))
        s.commit()
        alice_id = alice.id
    kv = svc.data_dir / "kv-cache"
    _kv_entry(kv, list(range(100, 140)), "alice")
    _kv_entry(kv, list(range(200, 240)), "alice/Kid")
    _kv_entry(kv, list(range(300, 340)), "bob")
    assert svc.tokens.lookup(alice_token) is not None

    # Without JavaScript, a confirmation page first; nothing is removed yet.
    page = admin.post(f"/members/{alice_id}/remove", data={"csrf_token": csrf_token(admin, "/members")})
    assert page.status_code == 200 and "Remove alice" in page.get_data(as_text=True)
    with svc.sessions() as s:
        assert s.scalar(select(Member).where(Member.name == "alice")) is not None

    r = admin.post(f"/members/{alice_id}/remove", data={"confirm": "yes", "csrf_token": csrf_token(admin, "/members")})
    assert r.status_code == 200
    html = r.get_data(as_text=True)
    assert "alice removed, 1 people behind their tokens" in html and "2 of their cached prompts" in html
    with svc.sessions() as s:
        assert sorted(s.scalars(select(Member.name))) == ["bob"]
        assert [t.member_id for t in s.scalars(select(ApiToken))] == [s.scalar(select(Member.id))]  # bob's alone
        rows = s.execute(select(RequestRecord.member_name, RequestRecord.error, RequestRecord.completion_tokens)).all()
        assert sorted(rows, key=str) == sorted([(None, None, 7), (None, None, 7), ("bob", "bob's own error", 7)], key=str)
        assert s.scalars(select(Refusal)).all() == []
    assert svc.tokens.lookup(alice_token) is None and svc.tokens.lookup(bob_token) is not None
    owners = [entry_owner(p) for p in kv.glob("*/*.kv")]
    assert owners == ["bob"]


def test_removing_an_unknown_member_is_a_404(admin, csrf_token):
    r = admin.post("/members/999/remove", data={"confirm": "yes", "csrf_token": csrf_token(admin, "/members")})
    assert r.status_code == 404 and "no member with id 999" in r.get_data(as_text=True)


def test_the_members_page_offers_removal(app, admin):
    with services(app).sessions() as s:
        create_token(s, "alice", "chat")
    html = admin.get("/members").get_data(as_text=True)
    assert "Remove alice" in html and "/remove" in html


def test_serve_s_hourly_job_deletes_what_a_runner_wrote_for_a_removed_member(app):
    """A runner may write a removed member's prefix after the removal (a request still in flight, a copy in memory):
    the expire_kv_cache job deletes the entries of owners the store no longer has (the LAN's and untagged stay)."""
    svc = services(app)
    with svc.sessions() as s:
        create_token(s, "bob", "chat")
    kv = svc.data_dir / "kv-cache"
    for i, owner in enumerate(("bob", "ghost", "lan", None)):
        _kv_entry(kv, list(range(100 * i + 100, 100 * i + 140)), owner)
    assert svc.catalog.expire_kv_cache() == 1
    assert sorted(str(entry_owner(p)) for p in kv.glob("*/*.kv")) == ["None", "bob", "lan"]
