"""Images in a prompt: their place among the tokens, and their evaluation between the engine's iterations.

A prompt with images is one token list in which each image's positions hold placeholder ids: negative
(never a vocabulary id), derived from a hash of the image's bytes and the offset in the image. So the
prefix cache, which compares token lists, reuses an image's cells when a later prompt holds the same
image at the same place (a follow-up turn), and never when the image differs, whatever its position.

An image chunk cannot go into the engine's token batch: llama.cpp's batch is either tokens or
embeddings, and Gemma 3 attends across the whole image (non-causal), so it must be one decode of its
own. The scheduler stops a sequence's prompt chunks at its next image (`MediaPrompt.text_run`); the
engine's MediaStep, before each iteration, (1) starts the image's encoding (the vision tower, the costly
part) in a worker thread as soon as the sequence holds a slot, so other sequences keep decoding while it
runs, and (2) once the sequence has reached the image and its embeddings are ready, evaluates them into
the sequence's KV cells — a pause for the others about as long as a prefill chunk of that many tokens.

Pure Python except through the backend (app.engine.mtmd_model.Projector, or a fake in tests).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger(__name__)

# The text an image stands as in a rendered prompt (libmtmd's default marker; the projector is told it).
MEDIA_MARKER = "<__media__>"
# Placeholder ids are -(1 + (h + i) mod PLACEHOLDER_SPACE): distinct per image and offset, never >= 0, and
# within llama_token's int32, so whatever stores token ids as int32 (a KV tier on disk) keeps them. Two
# images collide only when their hashes agree mod 2^31 - 1.
PLACEHOLDER_SPACE = 2**31 - 1
# How long the engine thread waits on an encode when nothing else can run, before looking again
# (a new request may have arrived meanwhile).
ENCODE_POLL_S = 0.005


def image_key(data: bytes) -> str:
    """The name of an image in the prefix cache: a hash of its bytes."""
    return hashlib.sha256(data).hexdigest()


def placeholder_tokens(key: str, n_tokens: int) -> list[int]:
    """The ids an image's positions hold in the prompt."""
    base = int(hashlib.sha256(key.encode()).hexdigest()[:16], 16)
    return [-(1 + (base + i) % PLACEHOLDER_SPACE) for i in range(n_tokens)]


@dataclass(eq=False)
class MediaSpan:
    """One image in a prompt: where it starts, how many positions it takes, what it is."""

    start: int
    n_tokens: int
    key: str
    handle: object = None  # the backend's chunk (an owned mtmd_input_chunk)
    non_causal: bool = False
    # Set by MediaStep: the encode's future, then its embeddings and the time the encode took.
    future: Future | None = None
    embd: object = None
    encode_ms: float | None = None

    @property
    def end(self) -> int:
        """The first position after the image."""
        return self.start + self.n_tokens


@dataclass(eq=False)
class MediaPrompt:
    """The images of one request's prompt, in order."""

    spans: list[MediaSpan]
    decode_ms: list[float] = field(default_factory=list)  # each image's llama_decode, as measured

    @property
    def num_images(self) -> int:
        """Images in the prompt."""
        return len(self.spans)

    @property
    def encode_ms(self) -> float:
        """Time spent encoding this prompt's images (0 for those reused from the prefix cache)."""
        return sum(s.encode_ms or 0.0 for s in self.spans)

    def text_run(self, pos: int, pending: int) -> int:
        """Of `pending` tokens from `pos`, how many a token batch may take: up to the next image's start."""
        for s in self.spans:
            if s.end > pos:
                return min(pending, max(0, s.start - pos))
        return pending

    def span_at(self, pos: int) -> MediaSpan | None:
        """The image that covers position pos, if one does."""
        for s in self.spans:
            if s.start <= pos < s.end:
                return s
        return None


class MediaBackend(Protocol):
    """What MediaStep needs of a projector (app.engine.mtmd_model.Projector)."""

    def encode(self, span: MediaSpan): ...
    def decode(self, slot: int, pos: int, span: MediaSpan, embd) -> int: ...
    def share_cpu(self, encoding: bool) -> None: ...


