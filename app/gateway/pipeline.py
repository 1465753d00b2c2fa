"""The gateway's one generation pipeline: authenticate → class → admission → route → relay → adapter.

Every generating route calls `serve_generation`: the OpenAI routes (/v1, /infill) with no adapter,
their runner's bytes passed through as they come; the Ollama (/api) and vendor (/v1/messages,
/v1/responses) routes with an adapter (app.protocols.adapter) that turns the client's body into an
OpenAI request and the runner's OpenAI answer back into the client's API. Whatever the route, one
`Exchange` carries the request from its arrival to its row in the request log, and reports what the
runner's answer says about its node.
"""

from __future__ import annotations

import ipaddress
import json
import time
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime

from flask import Response, request, stream_with_context
from pydantic import BaseModel, ValidationError

from app.gateway import relay
from app.gateway.auth import Principal, bearer_token
from app.gateway.context import services
from app.gateway.exchange import CLIENT_STALLED, STALL_SHARE, Exchange
from app.gateway.headers import header_value
from app.gateway.lan import check_tokenless
from app.gateway.media import check_generation_audio
from app.policy import ClassPolicy
from app.protocols import sse
from app.protocols.adapter import Adapter
from app.protocols.openai import (
    FIM_CLASS,
    MAX_BODY_BYTES,
    ApiError,
    ChatBody,
    CompletionBody,
    EmbeddingBody,
    InfillBody,
    body_limit,
    content_parts,
    parse_body,
    too_large,
    validation_error,
)
from app.protocols.thinking import class_thinking, says_thinking, with_thinking
from app.sockets import client_gone
from app.store.settings import cors_origins

# Who tokenless requests are recorded as when the API is open to the LAN.
LAN_MEMBER = "lan"
# Logged for a request whose client left before it was answered (nginx's code).
CLIENT_CLOSED = 499
# llama-server's per-request cap on draft tokens; 0 turns speculative decoding off for the request.
NO_DRAFTS_FIELD = "speculative.n_max"


def error_response(err: ApiError) -> Response:
    """An ApiError as OpenAI answers it (JSON, with its headers such as Retry-After)."""
    return Response(json.dumps(err.body()), status=err.status, headers=err.headers, mimetype="application/json")


def from_lan(addr: str | None) -> bool:
    """Whether a client address is on the household's network (private or loopback)."""
    try:
        ip = ipaddress.ip_address(addr or "")
    except ValueError:
        return False
    return ip.is_private or ip.is_loopback


def authenticate() -> Principal:
    """The request's member and classes, from its bearer token (or the LAN's, when the admin opened it).

    LAN-open mode (app.gateway.lan): a tokenless request must send JSON (415) and must not come from
    another web site (403); every request is shown to the proxy watch, which tells the admin when a
    proxy makes every client look private. A tokenless client never has the manage permission.
    """
    token = bearer_token(request.headers.get("Authorization"))
    svc = services()
    settings = svc.settings
    open_on_lan = bool(settings.get("api_open_on_lan"))
    if open_on_lan:
        svc.proxy_watch.note(request.remote_addr, request.headers, int(settings.get("proxy_hops") or 0))
    if token is None and request.headers.get("Authorization") is None and open_on_lan \
            and from_lan(request.remote_addr):
        has_body = bool(request.content_length) or "chunked" in request.headers.get("Transfer-Encoding", "").lower()
        check_tokenless(request.method, request.mimetype, has_body, request.headers,
                        request.host, cors_origins(settings.get("api_cors_origins")))
        # Opened explicitly by the admin: tokenless LAN clients share one member and class.
        return Principal(token_id=None, member=LAN_MEMBER, default_class=str(settings.get("api_open_class")),
                         allowed_classes=())
    if token is None:
        raise ApiError(401, "missing API token: send 'Authorization: Bearer <token>' (create one with "
                            "`hearth token create --member NAME --class chat`)", code="missing_token",
                       err_type="authentication_error")
    principal = svc.tokens.lookup(token)
    if principal is None:
        raise ApiError(401, "invalid or revoked API token", code="invalid_token", err_type="authentication_error")
    return principal


