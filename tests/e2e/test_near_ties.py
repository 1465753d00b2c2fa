"""How close a call was where a drafting arm's greedy output left its off arm's (app.verdict.ties), asked of a real
runner over loopback HTTP: the gap between its two likeliest tokens at that character, as its own native API says."""

from __future__ import annotations

import math

from app.verdict.results import RunResult
from app.verdict.scenarios import PlannedRequest
from app.verdict.targets import Target
from app.verdict.ties import margin_at, mark_near_ties

PROMPT = "The three primary colours of light are"
MAX_TOKENS = 12


def _target(runner) -> Target:
    return Target("continuous+off", runner.url, "hearth", "gemma")


def _request() -> PlannedRequest:
    return PlannedRequest(idx=0, class_name="chat", at_s=0.0, text=PROMPT, prompt_tokens=8, max_tokens=MAX_TOKENS)


def _greedy(runner) -> str:
    r = runner.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                    "ignore_eos": True, "cache_prompt": False})
    return r.json()["choices"][0]["text"]


def _native_gaps(runner) -> list[tuple[int, float]]:
    """(text offset, top-1 minus top-2 log-probability) of each generated token, from /completion's n_probs."""
    r = runner.client.post("/completion", json={"prompt": PROMPT, "n_predict": MAX_TOKENS, "temperature": 0,
                                                "ignore_eos": True, "cache_prompt": False, "n_probs": 2})
    out, pos = [], 0
    for entry in r.json()["completion_probabilities"]:
        tops = sorted((t["logprob"] for t in entry["top_logprobs"]), reverse=True)
        out.append((pos, tops[0] - tops[1]))
        pos += len(entry["token"])
    return out


def test_the_margin_is_the_gap_between_the_two_likeliest_tokens_at_that_character(runner):
    off = _greedy(runner)
    gaps = _native_gaps(runner)
    offset, gap = gaps[3]  # the fourth token's first character
    margin = margin_at(_target(runner), _request(), off, offset)
    assert margin is not None and margin >= 0
    assert math.isclose(margin, gap, abs_tol=1e-3)


def test_no_margin_when_the_off_arm_answers_otherwise_this_time(runner):
    off = _greedy(runner)
    assert margin_at(_target(runner), _request(), "x" + off[1:], 5) is None


def test_only_the_requests_that_differ_get_a_margin(runner):
    off = _greedy(runner)
    changed = off[:6] + ("#" if off[6] != "#" else "%") + off[7:]
    runs = [RunResult("continuous+off", "hearth", 1, [], [], {"outputs": {"0": off, "1": off}}),
            RunResult("continuous+ngram-lookup", "hearth", 1, [], [], {"outputs": {"0": changed, "1": off}})]
    requests = [_request(), PlannedRequest(1, "chat", 0.0, PROMPT, 8, MAX_TOKENS)]
    mark_near_ties(runs, [_target(runner)], requests)
    ties = runs[1].summary["near_ties"]
    assert list(ties) == ["0"] and ties["0"] is not None and ties["0"] >= 0
    assert "near_ties" not in runs[0].summary
