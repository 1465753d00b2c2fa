"""Refusals at admission: counted per minute, member, class and reason instead of one request row each, and
answered 429 with Retry-After in each API's error shape, naming the limit and how to raise it."""

from sqlalchemy import text, update

from app.gateway.context import services
from app.gateway.members import Quota
from app.gateway.refusals import MINUTE_S
from app.store.models import Member, RequestClass

HELLO = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
FLOOD = 2000


def _set_class(app, name: str, **values) -> None:
    svc = services(app)
    with svc.sessions() as s:
        s.execute(update(RequestClass).where(RequestClass.name == name).values(**values))
        s.commit()
    svc.classes.invalidate()


def _rows(app, table: str) -> int:
    with services(app).sessions() as s:
        return s.execute(text(f"SELECT count(*) FROM {table}")).scalar()


def test_a_flood_of_refusals_grows_the_store_by_at_most_one_row_per_thousand(gateway_app, make_token):
    svc = services(gateway_app)
    _set_class(gateway_app, "chat", max_concurrent=1, max_queue=0)
    held = svc.admission.admit(svc.classes.get("chat"), "someone", Quota(1, 0))  # the class's one place
    headers = make_token("script")
    client = gateway_app.test_client()
    svc.writer.flush()
    before = {t: _rows(gateway_app, t) for t in ("requests", "refusals", "members", "residency_events")}
    for _ in range(FLOOD):
        r = client.post("/v1/chat/completions", json=HELLO, headers=headers)
        assert r.status_code == 429, r.text
    assert r.headers["Retry-After"] == "1"
    err = r.json["error"]
    assert (err["type"], err["code"]) == ("rate_limit_error", "queue_full")
    assert "class 'chat' already has 1 requests running and 0 waiting" in err["message"]
    svc.refusals.flush()
    assert svc.writer.flush(timeout_s=10)
    grown = sum(_rows(gateway_app, t) - n for t, n in before.items())
    # One row per minute the flood lasted (two if it crossed a minute's start); none per request.
    assert grown <= FLOOD // 1000, grown
    with svc.sessions() as s:
        counted = s.execute(text("SELECT member_name, class_name, reason, sum(count) FROM refusals GROUP BY 1, 2, 3")).all()
    assert counted == [("script", "chat", "class_queue_full", FLOOD)]
    assert _rows(gateway_app, "requests") == 0
    # /metrics counts them as rejected requests of their class.
    assert svc.metrics.requests.labels("chat", "unknown", "rejected")._value.get() == FLOOD
    svc.admission.release(held)


def test_a_flush_adds_to_the_minutes_count(gateway_app):
    svc = services(gateway_app)
    clock = [1_000_000 * MINUTE_S + 5.0]
    svc.refusals.clock = lambda: clock[0]
    for _ in range(3):
        svc.refusals.count("kid", "voice", "member_queue_full")
    svc.refusals.flush()
    svc.refusals.count("kid", "voice", "member_queue_full")
    assert svc.refusals.flush() == 1
    clock[0] += MINUTE_S
    svc.refusals.count("kid", "voice", "member_queue_full")
    svc.refusals.flush()
    assert svc.writer.flush(timeout_s=10)
    with svc.sessions() as s:
        rows = s.execute(text("SELECT bucket, count FROM refusals ORDER BY bucket")).all()
        assert rows == [(1_000_000 * MINUTE_S, 4), (1_000_001 * MINUTE_S, 1)]
        assert svc.refusals.recent(s, 1_000_000 * MINUTE_S) == {"kid": {"member_queue_full": 5}}


def test_a_members_rate_limit_is_a_429_naming_it_in_openai_and_ollama_shapes(gateway_app, make_token):
    svc = services(gateway_app)
    headers = make_token("kid")
    with svc.sessions() as s:
        s.execute(update(Member).where(Member.name == "kid").values(max_requests_per_min=2))
        s.commit()
    svc.forget_members()
    # Two requests start (and fail later, at the stand-in model's runner): the third is refused.
    svc.usage.check_and_count("kid", {})
    svc.usage.check_and_count("kid", {})
    client = gateway_app.test_client()
    r = client.post("/v1/chat/completions", json=HELLO, headers=headers)
    assert r.status_code == 429, r.text
    assert 1 <= int(r.headers["Retry-After"]) <= 61
    err = r.json["error"]
    assert (err["type"], err["code"]) == ("rate_limit_error", "member_rate_limited")
    assert "member 'kid' has reached their limit of 2 requests per minute (max_requests_per_min" in err["message"]
    assert "Members page" in err["message"]
    r = client.post("/api/chat", json={"model": "gemma-3-270m-q4_k_m", **HELLO}, headers=headers)
    assert r.status_code == 429 and "Retry-After" in r.headers
    assert set(r.json) == {"error"} and "max_requests_per_min" in r.json["error"]
    assert svc.refusals.pending().popitem()[0][1:] == ("kid", "chat", "max_requests_per_min")


def test_a_member_at_their_share_is_refused_while_another_member_is_served(gateway_app, make_token):
    svc = services(gateway_app)
    _set_class(gateway_app, "chat", max_concurrent=4, max_queue=0)
    policy = svc.classes.get("chat")
    # The script already holds its share: two of chat's four places.
    held = [svc.admission.admit(policy, "script", Quota(2, 0)) for _ in range(2)]
    client = gateway_app.test_client()
    r = client.post("/v1/chat/completions", json=HELLO, headers=make_token("script"))
    assert r.status_code == 429 and r.json["error"]["code"] == "member_queue_full"
    assert "their share of the class (setting member_class_share): max_concurrent 2, max_queue 0" in \
        r.json["error"]["message"]
    # Alice's request is admitted (it goes on to the runner, which the stand-in model cannot start).
    r = client.post("/v1/chat/completions", json=HELLO, headers=make_token("alice"))
    assert r.status_code != 429, r.text
    for t in held:
        svc.admission.release(t)


def test_n_choices_beyond_the_members_places_are_refused_naming_the_limit_and_counted(gateway_app, make_token):
    svc = services(gateway_app)
    client = gateway_app.test_client()
    # chat runs 4 at once by default and a member holds half: n 8 would take 8 of a runner's slots.
    r = client.post("/v1/chat/completions", json={**HELLO, "n": 8}, headers=make_token("script"))
    assert r.status_code == 400, r.text
    err = r.json["error"]
    assert (err["param"], err["code"]) == ("n", "n_above_limit")
    assert "'n': 8 choices take 8 places and member 'script' may hold 2 running places in class 'chat'" in \
        err["message"]
    assert "ask for at most 2 choices" in err["message"]
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "n": 3}, headers=make_token("script"))
    assert r.status_code == 400 and r.json["error"]["code"] == "n_above_limit"
    assert svc.admission.snapshot()["chat"]["in_flight"] == 0
    # Refusals by reason on /metrics, as README says.
    svc.refusals.count("kid", "voice", "member_queue_full")
    metrics = client.get("/metrics").get_data(as_text=True)
    assert 'hearth:gateway_refusals_total{class="chat",reason="too_many_choices"} 2.0' in metrics
    assert 'hearth:gateway_refusals_total{class="voice",reason="member_queue_full"} 1.0' in metrics