class MediaStep:
    """The engine's hook for images: encode in a worker, evaluate between iterations (see the module doc)."""

    def __init__(self, backend: MediaBackend, max_batch_tokens: int, clock=time.monotonic, inline: bool = False):
        self.backend = backend
        self.max_batch_tokens = max_batch_tokens
        self.clock = clock
        # inline: encode on the engine thread, every sequence waiting meanwhile (the bench's baseline arm).
        self.inline = inline
        # One worker: encodes are serialised by libmtmd's output buffer anyway.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hearth-encode")
        self.lock = threading.Lock()  # guards the counters below (read by /metrics)
        # Measured, for the benchmark and /metrics: per image, the engine-thread pause and the encode.
        self.images_total = 0
        self.encode_seconds_total = 0.0
        self.decode_seconds_total = 0.0
        self.encode_ms_by_class: dict[str, float] = {}
        self.images_by_class: dict[str, int] = {}
        self.max_decode_ms = 0.0
        self.last_encode_ms: float | None = None
        self._sharing = False  # whether the backend was told an encode runs beside the decodes

    def close(self) -> None:
        """Stop the worker (encodes under way finish first)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._sharing:
            self._sharing = False
            self.backend.share_cpu(False)

    def _encode(self, span: MediaSpan) -> None:
        t0 = time.perf_counter()
        span.embd = self.backend.encode(span)
        span.encode_ms = self.last_encode_ms = (time.perf_counter() - t0) * 1000

    def _encode_now(self, span: MediaSpan) -> Future:
        done: Future = Future()
        try:
            self._encode(span)
            done.set_result(None)
        except Exception as exc:
            done.set_exception(exc)
        return done

    def before_iteration(self, engine) -> None:
        """Start encodes for admitted sequences, and evaluate every image a sequence has reached and has ready.

        Engine thread; scheduler state is changed under the engine's lock."""
        scheduler = engine.scheduler
        # Less urgent prompts wait while a more urgent one with media is still in its prompt (its encode, the
        # embeddings' decode, the text after them): its first token is not queued behind their prefill, and the
        # encode has the cores their prefill would take (decoding sequences go on).
        hold = min((r.priority for r in scheduler.running
                    if r.media is not None and not r.is_decoding and r.num_pending > 0), default=None)
        with engine.lock:
            scheduler.media_prompt_priority = hold
        blocked: list[Future] = []
        can_run = False
        for r in list(scheduler.running):
            media = r.media
            if media is None:
                can_run = can_run or r.is_decoding or hold is None or r.priority <= hold
                continue
            for s in media.spans:
                # A prompt's spans may be shared (n choices of one prompt): each image is encoded once.
                if s.end > r.num_computed and s.future is None and s.embd is None:
                    s.future = self._encode_now(s) if self.inline else self._pool.submit(self._encode, s)
            span = media.span_at(r.num_computed)
            if span is None:
                can_run = True
                continue
            if span.start != r.num_computed:
                # Cells stop inside an image only if something cut a path mid-image: the image cannot resume.
                engine.fail_request(r, "the KV cache holds part of an image; resend the request")
                continue
            if span.embd is None:
                error = span.future.exception() if span.future.done() else None
                if error is not None:
                    engine.fail_request(r, f"the image could not be encoded: {error}")
                    continue
                blocked.append(span.future)
                continue
            self._evaluate(engine, r, span)
            can_run = True
        if blocked and not can_run and not scheduler.waiting:
            # Nothing else to do (held prompts included): wait for an encode here instead of spinning through
            # empty iterations on the cores the encode needs.
            wait_futures(blocked, timeout=ENCODE_POLL_S)
        encoding = any(s.future is not None and not s.future.done()
                       for r in scheduler.running if r.media is not None for s in r.media.spans)
        if encoding != self._sharing:
            self._sharing = encoding
            self.backend.share_cpu(encoding)

    def _evaluate(self, engine, r, span: MediaSpan) -> None:
        """Decode one image's embeddings into the sequence's cells and record them as computed."""
        if span.non_causal and span.n_tokens > self.max_batch_tokens:
            engine.fail_request(r, f"the image takes {span.n_tokens} positions, more than one micro-batch "
                                   f"({self.max_batch_tokens}); start the runner with a larger -ub")
            return
        scheduler = engine.scheduler
        with engine.lock:
            scheduler.make_room(span.n_tokens)
        t0 = time.perf_counter()
        rc = self.backend.decode(r.slot, r.num_computed, span, span.embd)
        if rc != 0:
            with engine.lock:
                freed = scheduler.cache.evict(span.n_tokens)
            if freed:
                rc = self.backend.decode(r.slot, r.num_computed, span, span.embd)
        decode_s = time.perf_counter() - t0
        if rc != 0:
            engine.fail_request(r, f"no room in the KV cache for the image's {span.n_tokens} positions "
                                   f"(llama_decode returned {rc})")
            return
        with engine.lock:
            scheduler.cache.extend(r.slot, r.all_tokens[span.start : span.end])
            r.num_computed = span.end
        r.media.decode_ms.append(decode_s * 1000)
        with self.lock:
            self.images_total += 1
            self.decode_seconds_total += decode_s
            self.max_decode_ms = max(self.max_decode_ms, decode_s * 1000)
            self.encode_seconds_total += (span.encode_ms or 0.0) / 1000
            self.encode_ms_by_class[r.class_name] = self.encode_ms_by_class.get(r.class_name, 0.0) + (
                span.encode_ms or 0.0)
            self.images_by_class[r.class_name] = self.images_by_class.get(r.class_name, 0) + 1
