"""Where a drafting arm's greedy output left its off arm's: how close the off arm's two likeliest tokens were there.

On a CPU, llama.cpp computes a product of several token rows with other kernels than a one-token decode (its
tinyBLAS takes Q5_0 / Q8_0 products of ≥ 2 rows, `sgemm.cpp: if (n < 2) return false`; vec_dot takes one row),
and they round differently: a verified draft's logits, like those of two family members' tokens decoded together
in one batch, or of a request whose KV cells lie elsewhere in the cache, differ from a lone decode's in the last
digits. Where the model's two likeliest next tokens are that close, greedy output may take either. This module
asks the off arm's target again, with the same prompt and its top two log-probabilities per token, how far apart
the two were at the first character where the outputs part: a near-tie says the drafts were verified right and
the rounding chose; a wide margin would be a drafting bug.
"""

from __future__ import annotations

import httpx

from app.verdict.results import NEAR_TIE_NATS, RunResult, first_difference
from app.verdict.scenarios import PlannedRequest
from app.verdict.spec import OFF, label
from app.verdict.targets import Target

__all__ = ["NEAR_TIE_NATS", "margin_at", "mark_near_ties"]

TOP_N = 5  # candidates asked per token: the drafting arm's token is looked for among them
LOOK_BACK = 3  # off-answer tokens before the first differing character where the choice may have been made


def margin_at(target: Target, req: PlannedRequest, off_text: str, ours_text: str,
              timeout_s: float = 600) -> float | None:
    """How much likelier the off target's token was than the drafting arm's at the token where the outputs part.

    The off arm's answer is asked again with its top log-probabilities per token. The parting token is the last
    of the off answer's tokens that starts at or before the first differing character and where the drafting
    arm's text goes on with another of the candidates (whitespace runs tokenize in pieces: the choice between a
    4-space and an 8-space token starts before the first differing character). None when it cannot say: no
    log-probabilities, its answer this time already differs before that point, or the drafting arm's token was
    not among the candidates returned."""
    at_char = first_difference(ours_text, off_text)
    body = {"model": target.model, "prompt": req.text, "max_tokens": req.max_tokens, "temperature": 0,
            "logprobs": TOP_N, "ignore_eos": True, "cache_prompt": False}
    try:
        r = httpx.post(f"{target.url}/v1/completions", json=body, headers=target.headers or {}, timeout=timeout_s)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        lp = choice.get("logprobs") or {}
        tokens, offsets, tops = lp.get("tokens") or [], lp.get("text_offset") or [], lp.get("top_logprobs") or []
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return None
    if first_difference(choice.get("text") or "", off_text) < at_char or not offsets:
        return None
    last = max((k for k, off in enumerate(offsets) if off <= at_char), default=None)
    if last is None:
        return None
    for k in range(last, max(-1, last - LOOK_BACK), -1):
        start, cands = offsets[k], tops[k] if k < len(tops) else {}
        rest = ours_text[start:]
        theirs = [(t, v) for t, v in (cands or {}).items() if t != tokens[k] and t and rest.startswith(t)]
        if theirs and tokens[k] in cands:
            return float(cands[tokens[k]] - max(v for _, v in theirs))
    return None


def mark_near_ties(runs: list[RunResult], targets: list[Target], planned: list[PlannedRequest]) -> None:
    """For every Hearth drafting run whose output differs from its off arm's, note each such request's margin in
    its summary["near_ties"] (idx → nats, None: could not say). Stock llama-server's arms are left alone."""
    by_label = {t.label: t for t in targets}
    requests = {req.idx: req for req in planned}
    off_outputs: dict[str, dict[str, str]] = {}
    for run in runs:
        if run.arm == OFF:
            off_outputs.setdefault(run.base, dict(run.summary.get("outputs") or {}))
    for run in runs:
        if run.arm in (None, OFF) or run.base == "llama-server":
            continue
        ref = off_outputs.get(run.base)
        off_target = by_label.get(label(run.base, OFF))
        if not ref or off_target is None:
            continue
        ties: dict[str, float | None] = {}
        for idx, text in (run.summary.get("outputs") or {}).items():
            if idx in ref and text != ref[idx] and int(idx) in requests:
                ties[idx] = margin_at(off_target, requests[int(idx)], ref[idx], text)
        if ties:
            run.summary["near_ties"] = ties
