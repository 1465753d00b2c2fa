"""Other APIs on the runner: Anthropic's Messages and OpenAI's Responses, through their adapters.

They are the chat route's generation in other words, served as llama-server serves them: the
adapter turns the body into a chat request, which becomes one chat job (its prompt rendered and
tokenized once); the chat writer's answer (a chat.completion, or its chunks as they are made
from the engine's events) goes to the adapter, which writes its own API's answer. Token counts
come from the same prompt builder as the chat route's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from pydantic import ValidationError
from werkzeug.wrappers import Request as HttpRequest
from werkzeug.wrappers import Response

from app.protocols.adapter import Adapter
from app.protocols.anthropic import MessagesAdapter
from app.protocols.openai import ChatBody, validation_error
from app.protocols.responses import ResponsesAdapter
from app.runner import generation
from app.runner.job import Job, chat_job, job_prompt
from app.runner.state import RunnerState
from app.runner.transport import event_stream, json_response, read_object


def _chat_body(chat: dict) -> ChatBody:
    """An adapter's chat request, validated as the chat route validates its own."""
    try:
        return ChatBody.model_validate(chat)
    except ValidationError as exc:
        raise validation_error(exc)


def _named(state: RunnerState, body: dict) -> dict:
    """The body with the runner's model name, which its answers carry (as the chat route's do)."""
    return {**body, "model": state.config.model_name}


def _answer(state: RunnerState, req: HttpRequest, adapter: Adapter, job: Job) -> Response:
    """The job's answer in the adapter's API: its stream, or its whole answer."""
    if job.stream:
        return event_stream(_adapted(adapter, generation.stream(state, req.environ, job)), adapter.stream_mimetype)
    return json_response(adapter.answer(generation.whole(state, req.environ, [job])[0]))


def _adapted(adapter: Adapter, chunks: Iterable[dict | object]) -> Iterator[bytes]:
    return generation.joined(_adapter_events(adapter, chunks))


def _adapter_events(adapter: Adapter, chunks: Iterable[dict | object]) -> Iterator[bytes | object]:
    yield from adapter.start()
    for chunk in chunks:
        if chunk is generation.FLUSH:
            yield chunk
        else:
            yield from adapter.feed(chunk)
    yield from adapter.end()


def on_messages(state: RunnerState, req: HttpRequest) -> Response:
    """POST /v1/messages."""
    adapter = MessagesAdapter(_named(state, read_object(req)))
    body = _chat_body(adapter.to_openai())
    state.ready()
    job = chat_job(state, body, req.headers)
    # message_start carries the prompt's size before any token is generated.
    adapter.input_tokens = len(job.tokens)
    return _answer(state, req, adapter, job)


def on_count_tokens(state: RunnerState, req: HttpRequest) -> Response:
    """POST /v1/messages/count_tokens: the size of the prompt /v1/messages would run."""
    chat = MessagesAdapter(read_object(req)).to_openai()
    state.ready()
    return json_response({"input_tokens": len(job_prompt(state, _chat_body(chat)).tokens)})


def on_responses(state: RunnerState, req: HttpRequest) -> Response:
    """POST /v1/responses."""
    adapter = ResponsesAdapter(_named(state, read_object(req)))
    body = _chat_body(adapter.to_openai())
    state.ready()
    return _answer(state, req, adapter, chat_job(state, body, req.headers))


def on_input_tokens(state: RunnerState, req: HttpRequest) -> Response:
    """POST /v1/responses/input_tokens: the size of the prompt /v1/responses would run."""
    chat = ResponsesAdapter(read_object(req)).to_openai()
    state.ready()
    return json_response({"object": "response.input_tokens",
                          "input_tokens": len(job_prompt(state, _chat_body(chat)).tokens)})
