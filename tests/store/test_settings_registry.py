"""The settings registry: every entry's kind, bounds and section; one validate; stored junk read as the default."""

import pytest
from sqlalchemy import insert

from app.store.models import Setting, utcnow
from app.store.seed import seed_defaults
from app.store.settings import (
    REGISTRY,
    SECTIONS,
    Invalid,
    UnknownSetting,
    conflicts,
    get_setting,
    run_time_choices,
    set_setting,
    validate,
)


def test_every_entry_says_how_it_is_checked_and_shown():
    for name, d in REGISTRY.items():
        assert d.kind in ("int", "float", "bool", "str", "path", "choice"), name
        assert d.section in SECTIONS and d.label and d.help, name
        if d.kind in ("int", "float"):
            assert d.minimum is not None and d.maximum is not None and d.minimum <= d.maximum, name
        # The default itself keeps the rules.
        assert validate(name, d.default) == (None if d.default is None else d.default), name


@pytest.mark.parametrize(("name", "raw", "value"), [
    ("runner_ctx", "256", 256), ("runner_ctx", " 4096 ", 4096), ("samples_retention_h", "1.5", 1.5),
    ("status_public", "on", True), ("status_public", "No", False), ("proxy_hops", "0", 0),
    ("bind", "[::1]:8080", "[::1]:8080"), ("runner_threads", "", None), ("runner_ctx", 512, 512),
])
def test_validate_reads_text_by_kind(name, raw, value):
    assert validate(name, raw) == value


@pytest.mark.parametrize(("name", "raw", "message"), [
    ("runner_ctx", "8", "runner_ctx must be at least 256 (got 8)"),
    ("runner_ctx", True, "runner_ctx must be a whole number (got True)"),
    ("max_in_flight_total", "abc", "max_in_flight_total must be a whole number (got abc)"),
    ("max_in_flight_total", "0", "max_in_flight_total must be at least 1 (got 0)"),
    ("runner_batch", "16", "runner_batch must be at least 32 (got 16)"),
    ("samples_retention_h", "nan", "samples_retention_h must be a number (got nan)"),
    ("bind", "localhost:0", "bind must be host:port"),
])
def test_validate_names_the_bound(name, raw, message):
    with pytest.raises(Invalid) as caught:
        validate(name, raw)
    assert str(caught.value).startswith(message)


def test_choices_known_at_run_time_are_the_callers(sessions):
    with sessions() as s:
        seed_defaults(s)
        s.commit()
        classes = run_time_choices(s, "api_open_class")
        assert run_time_choices(s, "default_model") == set()  # nothing catalogued yet
    assert {"voice", "chat", "background"} <= classes
    assert validate("api_open_class", "voice", classes) == "voice"
    with pytest.raises(Invalid, match="api_open_class must be one of: .*voice"):
        validate("api_open_class", "poetry", classes)
    with sessions() as s:
        assert run_time_choices(s, "runner_ctx") is None


def test_settings_checked_together():
    assert conflicts({}) == {}
    assert "runner_batch must be at least runner_parallel (64)" in conflicts({"runner_parallel": 64, "runner_batch": 32})["runner_batch"]
    assert conflicts({"runner_parallel": 64, "runner_batch": None}) == {}  # the default batch, 512


def test_set_setting_refuses_what_validate_refuses(sessions):
    with sessions() as s:
        with pytest.raises(Invalid, match="at least 256"):
            set_setting(s, "runner_ctx", 8)
        with pytest.raises(UnknownSetting):
            set_setting(s, "colour", "blue")
        set_setting(s, "runner_ctx", 1024)
        s.commit()
        assert get_setting(s, "runner_ctx") == 1024


def test_a_stored_value_that_breaks_the_bounds_reads_as_the_default_with_a_warning(sessions, caplog):
    """What older versions stored without checks must not keep `hearth serve` or its runners from starting."""
    with sessions() as s:
        s.execute(insert(Setting), [{"key": "max_in_flight_total", "value": "abc", "updated_at": utcnow()},
                                    {"key": "runner_ctx", "value": 8, "updated_at": utcnow()},
                                    {"key": "runner_parallel", "value": "2", "updated_at": utcnow()}])
        s.commit()
        with caplog.at_level("WARNING", logger="app.store.settings"):
            for _ in range(2):
                assert get_setting(s, "max_in_flight_total") == 64
                assert get_setting(s, "runner_ctx") is None  # the default: sized from the memory budget
        assert get_setting(s, "runner_parallel") == 2  # text of a number is still the number
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2  # once per stored value, not at every read
    assert "max_in_flight_total must be a whole number (got abc)" in warnings[0]
    assert "runner_ctx must be at least 256 (got 8)" in warnings[1]
