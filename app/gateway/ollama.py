"""The Ollama API (/api/*) on the gateway: a generation takes the path a /v1 request takes
(app.gateway.pipeline) through app.protocols.ollama's adapters, which translate its body into
OpenAI's shape and the runner's answer back, NDJSON line by line when streamed; the model list,
show, load/unload and pull/copy/delete are answered here from the catalog and residency.

Home Assistant's Ollama integration, Open WebUI and Continue speak this API. Ollama's names carry a
tag (`gemma:latest`); a name without one is its `:latest`. `keep_alive` is a client's wish for how
long its model stays resident once idle; the residency manager keeps an admin's pin whatever a
client asks. Pull, copy and delete change the models folder, and an empty chat or generate loads or
(with `keep_alive: 0`) unloads a model for everyone: they need the setting `api_manage_models` on
and a token with the manage permission (tokenless LAN clients never have it; the dashboard and
`hearth models pull` always can). A token without it may still send `keep_alive` with a
generation: the admin's keep-alive applies instead.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from flask import Blueprint, Response, stream_with_context
from sqlalchemy import select

from app.engine.formats import detect
from app.gateway import bodies
from app.gateway.auth import Principal
from app.gateway.context import services
from app.gateway.pipeline import authenticate, serve_generation
from app.gguf_meta import GgufArray, GgufError, projector_modalities
from app.protocols import ollama
from app.protocols.errors import public_text
from app.protocols.ollama import DEFAULT_TAG, NDJSON, hearth_name, ollama_name, parse_keep_alive
from app.protocols.openai import ApiError, ChatBody, CompletionBody, EmbeddingBody
from app.residency.catalog import file_facts
from app.residency.manager import ModelBusy, ModelState, UnknownModel
from app.services.catalog import alias_problem
from app.store import models as db

bp = Blueprint("ollama", __name__)
log = logging.getLogger(__name__)

# The Ollama release whose API this follows; clients that check a minimum version read it.
OLLAMA_VERSION = "0.12.6"
PULL_POLL_S = 0.25
# The status of a pull that did not finish, by why (app.residency.fetch.PULL_CODES); others: 409 refused, 502 failed.
PULL_STATUS = {"bad_source": 400, "not_found": 404, "host_refused": 403, "exists": 409, "busy": 409,
               "disk_full": 507, "read_only": 500, "write_failed": 500, "unservable": 422, "mismatch": 502}
# What /api/ps says for a model that never expires (pinned, or keep_alive -1), as Ollama does.
NEVER = datetime(2318, 1, 1, tzinfo=UTC)
bodies.install(bp, ollama.error_body)


# -- endpoints -------------------------------------------------------------------------------------


def _json_body() -> dict:
    """The request's JSON object (an empty body is an empty object, as Ollama reads it)."""
    return bodies.json_object(empty_is_object=True)


def _model_field(body: dict) -> str:
    model = body.get("model") or body.get("name")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required", param="model")
    if not model.isprintable():
        raise ApiError(400, "'model' holds a control character (a newline, a NUL byte…); send the name alone",
                       param="model", code="invalid_model_name")
    return model


def _known() -> set[str]:
    svc = services()
    return set(svc.catalog.model_specs()) | set(svc.catalog.aliases())


def _catalog_name(requested: str) -> str:
    """The catalog name an Ollama model name means (aliases resolved); 404 when there is none."""
    return services().router.resolve(hearth_name(requested, _known()), None)


def _apply_keep_alive(name: str, body: dict, principal: Principal) -> float | None:
    ttl = parse_keep_alive(body.get("keep_alive"))
    if not _manages(principal):
        # Keeping a model resident or unloading it is a household decision: the admin's keep-alive stays.
        return None
    try:
        services().residency.set_client_keep_alive(name, ttl)
    except UnknownModel:
        raise ApiError(404, f"model '{name}' not found", param="model", code="model_not_found")
    return ttl


@bp.route("/api/version", methods=["GET", "HEAD"])
def version():
    """The Ollama API version this gateway follows (open, as Ollama's is: it says nothing about the household)."""
    return {"version": OLLAMA_VERSION}


def _details(entry) -> dict:
    family = entry.architecture or ""
    n = entry.n_params or 0
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    return {"parent_model": "", "format": "gguf", "family": family, "families": [family] if family else None,
            "parameter_size": size, "quantization_level": entry.quantization or ""}


