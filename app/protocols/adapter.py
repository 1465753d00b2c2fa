"""The one interface every API adapter keeps: its request as an OpenAI chat request, the answer back in its shape.

Hearth generates in OpenAI's chat shape (the runner's chat route, stock llama-server and remote
nodes all answer it). Anthropic Messages, OpenAI Responses and Ollama are translations of it, each an
adapter built from the client's body. The gateway feeds an adapter the runner's answer after
relaying it; the runner feeds it its own chat chunks, built from engine events, without going
through HTTP again. Either way the adapter sees the same OpenAI dicts, so it is written once.

    adapter = SomeAdapter(body)            # the client's JSON body, as sent
    chat = adapter.to_openai()             # -> an OpenAI request (ApiError on a bad body)
    whole: adapter.answer(completion)      # the OpenAI answer (chat.completion ...) -> the API's answer (a dict)
    streamed: adapter.start() + adapter.feed(chunk) per chat.completion.chunk + adapter.end()
                                           # -> the bytes of the API's stream, piece by piece
    errors: adapter.error(err)             # an ApiError -> (status, body dict) in the API's shape
"""

from __future__ import annotations

from typing import Protocol

from app.protocols.openai import ApiError


class Adapter(Protocol):
    """A client API on top of OpenAI's chat shape (see the module docstring for the call order)."""

    # The content type of a streamed answer: text/event-stream, or Ollama's application/x-ndjson.
    stream_mimetype: str

    def to_openai(self) -> dict:
        """The client's body as an OpenAI request, chat for most (Ollama's generate: a text completion,
        its embed: embeddings), with its `model` kept as the client named it."""
        ...

    def answer(self, completion: dict) -> dict:
        """A whole OpenAI answer (a chat completion, or what to_openai asked for) as this API's answer."""
        ...

    def start(self) -> list[bytes]:
        """What the stream opens with, before the first chunk (may be nothing)."""
        ...

    def feed(self, chunk: dict) -> list[bytes]:
        """The stream's pieces for one OpenAI chat.completion.chunk (or an {"error": ...} payload)."""
        ...

    def end(self) -> list[bytes]:
        """What the stream closes with once the chat stream has ended (a missing finish is this API's error)."""
        ...

    def error(self, err: ApiError) -> tuple[int, dict]:
        """An error as this API answers it: HTTP status and body."""
        ...
