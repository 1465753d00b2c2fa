"""Jobs through the engine: submit, watch the client, and drive the job's writer to a stream or a whole answer.

    submit(job)          -> a Request in the engine (its refusals as llama-server's errors)
    whole(jobs)          -> each job's whole answer (all submitted first, so they batch)
    stream(job)          -> the job's pieces as dicts: the writer's, or the error payload (encoded: some as bytes)
    sse(pieces)          -> OpenAI's / llama-server's event stream of them

A request whose client goes away is cancelled, streamed or not. A stream writes what the engine has ready
in one piece: a verified draft yields a burst of tokens in one iteration, and one socket write for the burst
(instead of one per token) saves the runner, serve's relay and the client a write, a read and a wake-up each;
every token still has its own event. Tokens that come less than COALESCE_S apart are gathered likewise.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping

from app.engine.engine import Engine
from app.engine.request import ContextOverflow, Delta, Finished, Progress, QueueFull, Request
from app.protocols import sse as sse_codec
from app.protocols.openai import ApiError
from app.runner.job import NATIVE, Job
from app.runner.state import RunnerState
from app.runner.writers import Writer, writer_for
from app.sockets import client_gone

log = logging.getLogger(__name__)

CLIENT_CHECK_S = 0.2  # how often a waiting request looks whether its client is still there
# One write per stream per this long at most (vLLM's --stream-interval does the like by token count): tokens that
# come faster, more than 250 a second per stream (a tiny model, a small one on a fast GPU), are gathered for up to
# 4 ms, a quarter of one 60 Hz frame, and go out together; slower ones, every token of a model that takes 4 ms or more
# per token (any model on a NAS CPU), go out the moment they are ready, and the first token always does. Each write
# wakes this thread, which takes the GIL and a core from llama.cpp's threads mid-decode and costs serve's relay a
# read and a write: on the tiny random model (`hearth bench ceiling`, 2 cores) the runner went from 0.76x to 0.98x
# of llama-server at 1 stream and serve from 0.65x to 0.94x at 8. A whole answer's wait (watched serves both) skips
# the same wake-ups; its end comes at most COALESCE_S after its last token.
COALESCE_S = 0.004
# Between a request's events: the engine has nothing more ready for it now (what came before goes out together).
FLUSH = object()


def submit(engine: Engine, job: Job) -> Request:
    """Queue a job's request; the engine's refusals become llama-server's errors."""
    try:
        return engine.submit(job.tokens, job.params, priority=job.priority, class_name=job.class_name,
                             owner=job.owner, private=job.private, arrival_s=time.monotonic(), cache_prompt=job.cache_prompt, slo=job.slo,
                             return_progress=job.return_progress, media=job.media)
    except ContextOverflow as exc:
        raise ApiError(400, f"request ({exc.num_prompt_tokens} tokens) exceeds the available context size "
                            f"({exc.n_ctx} tokens), try increasing it",
                       param=job.prompt_param, code="context_length_exceeded", err_type="exceed_context_size_error",
                       extra={"n_prompt_tokens": exc.num_prompt_tokens, "n_ctx": exc.n_ctx})
    except QueueFull as exc:
        raise ApiError(503, str(exc), code="queue_full", err_type="unavailable_error",
                       headers={"Retry-After": str(exc.retry_after_s)})
    except ValueError as exc:  # a grammar llama.cpp cannot parse
        raise ApiError(400, f"'grammar': {exc}", param="grammar", code="invalid_grammar")


def generation_error(fin: Finished) -> ApiError:
    """A request the engine ended with an error (503 when it was cancelled under it: a shutdown)."""
    return ApiError(503 if fin.finish_reason == "cancelled" else 500, fin.error or "generation failed",
                    code="generation_failed", err_type="server_error")


