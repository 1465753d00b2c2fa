"""A request body's sampling settings, with the runner's defaults, and llama-server's `generation_settings` of them."""

from __future__ import annotations

import dataclasses
import math
import re

from app.engine.grammar import Grammar
from app.engine.request import SamplingParams
from app.protocols.openai import ApiError
from app.runner.state import RunnerState


def sampling_params(body, max_tokens: int) -> SamplingParams:
    """The engine's sampling settings named by a request body (chat, completion, native or infill)."""
    return SamplingParams(
        max_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p,
        seed=body.seed, repeat_penalty=body.repeat_penalty, repeat_last_n=body.repeat_last_n,
        frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty, stop=body.stops(),
        ignore_eos=body.ignore_eos, speculative_n_max=getattr(body, "speculative_n_max", None),
    )


def request_params(state: RunnerState, body, n_prompt: int, grammar: Grammar | None,
                   logprobs: int | None) -> SamplingParams:
    """The engine's sampling settings of a request, with the runner's defaults (-n: a limit for requests naming none)."""
    cfg = state.config
    room = max(1, state.model.n_ctx - n_prompt)
    requested = getattr(body, "max_completion_tokens", None) or body.requested_max_tokens
    # As llama-server: a request's own limit wins over -n, which only fills in for requests naming none.
    limit = requested or cfg.default_max_tokens or room
    params = dataclasses.replace(sampling_params(body, limit), max_tokens=limit, grammar=grammar, logprobs=logprobs,
                                 logit_bias=logit_bias(state.model, body.logit_bias))
    given = body.model_fields_set
    if "temperature" not in given and cfg.default_temperature is not None:
        params = dataclasses.replace(params, temperature=cfg.default_temperature)
    if ("seed" not in given or body.seed == -1) and cfg.default_seed is not None:
        params = dataclasses.replace(params, seed=cfg.default_seed)
    elif body.seed == -1:
        params = dataclasses.replace(params, seed=None)
    return params


def logit_bias(model, raw) -> tuple[tuple[int, float], ...]:
    """logit_bias in OpenAI's ({id: bias}) or llama-server's ([[id or text, bias or false]]) form."""
    if not raw:
        return ()
    pairs = raw.items() if isinstance(raw, dict) else [tuple(p) for p in raw]
    out: dict[int, float] = {}
    for pair in pairs:
        if len(pair) != 2:
            raise ApiError(400, "'logit_bias': each entry is [token, bias]", param="logit_bias")
        key, bias = pair
        value = -math.inf if bias is False else float(bias)
        # A string of ASCII digits is an id (str.isdigit() also holds for '²', which int() refuses).
        if isinstance(key, str) and not re.fullmatch(r"-?[0-9]+", key):
            # Text: every token of it, as llama-server does.
            ids = model.tokenize(key, add_special=False, parse_special=False)
        else:
            ids = [int(key)]
        for t in ids:
            if not 0 <= t < model.n_vocab:
                raise ApiError(400, f"'logit_bias': token id {t} is outside the vocabulary", param="logit_bias")
            out[t] = value
    return tuple(out.items())


def generation_settings(state: RunnerState, params: SamplingParams | None, n_probs: int = 0,
                        stream: bool = False) -> dict:
    """llama-server's `generation_settings` of a request (None: the runner's defaults)."""
    cfg = state.config
    if params is None:
        params = SamplingParams(max_tokens=cfg.default_max_tokens or -1,
                                temperature=0.8 if cfg.default_temperature is None else cfg.default_temperature,
                                seed=cfg.default_seed)
    return {
        "seed": params.seed if params.seed is not None else 0xFFFFFFFF,
        "temperature": params.temperature, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0,
        "top_k": params.top_k, "top_p": params.top_p, "min_p": params.min_p, "top_n_sigma": -1.0,
        "xtc_probability": 0.0, "xtc_threshold": 0.1, "typical_p": 1.0,
        "repeat_last_n": params.repeat_last_n, "repeat_penalty": params.repeat_penalty,
        "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
        "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1,
        "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "adaptive_target": -1.0, "adaptive_decay": 0.9,
        "max_tokens": params.max_tokens, "n_predict": params.max_tokens, "n_keep": 0, "n_discard": 0,
        "ignore_eos": params.ignore_eos, "stream": stream, "n_probs": n_probs, "min_keep": 0,
        "stop": list(params.stop), "logit_bias": _bias_list(state.model, params),
        "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"],
        "grammar": params.grammar.gbnf if params.grammar is not None else "",
        "post_sampling_probs": False, "timings_per_token": False,
    }


def _bias_list(model, params: SamplingParams) -> list[dict]:
    """llama-server's logit_bias list: ignore_eos shows as the end-of-generation tokens at -inf (null)."""
    biases = dict(params.logit_bias)
    if params.ignore_eos:
        biases.update({t: -math.inf for t in getattr(model, "eog_tokens", ())})
    return [{"bias": b if math.isfinite(b) else None, "token": t} for t, b in biases.items()]
