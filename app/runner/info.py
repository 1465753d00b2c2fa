"""The routes that describe the runner: /health, /slots, /metrics, /props, /models."""

from __future__ import annotations

import time

from werkzeug.wrappers import Request as HttpRequest
from werkzeug.wrappers import Response

from app.engine.media import MEDIA_MARKER
from app.protocols.openai import ApiError
from app.runner.sampling import generation_settings
from app.runner.state import RunnerState
from app.runner.transport import json_response
from app.runner.writers import SYSTEM_FINGERPRINT

PROCESS_START_S = int(time.time())


def not_supported(message: str) -> ApiError:
    """llama-server's 501 for an endpoint switched off by a flag."""
    return ApiError(501, message, code="not_supported", err_type="not_supported_error")


def on_health(state: RunnerState, req: HttpRequest) -> Response:
    """GET /health: ok with the slots' use, 503 while loading, 500 when loading failed."""
    if state.status == "ok":
        snap = state.engine.snapshot()
        # Hearth's load_timings beside llama-server's fields: serve reads the load's split from the answer it waits for.
        return json_response({"status": "ok", "slots_idle": snap.n_seq_max - snap.num_running,
                              "slots_processing": snap.num_running, "requests_waiting": snap.num_waiting,
                              "load_timings": state.load_timings})
    if state.status == "loading":
        return json_response({"status": "loading", "error": {"code": 503, "message": "Loading model"}}, 503)
    return json_response({"status": "error", "error": {"code": 500, "message": state.error}}, 500)


def on_slots(state: RunnerState, req: HttpRequest) -> Response:
    """GET /slots: each slot's sequence."""
    if not state.config.slots:
        raise not_supported("This server does not support slots endpoint. Start it with `--slots`")
    engine = state.ready()
    n_ctx = state.model.n_ctx
    # llama-server's fields (id, n_ctx, is_processing, id_task) beside Hearth's own.
    return json_response([{**slot, "n_ctx": n_ctx, "id_task": slot["request_id"] if slot["is_processing"] else -1}
                          for slot in engine.snapshot().slots])


def on_metrics(state: RunnerState, req: HttpRequest) -> Response:
    """GET /metrics: Prometheus text."""
    if not state.config.metrics:
        raise not_supported("This server does not support metrics endpoint. Start it with `--metrics`")
    state.ready()
    return Response(state.metrics.render(), mimetype="text/plain; version=0.0.4",
                    headers={"Process-Start-Time-Unix": str(PROCESS_START_S)})


def on_props(state: RunnerState, req: HttpRequest) -> Response:
    """GET /props: llama-server's properties, then Hearth's own (engine mode, prefix cache, model)."""
    engine = state.ready()
    snap = engine.snapshot()
    cfg, model, template = state.config, state.model, state.template
    return json_response({
        # llama-server's fields first; is_sleeping is always false (Hearth has no sleep on idle).
        "default_generation_settings": {"params": generation_settings(state, None), "n_ctx": model.n_ctx},
        "model_path": cfg.model.path,
        "model_alias": cfg.model_name,
        "modalities": _modalities(state.projector),
        # Where /completion's prompt_string puts each of its multimodal_data images. llama-server's is random per
        # process (<__media_…__>, LLAMA_MEDIA_MARKER pins it) and read here by its clients; Hearth's is fixed.
        "media_marker": MEDIA_MARKER,
        "endpoint_slots": cfg.slots, "endpoint_props": False, "endpoint_metrics": cfg.metrics,
        "bos_token": template.bos_token if template else "", "eos_token": template.eos_token if template else "",
        "build_info": SYSTEM_FINGERPRINT, "is_sleeping": False,
        "total_slots": snap.n_seq_max,
        "mode": snap.mode,
        "token_budget": snap.token_budget,
        "load_s": state.load_s,
        "load_timings": state.load_timings,
        "kv_cache_bytes": model.kv_cache_bytes(),
        "model": model.describe(),
        "chat_template": template.source if template else None,
        "tool_format": state.chat_format.name,
        # llama-server's capabilities of the template, then Hearth's answer format (what the parser splits on).
        "chat_template_caps": {"supports_tools": state.chat_format.tools,
                               "supports_thinking": state.chat_format.reasoning,
                               "supports_reasoning_effort": "reasoning_effort" in (template.source if template else "")},
        "chat_format": format_info(state),
        "fim_tokens": sorted(model.fim_tokens()),
        "prefix_cache": {
            "enabled": snap.prefix_cache,
            "note": snap.prefix_cache_note,
            "n_swa": model.n_swa,
            "entries": snap.prefix_cache_entries,
            "max_entries": snap.prefix_cache_max_entries,
            "kv_cells_cached": snap.kv_cached,
        },
        "speculative": speculative_info(engine, snap, state.draft),
        # What the SLO budget can keep on this hardware (app/engine/scheduler.py ChunkCosts).
        "budget": {"cost": snap.cost, **(snap.feasibility or {})},
    })


def speculative_info(engine, snap, draft=None) -> dict:
    """Speculative decoding: the settings, the last iteration's decision, the acceptance so far per class, and the
    draft model (draft-simple: its file, size, counters and measured step cost)."""
    c = snap.counters
    by_class = {name: {"drafts": d, "draft_tokens": n, "accepted_tokens": k,
                       "acceptance": round(k / n, 4) if n else None}
                for name, (d, n, k) in sorted(dict(c.spec_by_class).items())}
    last = snap.last_iteration
    return {
        "enabled": snap.spec is not None,
        **(snap.spec or {"type": "none"}),
        "drafting": bool(last and last.num_draft_tokens),
        "note": snap.spec_note or ("drafting" if last and last.num_draft_tokens else ""),
        "drafts": c.spec_drafts_total, "draft_tokens": c.spec_draft_tokens_total,
        "accepted_tokens": c.spec_accepted_tokens_total,
        "acceptance": round(c.spec_accepted_tokens_total / c.spec_draft_tokens_total, 4)
        if c.spec_draft_tokens_total else None,
        "by_class": by_class,
        # The cost rule (app/engine/speculation.py decide): per source what it decided and why, and its prices.
        "sources": snap.spec_sources or {},
        "verify_ms_by_tokens": snap.verify_costs or {},
        "draft_model": None if draft is None else draft.stats(),
    }


def format_info(state: RunnerState) -> dict:
    """What the model's answers can hold, from its template: its format, tool calls, thinking and its markers."""
    fmt, cfg = state.chat_format, state.config
    return {"name": fmt.name, "tools": fmt.tools, "reasoning": fmt.reasoning, "think_start": fmt.think_start,
            "think_end": fmt.think_end, "reasoning_format": cfg.reasoning_format,
            "reasoning_budget": cfg.reasoning_budget}


def on_models(state: RunnerState, req: HttpRequest) -> Response:
    """GET /v1/models: the one model, by its alias (with its answer format once it is loaded)."""
    cfg = state.config
    entry = {"id": cfg.model_name, "object": "model", "owned_by": "hearth", "created": 0,
             "aliases": cfg.aliases or [cfg.model_name], "tags": list(cfg.tags)}
    if state.status == "ok":
        entry["chat_format"] = format_info(state)
    return json_response({"object": "list", "data": [entry]})


def _modalities(projector) -> dict:
    """llama-server's /props modalities: what the projector's encoders take (none without one)."""
    facts = projector.describe() if projector is not None else {}
    return {"vision": bool(facts.get("vision", projector is not None)), "video": False,
            "audio": bool(facts.get("audio"))}
