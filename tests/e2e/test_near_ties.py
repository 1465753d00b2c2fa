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


def _native(runner) -> list[tuple[int, list[tuple[str, float]]]]:
    """(text offset, [(token text, log-probability)] likeliest first) of each generated token, from /completion."""
    r = runner.client.post("/completion", json={"prompt": PROMPT, "n_predict": MAX_TOKENS, "temperature": 0,
                                                "ignore_eos": True, "cache_prompt": False, "n_probs": 3})
    out, pos = [], 0
    for entry in r.json()["completion_probabilities"]:
        tops = sorted(((t["token"], t["logprob"]) for t in entry["top_logprobs"]), key=lambda x: -x[1])
        out.append((pos, tops))
        pos += len(entry["token"])
    return out


def test_the_margin_is_how_much_likelier_the_off_token_was_than_the_one_taken_instead(runner):
    off = _greedy(runner)
    native = _native(runner)
    k = next(i for i, (_, tops) in enumerate(native) if i >= 2 and tops[1][0] and not tops[0][0].startswith(tops[1][0])
             and not tops[1][0].startswith(tops[0][0]))
    offset, tops = native[k]
    ours = off[:offset] + tops[1][0] + " and so on"  # the second candidate taken at token k
    margin = margin_at(_target(runner), _request(), off, ours)
    assert margin is not None and margin >= 0
    assert math.isclose(margin, tops[0][1] - tops[1][1], abs_tol=1e-3)


def test_no_margin_when_the_off_arm_answers_otherwise_this_time(runner):
    off = _greedy(runner)
    assert margin_at(_target(runner), _request(), "x" + off[1:], "x" + off[1:5] + "#") is None


def test_no_margin_when_the_token_taken_is_none_of_the_candidates(runner):
    off = _greedy(runner)
    assert margin_at(_target(runner), _request(), off, off[:4] + "\u2603\u2603\u2603") is None


def test_only_the_requests_that_differ_get_a_margin(runner):
    off = _greedy(runner)
    native = _native(runner)
    changed = off[:native[2][0]] + native[2][1][1][0] + " etc"
    runs = [RunResult("continuous+off", "hearth", 1, [], [], {"outputs": {"0": off, "1": off}}),
            RunResult("continuous+ngram-lookup", "hearth", 1, [], [], {"outputs": {"0": changed, "1": off}})]
    requests = [_request(), PlannedRequest(1, "chat", 0.0, PROMPT, 8, MAX_TOKENS)]
    mark_near_ties(runs, [_target(runner)], requests)
    ties = runs[1].summary["near_ties"]
    assert list(ties) == ["0"]
    assert math.isclose(ties["0"], native[2][1][0][1] - native[2][1][1][1], abs_tol=1e-3)
    assert "near_ties" not in runs[0].summary