def _digest(entry) -> str:
    """A stable identity of the file (path, size, modification time): hashing gigabytes per listing would
    stall the clients that poll it; the library's pull checks the real sha256."""
    return hashlib.sha256(f"{entry.path}\0{entry.size_bytes}\0{entry.mtime}".encode()).hexdigest()


def _entries() -> dict[str, Any]:
    svc = services()
    specs = svc.catalog.model_specs()
    return {e.name: e for e in svc.catalog.entries if e.usable and e.name in specs}


def _modified_at(entry) -> str:
    return datetime.fromtimestamp(entry.mtime or 0, UTC).isoformat()


@bp.get("/api/tags")
def tags():
    """Servable models (and their aliases) in Ollama's list shape."""
    authenticate()
    svc = services()
    entries = _entries()
    names = [(n, n) for n in entries] + sorted((a, n) for a, n in svc.catalog.aliases().items() if n in entries)
    return {"models": [{"name": ollama_name(shown), "model": ollama_name(shown), "modified_at": _modified_at(entries[n]),
                        "size": entries[n].size_bytes, "digest": _digest(entries[n]), "details": _details(entries[n])}
                       for shown, n in names]}


@bp.get("/api/ps")
def ps():
    """Resident models: memory, and when an idle expiry will unload them (from keep-alive)."""
    authenticate()
    svc = services()
    entries, specs = _entries(), svc.catalog.model_specs()
    now = datetime.now(UTC)
    models = []
    for st in svc.residency.status():
        e = entries.get(st["name"])
        if e is None or st["state"] != ModelState.READY or st["pid"] is None:
            continue
        runner = specs[st["name"]].runner
        size = st["measured_bytes"] or st["estimate_bytes"]
        expires = NEVER if st["expires_in_s"] is None else now + timedelta(seconds=st["expires_in_s"])
        models.append({"name": ollama_name(e.name), "model": ollama_name(e.name), "size": size,
                       "digest": _digest(e), "details": _details(e), "expires_at": expires.isoformat(),
                       "size_vram": size if runner and runner.gpu_layers else 0,
                       "context_length": runner.n_ctx if runner else None})
    return {"models": models}


def _model_info(fields: dict) -> dict:
    """The GGUF metadata as Ollama's model_info: long arrays (vocabulary, merges) are null, as there."""
    out = {}
    for key, value in fields.items():
        if isinstance(value, GgufArray):
            value = None
        elif isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, bytes | bytearray):
            continue
        out[key] = value
    return out


def capabilities(fields: dict, template: str | None, vision: bool = False, audio: bool = False) -> list[str]:
    """What a model can do, from its GGUF: completion (a generative model), tools (its template takes
    them), thinking (its format has reasoning, app.engine.formats.detect), insert (it has
    fill-in-the-middle tokens), embedding (every hearth runner can embed); vision and audio as the paired
    projector's encoders take them."""
    arch = fields.get("general.architecture")
    fmt = detect(template)
    caps = []
    generates = fields.get(f"{arch}.pooling_type") in (None, 0)
    if generates:
        caps.append("completion")
    if fmt.tools or (template and "tools" in template):
        caps.append("tools")
    if generates and fmt.reasoning:
        caps.append("thinking")
    if any(f"tokenizer.ggml.{k}_token_id" in fields for k in ("fim_pre", "fim_suf", "prefix", "suffix")):
        caps.append("insert")
    if generates and vision:
        caps.append("vision")
    if generates and audio:
        caps.append("audio")
    caps.append("embedding")
    return caps


@bp.post("/api/show")
def show():
    """A model's template, parameters, GGUF metadata and capabilities."""
    authenticate()
    body = _json_body()
    name = _catalog_name(_model_field(body))
    svc = services()
    entry = _entries().get(name)
    if entry is None:
        raise ApiError(404, f"model '{body.get('model')}' not found", param="model", code="model_not_found")
    try:
        # Cached per version of the file: Home Assistant and Open WebUI call show for every model they list.
        facts = file_facts(entry.path)
    except (GgufError, OSError) as exc:
        log.warning("cannot read %s for /api/show: %s", entry.path, exc)
        raise ApiError(500, f"cannot read model '{name}''s file {entry.path.name}: {public_text(str(exc))}",
                       err_type="server_error")
    fields, template = facts.fields, facts.template
    runner = svc.catalog.model_specs()[name].runner
    parameters = f"num_ctx {runner.n_ctx}" if runner else ""
    # The file's name, not its path: where the models folder lies is the household's business.
    modelfile = f"# Modelfile of Hearth's model {name}\nFROM {entry.path.name}\n" + (f"PARAMETER {parameters}\n" if parameters else "")
    info = _model_info(fields)
    info["general.parameter_count"] = entry.n_params
    fmt = detect(template)
    return {"modelfile": modelfile, "parameters": parameters, "template": template or "", "details": _details(entry),
            "model_info": info, "capabilities": capabilities(fields, template, *projector_modalities(entry.mmproj)), "modified_at": _modified_at(entry),
            # Hearth's own: the answer format detected from the template the runner prompts it with.
            "hearth": {"chat_format": fmt.name, "native_tools": fmt.tools, "reasoning": fmt.reasoning}}