def choose_class(principal: Principal, body_class: str | None, fim: bool = False) -> ClassPolicy:
    """The class a request runs in: its header, else its body's, else code completion's, else the token's."""
    svc = services()
    wanted = request.headers.get("X-Hearth-Class") or body_class
    if wanted is None and fim and FIM_CLASS in svc.classes.names() and principal.may_use(FIM_CLASS):
        # Code completion is its own household policy, whatever app's token sends it.
        wanted = FIM_CLASS
    wanted = wanted or principal.default_class
    policy = svc.classes.get(wanted)
    if policy is None:
        raise ApiError(400, f"unknown class '{wanted}'; known classes: {', '.join(svc.classes.names())}",
                       param="X-Hearth-Class", code="unknown_class")
    if not principal.may_use(wanted):
        allowed = ", ".join(sorted({principal.default_class, *principal.allowed_classes}))
        raise ApiError(403, f"this token may not use class '{wanted}' (allowed: {allowed})",
                       code="class_not_allowed", err_type="permission_error")
    return policy


def upstream_error(status: int, content: bytes) -> ApiError:
    """A runner's error answer (OpenAI's shape, as every runner answers) as an ApiError, its fields kept."""
    try:
        payload = json.loads(content)
    except ValueError:
        return ApiError(status, content[:500].decode("utf-8", "replace"), err_type="server_error")
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict):
        extra = {k: v for k, v in err.items() if k not in ("message", "type", "param", "code")}
        return ApiError(status, str(err.get("message") or err), param=err.get("param"), code=err.get("code"),
                        err_type=err.get("type") or "server_error", extra=extra)
    return ApiError(status, str(err if err is not None else payload), err_type="server_error")


def translate_stream(adapter: Adapter, chunks: Iterable[bytes]) -> Iterator[bytes]:
    """A runner's OpenAI event stream as the adapter's API streams it, piece by piece."""
    chunks = iter(chunks)
    yield from adapter.start()
    for payload in sse.payloads(chunks):
        yield from adapter.feed(payload)
    yield from adapter.end()
    for _ in chunks:
        # Read past [DONE] to the body's end, so the runner's connection goes back to the pool.
        pass


def limit_body() -> None:
    """Before a route reads its body: the route's limit (generations make room for an image) set on the request,
    and a body whose Content-Length is over it refused before a byte is read (the blueprints' before_request)."""
    limit = body_limit(request.path)
    if limit > MAX_BODY_BYTES and (request.content_length is None or request.content_length > MAX_BODY_BYTES):
        # A body beyond the ordinary limit is read only for a caller who may generate: a client without a token
        # cannot make serve hold an image-sized body on each of its connections.
        authenticate()
    request.max_content_length = limit
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit)


def body_over_limit(_exc) -> ApiError:
    """The ApiError for a body that went over its limit while it was read (chunked, no Content-Length)."""
    return too_large(body_limit(request.path))


def _parse(schema: type[BaseModel], adapter: Adapter | None, model: str | None) -> tuple[BaseModel, dict]:
    """The request body validated by the route's schema: the client's own, or the adapter's OpenAI request."""
    if adapter is None:
        limit = body_limit(request.path)
        if request.content_length is not None and request.content_length > limit:
            raise too_large(limit)
        return parse_body(request.get_data(cache=False), schema, limit)
    raw = adapter.to_openai()
    if model is not None:
        raw["model"] = model
    try:
        return schema.model_validate(raw), raw
    except ValidationError as exc:
        raise validation_error(exc)


def _max_tokens(body: BaseModel, policy: ClassPolicy) -> int:
    """The generation length the runner is asked for: the client's, within its class's cap, else the class's default."""
    requested = body.max_completion_tokens if isinstance(body, ChatBody) and body.max_completion_tokens else body.max_tokens
    if isinstance(body, InfillBody) and requested is None:
        requested = body.n_predict
    if requested is not None and requested > policy.max_output_tokens:
        raise ApiError(400, f"'max_tokens': {requested} is above class '{policy.name}''s cap of "
                            f"{policy.max_output_tokens}", param="max_tokens", code="max_tokens_above_cap")
    return requested or policy.default_max_tokens


