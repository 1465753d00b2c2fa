"""A request as the engine sees it: tokens, sampling settings, status and timings."""

from __future__ import annotations

import enum
import itertools
import queue
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from app.engine.text import StopMatcher, Utf8Stream
from app.policy import NO_SLO, SloTargets

if TYPE_CHECKING:
    from app.engine.grammar import Grammar
    from app.engine.reasoning_budget import BudgetTracker, ReasoningBudget
    from app.engine.speculation import Drafter


class EngineError(Exception):
    """Base of the errors the engine reports to a caller."""


class QueueFull(EngineError):
    """The waiting queue is at its limit; the caller should retry later."""

    def __init__(self, max_waiting: int, retry_after_s: int = 1):
        super().__init__(f"the engine's queue is full ({max_waiting} requests waiting); retry shortly")
        self.max_waiting = max_waiting
        self.retry_after_s = retry_after_s


class ContextOverflow(EngineError):
    """A prompt that cannot fit the context even when it runs alone."""

    def __init__(self, num_prompt_tokens: int, n_ctx: int):
        super().__init__(
            f"the prompt has {num_prompt_tokens} tokens but the context holds {n_ctx} tokens "
            f"(prompt plus at least one generated token must fit); shorten the prompt"
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.n_ctx = n_ctx


@dataclass(frozen=True)
class SamplingParams:
    """How a request's tokens are chosen and when generation stops."""

    max_tokens: int = 256
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # Constrained decoding: only tokens the grammar admits are sampled (per sequence).
    grammar: Grammar | None = None
    # Log-probabilities of each chosen token and of this many alternatives (None: none computed).
    logprobs: int | None = None
    # (token id, bias added to its logit); -inf bans the token.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Special tokens whose text is streamed with its markup (llama-server's preserved_tokens: "<think>",
    # "<tool_call>", which the answer's parser must see); every other token's special text stays hidden.
    special_ids: frozenset[int] = frozenset()
    # The thoughts' markers and budget (None: thoughts are neither counted nor bounded).
    reasoning_budget: ReasoningBudget | None = None
    # Draft tokens verified per iteration at most (llama-server's per-request "speculative.n_max"):
    # None takes the engine's setting, 0 turns drafting off for this request.
    speculative_n_max: int | None = None

    @property
    def greedy(self) -> bool:
        """True when the most likely token is always taken."""
        return self.temperature <= 0.0

    @property
    def penalised(self) -> bool:
        """True when any repetition penalty is active."""
        return (
            self.repeat_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request; every status at or above FINISHED_STOP is final."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOP = 2
    FINISHED_LENGTH = 3
    FINISHED_CANCELLED = 4
    FINISHED_ERROR = 5

    @property
    def finished(self) -> bool:
        """True for the final states."""
        return self >= RequestStatus.FINISHED_STOP

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason for a final state."""
        return {
            RequestStatus.FINISHED_STOP: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_CANCELLED: "cancelled",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


class Delta(NamedTuple):
    """A piece of generated text (complete UTF-8 characters only), with what the HTTP side reports beside it.

    A named tuple rather than a frozen dataclass: one is made per generated token, and a frozen
    dataclass's __init__ (object.__setattr__ per field) costs ~1.3 us against ~0.3 us for this.
    The reader never looks at the live Request: everything it shows of a token travels here.
    Text held back until the end (a partial stop string) comes as a last Delta of no token.
    """

    text: str
    num_tokens: int
    # The token's log-probability (and its top alternatives) when the request asked for them.
    logprob: dict | None = None
    # The generated token ids this piece covers.
    token_ids: tuple[int, ...] = ()
    slot: int = -1  # the sequence slot it was generated in
    num_cached: int = 0  # prompt tokens reused from the prefix cache
    prompt_ms: float = 0.0  # from the first scheduling to the first token
    predicted_ms: float = 0.0  # from the first token to this one


class Progress(NamedTuple):
    """How far a request's prompt is (llama-server's prompt_progress, sent when it asks return_progress)."""

    total: int  # prompt tokens
    cache: int  # of them reused from the prefix cache
    processed: int  # in the KV cache now, cached ones included
    time_ms: float  # since the prompt started computing
    slot: int = -1  # the sequence slot computing it


@dataclass(frozen=True)
class Finished:
    """The last event of a request."""

    finish_reason: str
    stats: RequestStats
    error: str | None = None
    slot: int = -1  # the slot it ran in (-1: it never ran)
    output_tokens: tuple[int, ...] = ()
    stop_word: str = ""  # the stop string that ended it, if one did
    num_reasoning_tokens: int = 0  # generated inside a thought (counted when the request named its markers)


@dataclass(frozen=True)
class RequestStats:
    """Per-request timings and counts, in milliseconds from arrival at the engine."""

    request_id: int
    class_name: str
    priority: int
    num_prompt_tokens: int
    num_completion_tokens: int
    num_preemptions: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache at the first admission
    queue_ms: float
    ttft_ms: float | None
    tpot_ms: float | None
    total_ms: float
    finish_reason: str
    # Speculative decoding: draft tokens verified for this request and how many of them were kept.
    num_draft_tokens: int = 0
    num_draft_accepted: int = 0
    # Images in the prompt, and the time the projector spent encoding them (those reused from the prefix
    # cache are not encoded: 0 ms), as MediaStep measured it around each encode.
    num_images: int = 0
    image_encode_ms: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for JSON responses."""
        return dict(self.__dict__)


# Arrival order among requests of one engine: the tie-break of every ordering (never shown to a client).
_seqs = itertools.count(1)


def new_request_id() -> int:
    """A random request id (timings.request_id, /slots' id_task): a counter would show every family
    member how many requests the household sent between two of theirs. 53 bits: exact in JavaScript."""
    return secrets.randbits(53)



@dataclass(eq=False)
class Request:
    """One generation: prompt tokens in, output tokens out, owned by the engine thread once submitted."""

    prompt_tokens: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    class_name: str = "default"
    # Whose request it is (the gateway's member) and whether its class is private: the prefix cache tags the
    # cells it leaves with them (app.engine.prefix_cache.Tag), so the disk tier knows whose words a file holds.
    owner: str | None = None
    private: bool = False
    request_id: int = field(default_factory=new_request_id)
    arrival_s: float = field(default_factory=time.monotonic)
    seq: int = field(default_factory=lambda: next(_seqs))

    status: RequestStatus = RequestStatus.WAITING
    output_tokens: list[int] = field(default_factory=list)
    # Tokens of prompt+output already in the KV cache; reset to 0 on preemption (recompute).
    num_computed: int = 0
    # False: compute the whole prompt and leave nothing in the prefix cache (llama-server's cache_prompt).
    cache_prompt: bool = True
    num_cached_tokens: int = 0
    slot: int | None = None
    num_preemptions: int = 0
    # The class's targets and preemptibility, as the gateway sent them (app.policy.SLO_HEADER).
    slo: SloTargets = NO_SLO
    # When it last got a slot: a sequence resumed after a preemption is not preempted again for a while.
    admitted_s: float | None = None
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None
    error: str | None = None
    # Engine-side state: the backend's own sampler (opaque to the engine) and the text pipeline.
    sampler: object | None = None
    text_state: tuple[Utf8Stream, StopMatcher] | None = None
    # The reasoning budget's state, when the request has one (SamplingParams.reasoning_budget).
    budget: BudgetTracker | None = None
    # Its draft source when the engine speculates (app.engine.speculation.Drafter), else None.
    drafter: Drafter | None = None
    events: queue.SimpleQueue[Delta | Progress | Finished] = field(default_factory=queue.SimpleQueue)
    # llama-server's return_progress: a Progress event before the prompt and after each of its chunks.
    return_progress: bool = False
    progress_started: bool = False
    # The prompt's images (app.engine.media.MediaPrompt), None for a text prompt.
    media: object | None = None
    # prompt + output, kept up to date by all_tokens instead of concatenated on every call (the
    # scheduler reads a sequence's last token every iteration).
    _tokens: list[int] = field(default_factory=list, init=False, repr=False)

    @property
    def all_tokens(self) -> list[int]:
        """Prompt followed by what has been generated so far: a live list, read it, never change it."""
        tokens, out = self._tokens, self.output_tokens
        n_prompt = len(self.prompt_tokens)
        have = len(tokens) - n_prompt
        if have != len(out):
            if 0 <= have < len(out) and len(tokens) >= n_prompt:
                # Output only ever grows by appends: copy just the new tail.
                tokens.extend(out[have:])
            else:
                tokens[:] = self.prompt_tokens + out
        return tokens

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_tokens) + len(self.output_tokens)

    @property
    def num_pending(self) -> int:
        """Tokens that still have to go through the model before the next sample."""
        return self.num_tokens - self.num_computed

    @property
    def is_decoding(self) -> bool:
        """True when exactly one token stands between this sequence and its next sample."""
        out = self.output_tokens
        # Inlined num_pending: the scheduler asks twice per sequence per iteration.
        return bool(out) and len(self.prompt_tokens) + len(out) - self.num_computed == 1

    def sort_key(self) -> tuple[int, float, int]:
        """Admission order: priority (lower first), then arrival, then submission order as a tie-break."""
        return (self.priority, self.arrival_s, self.seq)

    def make_stats(self) -> RequestStats:
        """Freeze this request's timings; call once it has finished."""
        end = self.finished_s if self.finished_s is not None else time.monotonic()
        start_run = self.first_scheduled_s if self.first_scheduled_s is not None else end
        n_out = len(self.output_tokens)
        ttft_ms = None if self.first_token_s is None else (self.first_token_s - self.arrival_s) * 1000
        tpot_ms = None
        if self.first_token_s is not None and self.last_token_s is not None and n_out > 1:
            # Between output tokens: an EOS sampled one decode later is not an output token.
            tpot_ms = (self.last_token_s - self.first_token_s) * 1000 / (n_out - 1)
        return RequestStats(
            request_id=self.request_id,
            class_name=self.class_name,
            priority=self.priority,
            num_prompt_tokens=len(self.prompt_tokens),
            num_completion_tokens=n_out,
            num_preemptions=self.num_preemptions,
            num_cached_tokens=self.num_cached_tokens,
            queue_ms=(start_run - self.arrival_s) * 1000,
            ttft_ms=ttft_ms,
            tpot_ms=tpot_ms,
            total_ms=(end - self.arrival_s) * 1000,
            finish_reason=self.status.finish_reason or "unknown",
            num_draft_tokens=self.drafter.num_drafted if self.drafter is not None else 0,
            num_draft_accepted=self.drafter.num_accepted if self.drafter is not None else 0,
            num_images=self.media.num_images if self.media is not None else 0,
            image_encode_ms=self.media.encode_ms if self.media is not None else 0.0,
        )
