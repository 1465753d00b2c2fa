"""The Bench page charts the last `hearth bench voice-loop` left in the data folder: each phase's stages as shares
of a bar, with their p50 and p95; nothing when no run has been left."""

from __future__ import annotations

import json

from app.gateway.context import services

STAGES = {"speech_to_transcript": 600, "transcript_to_first_token": 200, "first_token_to_first_sentence": 900,
          "first_sentence_to_first_audio": 300, "speech_to_first_audio": 2000}


def _phase(scale: float) -> dict:
    return {k: {"n": 5, "p50_ms": v * scale, "p95_ms": v * scale * 1.5, "max_ms": v * 2} for k, v in STAGES.items()}


def test_no_voice_loop_section_without_a_run(app, admin):
    assert 'id="voice-loop"' not in admin.get("/bench").get_data(as_text=True)


def test_the_last_voice_loop_is_charted_stage_by_stage(app, admin):
    path = services(app).data_dir / "bench" / "voice-loop.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"alone": _phase(1.0), "background": _phase(2.0), "machine": "x86_64, 2 CPUs",
                                "at": "2026-12-06 09:30 UTC"}))
    html = admin.get("/bench").get_data(as_text=True)
    section = html[html.index('id="voice-loop"'):]
    assert "end of speech → first audio p50 2,000 ms, p95 3,000 ms" in section
    assert "end of speech → first audio p50 4,000 ms" in section
    # The LLM's first sentence holds 900 of the 2,000 ms: 45 % of the bar.
    assert 'data-stage="first_token_to_first_sentence"' in section and "width:45.0%" in section
    assert "first sentence to first audio" in section and "x86_64, 2 CPUs" in section