def _refuse_image_urls(raw: dict) -> None:
    """A 400 for an http(s) image URL while fetching is off: checked here, before any runner sees the request,
    because a stock llama-server or a remote node fetches such URLs itself, wherever they point."""
    for part, where in content_parts(raw.get("messages"), ("image_url",)):
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if isinstance(url, str) and url[:8].lower().startswith(("http://", "https://")):
            param = f"{where}.image_url.url"
            raise ApiError(400, f"'{param}': this server does not fetch image URLs; send the image itself as a "
                                "base64 data URL (data:image/png;base64,...), or the admin turns on the setting "
                                "runner_image_url_fetch", param=param, code="image_url_fetch_off")


def serve_generation(schema: type[BaseModel], path: str, adapter: Adapter | None = None, *,
                     model: str | None = None, principal: Principal | None = None) -> Response:
    """Relay one generation to the runner's `path`; an adapter reads the body and writes the answer in its API.

    `model` replaces the adapter's model name (a route that resolved its API's names itself);
    `principal` is the caller's, when the route has authenticated already.
    """
    arrival_s = time.monotonic()
    arrival_at = datetime.now(UTC)
    principal = principal or authenticate()
    svc = services()
    # A token trusted to name its users: the person behind the request is the member from here on.
    principal = svc.people.behind(principal, request.headers)
    body, raw = _parse(schema, adapter, model)
    if schema is ChatBody and not svc.settings.get("runner_image_url_fetch"):
        _refuse_image_urls(raw)
    features = tuple(body.features)
    policy = choose_class(principal, raw.get("hearth_class"), fim="fim" in features)
    model_name = svc.router.resolve(body.model, policy)
    forward = dict(raw)
    forward["max_tokens"] = _max_tokens(body, policy)
    forward.pop("max_completion_tokens", None)
    forward.pop("n_predict", None)
    if schema is ChatBody and not says_thinking(forward):
        # The class's thinking default (voice: off) for a request that does not decide it itself.
        forward = with_thinking(forward, class_thinking(policy.thinking))
    if not policy.speculation and schema is not EmbeddingBody:
        # The class opts out of drafting: llama-server's per-request field, which the hearth runner reads too.
        forward[NO_DRAFTS_FIELD] = 0
    forward["priority"] = policy.priority
    forward["hearth_class"] = policy.name
    if schema is not EmbeddingBody:
        # Always set here, whatever the client sent: whose words the runner's KV disk tier keeps, and whether at all.
        forward["hearth_member"], forward["hearth_private"] = principal.member, policy.private
    forward["model"] = model_name
    record = {
        "arrival_at": arrival_at, "member_name": principal.member, "token_id": principal.token_id,
        "class_name": policy.name, "model": model_name, "stream": bool(body.stream),
        "features": ",".join(features) or None,
        # A transcription's audio length (its adapter read it from the file): the Requests page's real-time factor.
        "audio_seconds": getattr(adapter, "seconds", None),
    }
    ex = Exchange(svc, record, arrival_s, principal)
    # Each of `n` choices is a sequence of its own on the runner (llama-server's and Hearth's alike).
    ticket = ex.admit(policy, places=body.n if isinstance(body, ChatBody | CompletionBody) else 1)
    try:
        if ticket.queue_position and client_gone(request.environ):
            # Left while queued (a flood's abandoned requests): no runner is asked for a prefill.
            ex.finish(relay.RelayOutcome(status=CLIENT_CLOSED, error="the client left while waiting for admission"),
                      status="cancelled")
            return Response(status=CLIENT_CLOSED)
        if schema is ChatBody:
            # Audio is checked once the request holds its place (a member's limits come first), off the loop.
            seconds = check_generation_audio(svc, model_name, adapter, raw)
            if seconds is not None:
                record["audio_seconds"] = seconds
        lease = ex.acquire(model_name)
        headers = {"X-Hearth-Class": policy.name, "X-Hearth-Model": header_value(model_name),
                   "X-Hearth-Node": header_value(lease.node_label)}
        if ticket.queue_position:
            headers["X-Hearth-Queue-Position"] = str(ticket.queue_position)
        url = lease.url.rstrip("/") + path
        if body.stream:
            # The runner's running count on every chunk (llama-server's timings_per_token), so a stream the client
            # cuts before its usage chunk is still charged what it used; taken out again unless the client asked.
            counts = isinstance(body, ChatBody | CompletionBody) and not forward.get("timings_per_token")
            if counts:
                forward["timings_per_token"] = True
            return _stream(ex, url, forward, headers, adapter, strip_timings=counts)
        return _whole(ex, url, forward, headers, adapter, generates=schema is not EmbeddingBody)
    except ApiError as err:
        ex.finish(relay.RelayOutcome(status=err.status, error=err.message))  # a no-op when already finished
        raise
    except BaseException:
        # Whatever went wrong before the answer was handed over: place and lease go back, the row is
        # logged (a stream hands its bookkeeping to its generator, whose finally ends it).
        ex.finish(relay.RelayOutcome(status=500, error="the gateway failed before answering"))
        raise


