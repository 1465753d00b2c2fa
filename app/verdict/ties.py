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


def margin_at(target: Target, req: PlannedRequest, off_text: str, at_char: int, timeout_s: float = 600) -> float | None:
    """The off target's top-1 minus top-2 log-probability at the token holding character at_char of its output.

    None when it cannot say: no log-probabilities, or its output this time already differs before at_char."""
    body = {"model": target.model, "prompt": req.text, "max_tokens": req.max_tokens, "temperature": 0,
            "logprobs": 2, "ignore_eos": True, "cache_prompt": False}
    try:
        r = httpx.post(f"{target.url}/v1/completions", json=body, headers=target.headers or {}, timeout=timeout_s)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        lp = choice.get("logprobs") or {}
        offsets, tops = lp.get("text_offset") or [], lp.get("top_logprobs") or []
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return None
    text = choice.get("text") or ""
    if first_difference(text, off_text) < at_char or not offsets:
        return None
    i = max((k for k, off in enumerate(offsets) if off <= at_char), default=None)
    if i is None or i >= len(tops) or len(tops[i] or {}) < 2:
        return None
    best = sorted(tops[i].values(), reverse=True)
    return float(best[0] - best[1])


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
                ties[idx] = margin_at(off_target, requests[int(idx)], ref[idx], first_difference(text, ref[idx]))
        if ties:
            run.summary["near_ties"] = ties
