"""Seeding the default request classes."""

from sqlalchemy import select

from app.store.models import RequestClass
from app.store.seed import DEFAULT_CLASSES, seed_defaults


def _classes(sessions):
    with sessions() as session:
        return {c.name: c for c in session.scalars(select(RequestClass))}


def test_seeds_the_five_default_classes(sessions):
    with sessions() as session:
        assert seed_defaults(session) == ["voice", "chat", "documents", "coding", "background"]
        session.commit()
    classes = _classes(sessions)
    voice = classes["voice"]
    assert (voice.priority, voice.ttft_target_ms, voice.tpot_target_ms) == (0, 500, 100)
    assert (voice.default_max_tokens, voice.max_output_tokens) == (128, 256)
    assert (voice.max_concurrent, voice.max_queue, voice.weight) == (8, 16, 4.0)
    assert (voice.preemptible, voice.queue_timeout_s, voice.default_model) == (False, 10.0, None)
    background = classes["background"]
    assert (background.max_queue, background.preemptible, background.queue_timeout_s) == (256, True, 600.0)
    assert {name: c.priority for name, c in classes.items()} == {
        "voice": 0, "chat": 1, "coding": 1, "documents": 2, "background": 3,
    }


def test_seeding_again_changes_nothing(sessions):
    with sessions() as session:
        seed_defaults(session)
        session.commit()
    with sessions() as session:
        assert seed_defaults(session) == []
        session.commit()
    assert len(_classes(sessions)) == len(DEFAULT_CLASSES)


def test_seeding_never_overwrites_edits_or_revives_deleted_classes(sessions):
    with sessions() as session:
        seed_defaults(session)
        session.commit()
    with sessions() as session:
        session.get(RequestClass, "voice").ttft_target_ms = 300
        session.delete(session.get(RequestClass, "coding"))
        session.commit()
    with sessions() as session:
        assert seed_defaults(session) == []
        session.commit()
    classes = _classes(sessions)
    assert classes["voice"].ttft_target_ms == 300
    assert "coding" not in classes


def test_a_class_created_before_seeding_is_kept_as_is(sessions):
    with sessions() as session:
        session.add(RequestClass(**{**DEFAULT_CLASSES[1], "max_concurrent": 9}))
        session.commit()
    with sessions() as session:
        assert "chat" not in seed_defaults(session)
        session.commit()
    assert _classes(sessions)["chat"].max_concurrent == 9