def _answer(status: int, content: bytes, adapter: Adapter | None) -> tuple[int, bytes]:
    """A runner's whole answer (or error) as the client's API answers it: as it is without an adapter."""
    if adapter is None:
        return status, content
    if status != 200:
        status, payload = adapter.error(upstream_error(status, content))
    else:
        try:
            completion = json.loads(content)
        except ValueError as exc:
            status, payload = adapter.error(ApiError(502, f"the runner's answer is not JSON: {exc}",
                                                     err_type="server_error"))
        else:
            payload = adapter.answer(completion)
            if isinstance(payload, str):  # a plain-text answer (a transcription's text, srt or vtt)
                return status, payload.encode()
    return status, json.dumps(payload, ensure_ascii=False).encode()


def _whole(ex: Exchange, url: str, forward: dict, headers: dict, adapter: Adapter | None,
           generates: bool = True) -> Response:
    resp, outcome = ex.send(relay.post, url, forward)
    # Reported before the answer is translated: a translation that fails leaves the node's health as the runner said.
    ex.report(outcome)
    out_headers = dict(headers)
    if "retry-after" in resp.headers:
        out_headers["Retry-After"] = resp.headers["retry-after"]
    status, content = _answer(resp.status_code, resp.content, adapter)
    if generates and resp.status_code == 200:
        # A whole answer reaches the client all at once: its first token goes out now.
        ex.first_token_s = time.monotonic()
    ex.finish(outcome)
    mimetype = getattr(adapter, "answer_mimetype", "application/json") if status == 200 else "application/json"
    return Response(content, status=status, headers=out_headers, mimetype=mimetype)


def _stream(ex: Exchange, url: str, forward: dict, headers: dict, adapter: Adapter | None,
            strip_timings: bool = False) -> Response:
    resp, outcome = ex.send(relay.open_stream, url, forward)
    if resp.status_code != 200:
        content = resp.read()
        retry_after = resp.retry_after
        resp.close()
        try:
            relay.read_summary(json.loads(content), outcome)
        except ValueError:
            outcome.error = content[:500].decode(errors="replace")
        ex.conclude(outcome)
        status, content = _answer(resp.status_code, content, adapter)
        out_headers = dict(headers)
        if retry_after is not None:
            out_headers["Retry-After"] = retry_after
        return Response(content, status=status, headers=out_headers, mimetype="application/json")
    stall_s = float(ex.svc.settings.get("client_stall_s"))

    def generate():
        completed = False
        handed_s = time.monotonic()
        try:
            chunks = relay.stream_chunks(resp, outcome, strip_timings)
            for piece in chunks if adapter is None else translate_stream(adapter, chunks):
                handed_s = time.monotonic()
                yield piece
                # Back here once the server has written the piece to the client's connection.
                if ex.first_token_s is None and outcome.token_seen:
                    ex.first_token_s = time.monotonic()
            completed = True
        finally:
            # Runs on normal end and when the client goes away or stops reading (the server closes
            # the generator): closing the upstream response makes the runner cancel the sequence.
            resp.close()
            status = None
            if not completed:
                stalled = time.monotonic() - handed_s >= STALL_SHARE * stall_s
                status = CLIENT_STALLED if stalled else "cancelled"
                if stalled:
                    outcome.error = f"the client read nothing for {stall_s:g} s (client_stall_s): cancelled"
                # Charged what it used up to the cut: its row and the member's token windows.
                relay.count_so_far(outcome)
            ex.conclude(outcome, status=status)

    return Response(stream_with_context(generate()), status=200, headers={**headers, "Cache-Control": "no-cache"},
                    mimetype="text/event-stream" if adapter is None else adapter.stream_mimetype)