def watched(environ: Mapping, engine: Engine, request: Request,
            on_finished: Callable[[Finished], None] | None = None) -> Iterator[Delta | Progress | Finished]:
    """The request's events; cancels it when the client goes away (the events then stop)."""
    done = False
    next_check_s = time.monotonic() + CLIENT_CHECK_S
    last_flush_s = -CLIENT_CHECK_S
    try:
        for ev in engine.events(request, poll_s=CLIENT_CHECK_S):
            # Tokens may arrive faster than the poll interval, so check by the clock, not on idle.
            if time.monotonic() >= next_check_s:
                next_check_s = time.monotonic() + CLIENT_CHECK_S
                if client_gone(environ):
                    log.info("client went away; cancelling request %s", request.request_id)
                    return
            if ev is None:
                continue
            if isinstance(ev, Finished):
                done = True
                if on_finished is not None and not ev.error:
                    on_finished(ev)
            yield ev
            if not done and request.events.empty():
                wait_s = last_flush_s + COALESCE_S - time.monotonic()
                if wait_s > 0:
                    time.sleep(wait_s)
                    if not request.events.empty():
                        continue  # more came meanwhile: it goes out in this write
                last_flush_s = time.monotonic()
                yield FLUSH
    finally:
        if not done:
            engine.cancel(request)


def whole(state: RunnerState, environ: Mapping, jobs: list[Job]) -> list[dict]:
    """Each job's whole answer, in order; all are submitted first, so they generate side by side."""
    engine = state.ready()
    requests: list[Request] = []
    try:
        for job in jobs:
            requests.append(submit(engine, job))
        return [_whole_one(state, environ, engine, job, request) for job, request in zip(jobs, requests)]
    finally:
        # One failed: the others' answers would go nowhere (cancelling a finished request does nothing).
        for request in requests:
            engine.cancel(request)


def _whole_one(state: RunnerState, environ: Mapping, engine: Engine, job: Job, request: Request) -> dict:
    writer = writer_for(job, state)
    for ev in watched(environ, engine, request, state.note_finished):
        if ev is FLUSH:
            continue
        if isinstance(ev, Finished):
            if ev.error:
                raise generation_error(ev)
            return writer.whole(ev)
        writer.delta(ev)
    # The client is gone: nobody reads this, but answer sanely.
    raise ApiError(499, "client closed the connection", code="client_closed")


def stream(state: RunnerState, environ: Mapping, job: Job, encoded: bool = False) -> Iterator[dict | bytes | object]:
    """The job's streamed pieces, FLUSH where the engine has nothing more ready; submitted now, so a refusal is
    the answer's status, not a piece. `encoded`: the pieces go to sse() as they are, so a plain token's may be its
    event's bytes already (the writer's fast path); an adapter, which reads dicts, leaves it off."""
    engine = state.ready()
    request = submit(engine, job)
    return _pieces(writer_for(job, state, encoded), watched(environ, engine, request, state.note_finished))


def _pieces(writer: Writer, events: Iterable[Delta | Progress | Finished | object]) -> Iterator[dict | bytes | object]:
    yield from writer.start()
    yield FLUSH  # the role chunk goes out at once
    for ev in events:
        if ev is FLUSH:
            yield FLUSH
        elif not isinstance(ev, Finished):
            yield from writer.delta(ev)
        elif ev.error:
            yield generation_error(ev).body()
        else:
            yield from writer.final(ev)


def sse(job: Job, pieces: Iterable[dict | bytes | object]) -> Iterator[bytes]:
    """The pieces as server-sent events; OpenAI's streams end with [DONE], llama-server's native ones do not."""
    return joined(_events(job, pieces))


def _events(job: Job, pieces: Iterable[dict | bytes | object]) -> Iterator[bytes | object]:
    for piece in pieces:
        yield piece if piece is FLUSH or type(piece) is bytes else sse_codec.encode(piece)
    if job.kind != NATIVE:
        yield sse_codec.DONE


def joined(parts: Iterable[bytes | object]) -> Iterator[bytes]:
    """Bytes written together up to each FLUSH (and at the end): one socket write per burst of events."""
    held: list[bytes] = []
    for part in parts:
        if part is FLUSH:
            if held:
                yield b"".join(held)
                held.clear()
        elif part:
            held.append(part)
    if held:
        yield b"".join(held)