def _adapter(kind: str, body: dict) -> ollama.ChatAdapter | ollama.GenerateAdapter:
    return ollama.ChatAdapter(body) if kind == "chat" else ollama.GenerateAdapter(body)


def _load_or_unload(kind: str, body: dict, name: str, ttl: float | None):
    """A chat/generate request with nothing to say: Ollama's way to load a model, or unload it (keep_alive 0).

    Unloading a model other members are using waits for their requests (keep_alive 0 unloads it as
    soon as they end) rather than answering 409: Ollama clients send it fire-and-forget, and nobody's
    answer is cut short.
    """
    svc = services()
    if ttl == 0:
        if svc.catalog.model_specs()[name].policy == "pinned":
            raise ApiError(409, f"model '{name}' is pinned by the household's admin and stays resident",
                           code="model_pinned")
        try:
            svc.residency.unload(name, "keep_alive 0 from a client")
        except ModelBusy:
            pass  # keep_alive 0 is set: it is unloaded as soon as its requests end
        reason = "unload"
    else:
        svc.router.acquire(name).release()
        reason = "load"
    line = _adapter(kind, body).line("", True, done_reason=reason)
    if body.get("stream") is not False:
        return Response(ollama.ndjson(line), mimetype=NDJSON)
    return line


def _generation(kind: str):
    principal = authenticate()
    body = _json_body()
    body["model"] = _model_field(body)
    name = _catalog_name(body["model"])
    empty = not body.get("messages") if kind == "chat" else not body.get("prompt") and not body.get("suffix")
    if empty:
        # Loading or unloading a model for the whole household: a permission of its own.
        _may_manage(principal, "load or unload a model (an empty chat or generate)")
    ttl = _apply_keep_alive(name, body, principal)
    if empty:
        return _load_or_unload(kind, body, name, ttl)
    adapter = _adapter(kind, body)
    path = "/v1/chat/completions" if kind == "chat" else adapter.path
    schema = ChatBody if path == "/v1/chat/completions" else CompletionBody
    return serve_generation(schema, path, adapter, model=name, principal=principal)


@bp.post("/api/chat")
def chat():
    """Ollama chat through the household's classes: NDJSON when streamed (Ollama's default)."""
    return _generation("chat")


@bp.post("/api/generate")
def generate():
    """Ollama generate through the household's classes: the prompt in the model's template, or raw."""
    return _generation("generate")


def _embedding(adapter_class: type[ollama.EmbedAdapter]):
    principal = authenticate()
    body = _json_body()
    body["model"] = _model_field(body)
    name = _catalog_name(body["model"])
    _apply_keep_alive(name, body, principal)
    return serve_generation(EmbeddingBody, "/v1/embeddings", adapter_class(body), model=name, principal=principal)


@bp.post("/api/embed")
def embed():
    """Embeddings of one input or many (batched by the model's runner), L2-normalised."""
    return _embedding(ollama.EmbedAdapter)


@bp.post("/api/embeddings")
def embeddings():
    """The older single-prompt embeddings endpoint."""
    return _embedding(ollama.EmbeddingsAdapter)


def _manages(principal: Principal) -> bool:
    """Whether this caller may manage models now: the household allows it and its token has the permission."""
    return principal.may_manage and bool(services().settings.get("api_manage_models"))


