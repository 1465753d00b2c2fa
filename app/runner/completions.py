"""The generating routes: OpenAI's chat and text completions, llama-server's /completion and /infill.

Each runs the same steps: read the body, build its jobs, then stream the answer or give it whole.
"""

from __future__ import annotations

from werkzeug.wrappers import Request as HttpRequest
from werkzeug.wrappers import Response

from app.protocols.openai import ChatBody, CompletionBody, InfillBody, NativeCompletionBody
from app.runner import generation
from app.runner.job import Job, chat_job, infill_job, native_jobs, text_job
from app.runner.state import RunnerState
from app.runner.transport import event_stream, json_response, read_body
from app.runner.writers import merge_choices


def answer(state: RunnerState, req: HttpRequest, job: Job) -> Response:
    """One job's answer: streamed, whole, or OpenAI's n choices merged into one."""
    if job.stream:
        return event_stream(generation.sse(job, generation.stream(state, req.environ, job, encoded=True)))
    answers = generation.whole(state, req.environ, [job] * job.n)
    return json_response(merge_choices(answers) if job.n > 1 else answers[0])


def on_chat(state: RunnerState, req: HttpRequest) -> Response:
    """POST /v1/chat/completions."""
    body = read_body(req, ChatBody)
    state.ready()
    return answer(state, req, chat_job(state, body, req.headers))


def on_completions(state: RunnerState, req: HttpRequest) -> Response:
    """POST /v1/completions (fill-in-the-middle with a suffix)."""
    body = read_body(req, CompletionBody)
    state.ready()
    return answer(state, req, text_job(state, body, req.headers))


def on_native_completion(state: RunnerState, req: HttpRequest) -> Response:
    """POST /completion: llama-server's own; several prompts are answered as a list in their order."""
    body = read_body(req, NativeCompletionBody)
    state.ready()
    jobs = native_jobs(state, body, req.headers)
    if len(jobs) == 1:
        return answer(state, req, jobs[0])
    return json_response(generation.whole(state, req.environ, jobs))


def on_infill(state: RunnerState, req: HttpRequest) -> Response:
    """POST /infill: llama-server's fill-in-the-middle."""
    body = read_body(req, InfillBody)
    state.ready()
    return answer(state, req, infill_job(state, body, req.headers))
