"""Speculative decoding in telemetry: the runners' draft counters as rates, whether the last iteration drafted,
and a drafting hearth runner's decision in words from /props, read every few seconds (never by a page)."""

from __future__ import annotations

import json

import pytest

from app.residency.manager import ModelState
from app.telemetry.sampler import METRICS, SPEC_PROPS_EVERY_S, RateTracker, SpeculationNotes, sample_runners

SOURCE = "runner:gemma@local"
BLOCK = {"enabled": True, "type": "ngram-lookup", "n_max": 16, "drafting": False,
         "note": "standing aside: 6 sequences decode (drafts above 4 cost the batch)", "acceptance": 0.62,
         "by_class": {"chat": {"drafts": 3, "draft_tokens": 40, "accepted_tokens": 25, "acceptance": 0.625}}}


def metrics_text(drafted: int, accepted: int, enabled: int = 1, drafting: int = 0) -> str:
    """A hearth runner's /metrics, the speculative part."""
    return (f"llamacpp:tokens_predicted_total 10\n"
            f"llamacpp:spec_decode_num_draft_tokens_total {drafted}\n"
            f"llamacpp:spec_decode_num_accepted_tokens_total {accepted}\n"
            f"hearth:spec_enabled {enabled}\nhearth:spec_drafting {drafting}\n")


class Http:
    """Answers /metrics from a list, /props with `props` (an exception is raised), /slots empty; keeps the URLs."""

    def __init__(self, metrics: list[str], props=BLOCK):
        self.metrics = list(metrics)
        self.props = props
        self.urls: list[str] = []

    def __call__(self, url: str, timeout_s: float) -> str:
        self.urls.append(url.rsplit("/", 1)[1])
        if url.endswith("/metrics"):
            return self.metrics.pop(0)
        if url.endswith("/props"):
            if isinstance(self.props, Exception):
                raise self.props
            return json.dumps({"default_generation_settings": {}, "speculative": self.props})
        return "[]"


def status():
    return [{"name": "gemma", "state": ModelState.READY,
             "nodes": [{"label": "local", "url": "http://127.0.0.1:9001", "healthy": True}]}]


def test_draft_counters_become_rates_and_drafting_a_gauge():
    http, rates, notes = Http([metrics_text(100, 60), metrics_text(140, 90, drafting=1)]), RateTracker(), SpeculationNotes()
    first = {(s, m): v for s, m, v in sample_runners(status(), http, rates, 0.0, speculation=notes)}
    assert first[(SOURCE, "spec_drafting")] == 0
    second = {(s, m): v for s, m, v in sample_runners(status(), http, rates, 2.0, speculation=notes)}
    assert second[(SOURCE, "spec_draft_tok_s")] == pytest.approx(20.0)
    assert second[(SOURCE, "spec_accepted_tok_s")] == pytest.approx(15.0)
    assert second[(SOURCE, "spec_drafting")] == 1
    assert {"spec_draft_tok_s", "spec_accepted_tok_s", "spec_drafting"} <= METRICS.keys()


def test_props_is_read_every_few_seconds_and_only_where_drafting_is_configured():
    http, notes = Http([metrics_text(0, 0)] * 4), SpeculationNotes()
    for now in (0.0, 1.0, SPEC_PROPS_EVERY_S - 0.5, SPEC_PROPS_EVERY_S):
        sample_runners(status(), http, RateTracker(), now, speculation=notes)
    assert http.urls.count("props") == 2
    assert notes.latest() == {SOURCE: BLOCK}
    # A runner without speculation (or a stock llama-server, which has no hearth:spec_enabled) is never asked.
    plain = Http([metrics_text(0, 0, enabled=0), "llamacpp:tokens_predicted_total 1\n"])
    for now in (0.0, 10.0):
        sample_runners(status(), plain, RateTracker(), now, speculation=notes)
    assert "props" not in plain.urls
    assert notes.latest() == {}  # the runner no longer drafts: its old note goes


def test_a_failed_props_read_keeps_the_last_note_and_waits_its_turn():
    notes = SpeculationNotes()
    sample_runners(status(), Http([metrics_text(0, 0)]), RateTracker(), 0.0, speculation=notes)
    failing = Http([metrics_text(0, 0)] * 2, props=OSError("timed out"))
    sample_runners(status(), failing, RateTracker(), SPEC_PROPS_EVERY_S, speculation=notes)
    sample_runners(status(), failing, RateTracker(), SPEC_PROPS_EVERY_S + 1, speculation=notes)
    assert failing.urls.count("props") == 1
    assert notes.latest() == {SOURCE: BLOCK}
    # The model unloaded: nothing is scraped and its note is dropped.
    sample_runners([], Http([]), RateTracker(), 20.0, speculation=notes)
    assert notes.latest() == {}