def _may_manage(principal: Principal | None = None, action: str = "pull, delete or copy models") -> Principal:
    """The caller, if it may manage models; else 403 naming the permission and how the admin grants it."""
    principal = principal or authenticate()
    if not services().settings.get("api_manage_models"):
        raise ApiError(403, f"managing models through the API is off, so this request may not {action}; the "
                            "household's admin can turn on the setting api_manage_models and give a token the "
                            "manage permission (Members page, or `hearth token set ID --manage`), or pull and "
                            "delete on the dashboard's Models page", code="manage_models_off",
                       err_type="permission_error")
    if not principal.may_manage:
        who = ("requests without a token never have the manage permission: send a token that has it"
               if principal.token_id is None else
               f"this token (id {principal.token_id}, of {principal.member}) lacks the manage permission; the "
               f"household's admin can grant it on the Members page or with "
               f"`hearth token set {principal.token_id} --manage`")
        raise ApiError(403, f"may not {action}: {who}", code="manage_permission_missing", err_type="permission_error")
    return principal


def pull_lines(p) -> Iterator[dict]:
    """A pull's progress as Ollama's NDJSON statuses, until it ends (success or an error line)."""
    yield {"status": "pulling manifest"}
    while p.state == "resolving":
        time.sleep(PULL_POLL_S)
    while p.state == "downloading":
        digest = f"sha256:{p.sha256}" if p.sha256 else ""
        yield {"status": f"pulling {p.filename}", "digest": digest, "total": p.total_bytes or 0,
               "completed": p.done_bytes}
        time.sleep(PULL_POLL_S)
    while p.state == "verifying":
        time.sleep(PULL_POLL_S)
    if p.state != "done":
        yield {"error": public_text(p.error or f"the pull {p.state}")}
        return
    yield {"status": f"pulling {p.filename}", "digest": f"sha256:{p.sha256}", "total": p.total_bytes or p.done_bytes,
           "completed": p.done_bytes}
    yield {"status": "verifying sha256 digest"}
    yield {"status": "writing manifest"}
    yield {"status": "success"}


@bp.post("/api/pull")
def pull():
    """Pull a GGUF (hf.co/owner/repo:QUANT, owner/repo/file.gguf or a URL) into the models folder, with progress."""
    _may_manage(action="pull a model")
    body = _json_body()
    svc = services()
    p = svc.library.start(_model_field(body), allowed_hosts=svc.settings.get("pull_allowed_hosts"))
    if body.get("stream") is not False:
        # The pull runs on its own thread; this response only reports on it, so a client that
        # goes away leaves the download going (the dashboard shows it).
        return Response(stream_with_context(ollama.ndjson(line) for line in pull_lines(p)), mimetype=NDJSON)
    lines = list(pull_lines(p))
    if "error" in lines[-1]:
        status = PULL_STATUS.get(p.code or "", 409 if p.state == "refused" else 502)
        raise ApiError(status, lines[-1]["error"], code=f"pull_{p.code or p.state}")
    return lines[-1]


@bp.delete("/api/delete")
def delete():
    """Delete a model file (refused while it serves, and for the embedded default model)."""
    _may_manage(action="delete a model")
    services().router.delete_model(_catalog_name(_model_field(_json_body())))
    return {}


@bp.post("/api/copy")
def copy():
    """Ollama's copy, as Hearth's alias: the destination name becomes another name of the source."""
    _may_manage(action="copy a model (make an alias)")
    body = _json_body()
    source = body.get("source")
    if not isinstance(source, str) or not source:
        raise ApiError(400, "'source' is required: the name of a model to copy", param="source")
    source = _catalog_name(source)
    destination = body.get("destination")
    if not isinstance(destination, str) or not destination:
        raise ApiError(400, "'destination' is required", param="destination")
    alias = destination.removesuffix(f":{DEFAULT_TAG}")
    svc = services()
    with svc.write_sessions() as s:
        problem = alias_problem(s, alias, source)
        if problem:
            raise ApiError(400, f"'{destination}' cannot name '{source}': {problem}", param="destination",
                           code="alias_refused")
        row = s.scalar(select(db.Model).where(db.Model.name == source))
        row.alias = alias
        s.commit()
    svc.catalog.rescan()
    return {}


@bp.post("/api/create")
def create():
    """Refused: Hearth serves GGUF files as they are, it builds no models from Modelfiles."""
    raise ApiError(501, "Hearth does not create models from Modelfiles: put a .gguf into the models folder, or pull "
                        "one (`hearth models pull`, the dashboard's Models page, /api/pull)", code="not_supported")


@bp.post("/api/push")
def push():
    """Refused: Hearth pushes to no registry."""
    raise ApiError(501, "Hearth does not push models to a registry", code="not_supported")

