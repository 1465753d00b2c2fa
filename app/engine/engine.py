"""The engine thread: one per model, one batch and one llama_decode per iteration."""

from __future__ import annotations

import collections
import copy
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from app.engine.kv_tiers import DiskTier, attach_tiers
from app.engine.prefix_cache import PrefixCacheCounters
from app.engine.reasoning_budget import BudgetTracker
from app.engine.request import (
    ContextOverflow,
    Delta,
    Finished,
    Progress,
    Request,
    RequestStats,
    RequestStatus,
    SamplingParams,
)
from app.engine.scheduler import PACE_WARMUP_ITERATIONS, Chunk, Scheduler, SchedulerConfig
from app.engine.speculation import NO_SPEC, SpecConfig
from app.engine.text import StopMatcher, Utf8Stream
from app.policy import NO_SLO, Mode, SloTargets

log = logging.getLogger(__name__)

# ModelBackend.decode's return codes, llama_decode's own: done, or no KV slot for the batch (preempt and retry).
DECODE_OK = 0
DECODE_NO_KV_SLOT = 1
# A held engine (hold()) looks again this often: a hold's end is also signalled, this only bounds a missed one.
HOLD_RECHECK_S = 1.0


class ModelBackend(Protocol):
    """What the engine needs from a model; LlamaModel is the real one, tests bring fakes."""

    n_ctx: int
    n_batch: int
    n_seq_max: int
    n_swa: int  # sliding-window size of the model's SWA layers, 0 when it has none

    def decode(self, chunks: list[Chunk]) -> tuple[int, list[int]]: ...
    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None: ...
    def seq_rm(self, seq: int, p0: int, p1: int) -> None: ...
    def kv_share_blocker(self) -> str | None: ...
    def make_sampler(self, params: SamplingParams, prompt_tokens: list[int]): ...
    def sample(self, sampler, params: SamplingParams, batch_index: int) -> int: ...
    def force(self, sampler, params: SamplingParams, token: int) -> bool: ...
    def free_sampler(self, sampler) -> None: ...
    def logprob(self, batch_index: int, token: int, top_n: int) -> dict: ...
    def token_bytes(self, token: int) -> bytes: ...
    def special_bytes(self, token: int) -> bytes: ...
    def is_eog(self, token: int) -> bool: ...


@dataclass(frozen=True)
class IterationStats:
    """One engine iteration, as measured."""

    start_s: float
    num_seqs: int  # sequences with tokens in the batch
    num_prompt_tokens: int
    num_decode_tokens: int
    kv_used: int  # cells held by running sequences
    kv_total: int
    num_running: int
    num_waiting: int
    iteration_ms: float
    decode_ms: float
    num_preemptions: int
    kv_cached: int = 0  # cells held only by the prefix cache
    num_draft_tokens: int = 0  # draft tokens verified (speculative decoding)
    num_accepted_tokens: int = 0  # of them kept

    @property
    def outside_decode_ms(self) -> float:
        """Time of the iteration spent outside llama_decode (scheduling, sampling, streaming)."""
        return max(0.0, self.iteration_ms - self.decode_ms)


@dataclass
class EngineCounters:
    """Monotonic totals since start, for /metrics."""

    prompt_tokens_total: int = 0
    prompt_seconds_total: float = 0.0
    tokens_predicted_total: int = 0
    tokens_predicted_seconds_total: float = 0.0
    decode_calls_total: int = 0
    busy_slots_total: int = 0
    iterations_total: int = 0
    preemptions_total: int = 0
    held_seconds_total: float = 0.0  # paused for another runner's more urgent request (Engine.hold)
    requests_total: int = 0
    requests_finished: collections.Counter = None  # type: ignore[assignment]
    # Speculative decoding, as llama-server counts it: verification steps, draft tokens, accepted ones.
    spec_drafts_total: int = 0
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    spec_accepted_per_pos: list = None  # type: ignore[assignment]
    # class → [drafts, draft tokens, accepted tokens]
    spec_by_class: dict = None  # type: ignore[assignment]

    def __post_init__(self):
        self.requests_finished = collections.Counter()
        self.spec_accepted_per_pos = []
        self.spec_by_class = {}

    def copy(self) -> EngineCounters:
        """A copy that later iterations do not change (its counter, list and dict copied too)."""
        c = copy.copy(self)
        c.requests_finished = collections.Counter(self.requests_finished)
        c.spec_accepted_per_pos = list(self.spec_accepted_per_pos)
        c.spec_by_class = {name: list(v) for name, v in list(self.spec_by_class.items())}
        return c


@dataclass(frozen=True)
class EngineSnapshot:
    """A consistent view of the engine for /health, /slots and /metrics."""

    mode: str
    num_running: int
    num_waiting: int
    kv_used: int
    kv_total: int
    n_seq_max: int
    token_budget: int
    slots: list[dict]
    last_iteration: IterationStats | None
    kv_cached: int = 0
    prefix_cache: bool = False
    prefix_cache_note: str | None = None  # why the cache is off, or how it is kept (sliding window)
    prefix_cache_entries: int = 0
    # The SLO budget: the last iteration's prefill limit, the TPOT target it followed, the fitted costs.
    prefill_budget: int = 0
    tightest_tpot_ms: float | None = None
    cost: dict | None = None
    # What the hardware can keep (ChunkCosts): the knee, per-chunk costs, the TPOT a full batch keeps while
    # prefilling at the knee, and the pace the budget kept last instead of an out-of-reach target (None: none).
    feasibility: dict | None = None
    preemptions_by_class: dict | None = None  # {(class, reason): count}
    # Speculative decoding: the settings and this iteration's decision ("" drafting, else why not).
    spec: dict | None = None
    spec_note: str = ""
    # The cost rule's record per draft source it decided for (speculation.decide: acceptance, decisions, the last
    # one and why) and the measured verify costs it prices drafts by (VerifyCosts).
    spec_sources: dict | None = None
    verify_costs: dict | None = None
    # The totals since start (/metrics, /props' speculative block) and the prefix cache's, copied at snapshot time,
    # so readers never hold the engine's live counters.
    counters: EngineCounters | None = None
    prefix_cache_counters: PrefixCacheCounters | None = None
    prefix_cache_max_entries: int = 0


class Engine:
    """Owns the scheduler and the model; callers submit requests and read their events.

    The loop, once per iteration:
      1. apply cancellations (their KV is freed now);
      2. admit waiting requests in policy order (priority, then arrival) while slots and KV allow; a more
         urgent one preempts a preemptible, less urgent sequence (its cells stay cached) when they do not;
      3. build one batch: a decode token per generating sequence, then prompt chunks up to the prefill
         budget the tightest running TPOT target and the measured iteration cost allow;
      4. llama_decode once; on "no KV slot" preempt the lowest-priority, most recent sequence and retry;
      5. sample per sequence (or take the reasoning budget's forced end of thought), stream UTF-8-safe text,
         stop on EOS / stop string / max_tokens;
      6. release finished sequences at once.
    """

    def __init__(
        self,
        model: ModelBackend,
        mode: Mode | str = Mode.CONTINUOUS,
        token_budget: int | None = None,
        max_waiting: int = 256,
        iteration_history: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        slo_budget: bool = True,
        prefix_cache: bool = True,
        spec: SpecConfig = NO_SPEC,
        cache_ram_bytes: int | None = 0,
        cache_disk: DiskTier | None = None,
        media=None,
        draft_model=None,
    ):
        self.model = model
        # Images in prompts (app.engine.media.MediaStep), None when the model has no projector.
        self.media = media
        self.clock = clock
        blocker = model.kv_share_blocker()
        cache_on = prefix_cache and blocker is None
        if not prefix_cache:
            self.prefix_cache_note: str | None = "off: the prefix_cache setting"
        elif blocker is not None:
            self.prefix_cache_note = f"off: {blocker}"
        elif model.n_swa:
            self.prefix_cache_note = (
                f"on; sliding window of {model.n_swa} tokens: cached cells are held under two sequence ids "
                "in the full-size SWA cache, so llama.cpp never overwrites them"
            )
        else:
            self.prefix_cache_note = None
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_seqs=model.n_seq_max,
                kv_cells=model.n_ctx,
                max_batch_tokens=model.n_batch,
                token_budget=token_budget or model.n_batch,
                mode=Mode(mode),
                max_waiting=max_waiting,
                slo_budget=slo_budget,
                prefix_cache=cache_on,
                kv_guard=cache_on and model.n_swa > 0,
                spec=spec,
            ),
            memory=model,
        )
        # draft-simple's second model (app.engine.draft_model.DraftModel): the scheduler asks it for drafts.
        self.draft_model = draft_model
        if spec.enabled and spec.uses_draft_model != (draft_model is not None):
            raise ValueError(f"--spec-type {spec.type} needs a draft model (-md)" if spec.uses_draft_model
                             else f"a draft model drafts only with --spec-type draft-simple, not {spec.type}")
        if draft_model is not None and spec.enabled:
            self.scheduler.attach_draft(draft_model)
        # The host-RAM tier under the prefix cache (0: off, None: no byte limit) and the disk tier under it;
        # None when both are off or the model cannot save states.
        self.tiers = attach_tiers(self.scheduler, model, cache_ram_bytes, clock, cache_disk)
        self.counters = EngineCounters()
        self._last_full_start: float | None = None  # the start of the last iteration, when it was a full batch (_note_period)
        self.iterations: collections.deque[IterationStats] = collections.deque(maxlen=iteration_history)
        self.finished_listeners: list[Callable[[RequestStats], None]] = []
        self._cv = threading.Condition()
        self._cancels: set[Request] = set()
        self._held: list[tuple[Request, int]] = []  # STATIC mode: finished (with their slot), answered when their batch ends
        # Events a verification holds back until its burst is complete (see _send); None: sent at once.
        self._outbox: list[tuple[Request, object]] | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        # Another runner on the same cores serves a more urgent request (serve's CoreShare, POST /hearth/hold):
        # (that request's priority, until when). See hold().
        self._hold: tuple[int, float] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Engine:
        """Start the engine thread."""
        self._thread = threading.Thread(target=self._run, name="hearth-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the loop; requests still in the engine finish as cancelled."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self.media is not None:
            self.media.close()

    @property
    def lock(self):
        """The engine's lock, for a hook on the engine thread that changes scheduler state (MediaStep)."""
        return self._cv

    def hold(self, priority: int | None, for_s: float = 0.0) -> None:
        """Yield the cores to another runner's more urgent request: until `for_s` from now (or until called with
        priority None), no iteration runs while every request here is of a preemptible class less urgent than
        `priority`. A request that is not (a voice question arriving here too) runs at once, the others with it.

        On a CPU, two runners decoding at once each get half the cores at best, and far less with llama.cpp's
        OpenMP threads spinning in each other's way: a voice transcription took 5-7 s instead of 0.5 s beside two
        background streams on another runner (`hearth bench voice-loop`). Serve's CoreShare calls this."""
        with self._cv:
            self._hold = None if priority is None or for_s <= 0 else (priority, self.clock() + for_s)
            self._cv.notify_all()

    def _held_for_s(self) -> float:
        """Seconds left of a hold that applies to every request here now; 0 when none does (under the lock)."""
        if self._hold is None:
            return 0.0
        priority, until = self._hold
        left = until - self.clock()
        if left <= 0:
            self._hold = None
            return 0.0
        requests = [*self.scheduler.running, *self.scheduler.waiting]
        if any(not r.slo.preemptible or r.priority <= priority for r in requests):
            return 0.0
        return left

    def fail_request(self, request: Request, error: str) -> None:
        """End a running request with an error from the engine thread (a hook's failure: a bad image)."""
        with self._cv:
            if not request.status.finished:
                self._finish(request, RequestStatus.FINISHED_ERROR, error=error)

    # -- callers' side ----------------------------------------------------------------------

    def submit(
        self,
        prompt_tokens: list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        class_name: str = "default",
        arrival_s: float | None = None,
        owner: str | None = None,
        private: bool = False,
        cache_prompt: bool = True,
        slo: SloTargets = NO_SLO,
        return_progress: bool = False,
        media=None,
    ) -> Request:
        """Queue a request; raises ContextOverflow or QueueFull at once instead of failing later.

        media: the prompt's images (app.engine.media.MediaPrompt), which need the engine's MediaStep."""
        params = params or SamplingParams()
        if not prompt_tokens:
            raise ValueError("the prompt is empty")
        request = Request(
            prompt_tokens=list(prompt_tokens),
            params=params,
            priority=priority,
            class_name=class_name,
            owner=owner,
            private=private,
            arrival_s=self.clock() if arrival_s is None else arrival_s,
            cache_prompt=cache_prompt,
            slo=slo,
            return_progress=return_progress,
            media=media,
        )
        if media is not None and self.media is None:
            raise ValueError("this model has no projector: it cannot take images")
        if len(request.prompt_tokens) >= self.model.n_ctx:
            raise ContextOverflow(len(request.prompt_tokens), self.model.n_ctx)
        request.text_state = (Utf8Stream(), StopMatcher(list(params.stop)))
        if params.reasoning_budget is not None:
            request.budget = BudgetTracker(params.reasoning_budget)
        request.sampler = self.model.make_sampler(params, request.prompt_tokens)
        with self._cv:
            try:
                self.scheduler.add_request(request)
            except Exception:
                self.model.free_sampler(request.sampler)
                raise
            self.counters.requests_total += 1
            self._cv.notify_all()
        return request

    def cancel(self, request: Request) -> None:
        """Ask the engine to drop a request; its KV is freed at the start of the next iteration."""
        with self._cv:
            if not request.status.finished:
                self._cancels.add(request)
                self._cv.notify_all()

    def events(self, request: Request, poll_s: float = 0.25) -> Iterator[Delta | Finished | None]:
        """Yield a request's events; yields None every poll_s while nothing arrives (to check the client)."""
        while True:
            try:
                ev = request.events.get(timeout=poll_s)
            except queue.Empty:
                yield None
                continue
            yield ev
            if isinstance(ev, Finished):
                return

    def snapshot(self) -> EngineSnapshot:
        """Current state for health, slots and metrics endpoints."""
        with self._cv:
            s = self.scheduler
            slots = []
            by_slot = {r.slot: r for r in s.running}
            for slot in range(s.config.max_seqs):
                r = by_slot.get(slot)
                slots.append(
                    {
                        "id": slot,
                        "is_processing": r is not None,
                        "request_id": r.request_id if r else None,
                        "class": r.class_name if r else None,
                        "priority": r.priority if r else None,
                        "n_prompt_tokens": len(r.prompt_tokens) if r else 0,
                        "n_decoded": len(r.output_tokens) if r else 0,
                        "n_ctx_used": r.num_computed if r else 0,
                        "n_prompt_tokens_cache": r.num_cached_tokens if r else 0,
                        "prefilling": bool(r and not r.is_decoding),
                        "preemptions": r.num_preemptions if r else 0,
                    }
                )
            return EngineSnapshot(
                mode=s.config.mode.value,
                num_running=len(s.running),
                num_waiting=len(s.waiting),
                kv_used=s.kv_used,
                kv_total=s.config.kv_cells,
                n_seq_max=s.config.max_seqs,
                token_budget=s.config.token_budget,
                slots=slots,
                last_iteration=self.iterations[-1] if self.iterations else None,
                kv_cached=s.kv_cached,
                prefix_cache=s.cache.enabled,
                prefix_cache_note=self.prefix_cache_note,
                prefix_cache_entries=len(s.cache.entries),
                prefill_budget=s.prefill_budget,
                tightest_tpot_ms=s.tightest_tpot_ms,
                cost=s.cost.as_dict(),
                feasibility=s.feasibility(),
                preemptions_by_class=dict(s.preemptions_by_class),
                spec=s.config.spec.as_dict() if s.config.spec.enabled else None,
                spec_note=s.spec_note,
                spec_sources={name: a.as_dict() for name, a in s.spec_stats.items() if a.last is not None}
                if s.config.spec.enabled else None,
                verify_costs=s.verify_costs.as_dict() if s.config.spec.enabled else None,
                counters=self.counters.copy(),
                prefix_cache_counters=copy.copy(s.cache.counters),
                prefix_cache_max_entries=s.cache.max_entries,
            )

    # -- engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._cancels and not self.scheduler.has_work:
                    # Idle a moment with prefixes the disk tier lacks: write them (a turn that follows at once
                    # is not made to wait for the copy).
                    if self.tiers is not None and self.tiers.has_unwritten():
                        if not self._cv.wait(self.tiers.idle_write_delay_s):
                            self.tiers.idle()
                        continue
                    self._cv.wait()
                if self._stopping:
                    break
                self._apply_cancels()
                held = self._held_for_s()
                if held > 0:
                    t0 = time.monotonic()  # real seconds paused, whatever clock the schedule keeps
                    self._cv.wait(min(held, HOLD_RECHECK_S))
                    self.counters.held_seconds_total += time.monotonic() - t0
                    continue
            try:
                self._iterate()
            except Exception as exc:  # the engine must outlive one bad iteration
                log.exception("engine iteration failed")
                self._fail_running(f"engine error: {exc}")
        with self._cv:
            for r in list(self.scheduler.running) + list(self.scheduler.waiting):
                self._finish(r, RequestStatus.FINISHED_CANCELLED, error="the runner is shutting down")
            if self.tiers is not None:
                self.tiers.persist()  # the disk tier keeps what the KV cache and RAM held
            # The model may outlive this engine (tests, a reload in-process): it gets its cells back.
            self.scheduler.cache.clear()
            if self.draft_model is not None:
                self.draft_model.clear()

    def _apply_cancels(self) -> None:
        for r in self._cancels:
            if not r.status.finished:
                self._finish(r, RequestStatus.FINISHED_CANCELLED)
        self._cancels.clear()

    def _note_period(self, schedule, t0: float) -> None:
        """The period between the starts of two iterations in a row that were each a full batch of decodes alone (no
        prompt, no draft): the TPOT each of those sequences waited, as their clients measure it. A pair is needed:
        after the last full iteration of a burst the engine may idle, and that wait is nobody's TPOT."""
        full = (schedule.num_decode_tokens == self.scheduler.config.max_seqs and not schedule.num_prompt_tokens
                and not schedule.num_draft_tokens and self.counters.iterations_total >= PACE_WARMUP_ITERATIONS)
        if full and self._last_full_start is not None:
            self.scheduler.full_batch_periods.append((t0 - self._last_full_start) * 1000)
        self._last_full_start = t0 if full else None

    def _iterate(self) -> None:
        """One engine step in named phases: schedule, decode (making room in the KV cache), sample and verify, account."""
        if self.media is not None:
            self.media.before_iteration(self)
        t0 = self.clock()
        with self._cv:
            preempted_before = self.scheduler.num_preemptions_total
            schedule = self.scheduler.schedule(now=t0)
        self._progress(schedule, before=True)
        schedule, logit_idx, decode_s, retried = self._decode(schedule)
        num_preempted = self.scheduler.num_preemptions_total - preempted_before
        self.counters.preemptions_total = self.scheduler.num_preemptions_total
        if not schedule.chunks:
            return
        with self._cv:
            self.scheduler.commit(schedule)
        self._progress(schedule, before=False)
        num_sampled, num_accepted = self._sample_and_verify(schedule, logit_idx)
        iteration_s = self.clock() - t0
        if not retried and self.counters.iterations_total >= PACE_WARMUP_ITERATIONS:
            self._observe_cost(schedule, iteration_s)
        self._note_period(schedule, t0)
        self._count(schedule, num_sampled, iteration_s)
        self._record(schedule, t0, iteration_s, decode_s, num_preempted, num_accepted)

    def _decode(self, schedule) -> tuple:
        """Decode the schedule, making room in the KV cache until it fits: (schedule, logit rows, seconds, retried)."""
        decode_s = 0.0
        retried = False
        logit_idx: list[int] = []
        while schedule.chunks:
            td = time.perf_counter()
            rc, logit_idx = self.model.decode(schedule.chunks)
            decode_s += time.perf_counter() - td
            self.counters.decode_calls_total += 1
            if rc == DECODE_OK:
                break
            retried = True
            schedule = self._make_room(schedule)
        return schedule, logit_idx, decode_s, retried

    def _make_room(self, schedule):
        """After a decode found no KV room: evict a cached prefix, else preempt (or fail, when alone) and reschedule."""
        with self._cv:
            # Cached prefixes go first: a running sequence is preempted only when none is left.
            if self.scheduler.cache.evict(schedule.num_tokens):
                return self.scheduler.schedule(admit=False, now=self.clock(), draft=False)
            victim = self.scheduler.choose_victim()
            if len(self.scheduler.running) <= 1:
                # Alone and still no room: it cannot fit this context at all.
                self._finish(
                    victim,
                    RequestStatus.FINISHED_ERROR,
                    error=f"the KV cache ({self.model.n_ctx} cells) cannot hold this request "
                    f"({victim.num_tokens} tokens) even alone",
                )
            else:
                self.scheduler.preempt(victim, reason="kv")
            return self.scheduler.schedule(admit=False, now=self.clock(), draft=False)

    def _sample_and_verify(self, schedule, logit_idx: list[int]) -> tuple[int, int]:
        """Sample each sequence's next token, or verify its draft: (tokens sampled, draft tokens accepted)."""
        now = self.clock()
        num_sampled = 0
        num_accepted = 0
        # The iteration's events go out together once every sequence is sampled: a stream's thread woken at its
        # token would take the GIL at the engine's next llama.cpp call and hold the other sequences' sampling up
        # (a verified draft's burst likewise reaches its reader at once: one wake-up, one socket write).
        self._outbox = []
        try:
            for chunk, idx in zip(schedule.chunks, logit_idx):
                if idx < 0:
                    continue
                if chunk.num_draft:
                    kept = self._verify(chunk, idx, now)
                    num_sampled += kept + 1
                    num_accepted += kept
                else:
                    num_sampled += 1
                    self._sample_one(chunk.request, idx, now)
        finally:
            held, self._outbox = self._outbox, None
            for req, ev in held:
                req.events.put(ev)
        return num_sampled, num_accepted

    def _observe_cost(self, schedule, iteration_s: float) -> None:
        """Feed the cost model: what the SLO budget is sized by, this model's iterations on this machine, as measured."""
        # A draft token needs its own row of logits, as a decode token does: it costs as one.
        cost, iteration_ms = self.scheduler.cost, iteration_s * 1000
        num_decoded = schedule.num_decode_tokens + schedule.num_draft_tokens
        # The draft model's time is its own cost (draft_model.py), not the target's tokens'.
        iteration_ms -= schedule.draft_ms
        cost.observe(num_decoded, schedule.num_prompt_tokens, iteration_ms)
        if schedule.num_prompt_tokens:
            self.scheduler.chunks.observe(schedule.num_prompt_tokens, iteration_ms - cost.decode_ms * num_decoded)
        elif self.scheduler.config.spec.enabled:
            # The price of draft tokens: what computing this many tokens with logits took (speculation.VerifyCosts).
            self.scheduler.verify_costs.observe(num_decoded, iteration_ms)

    def _count(self, schedule, num_sampled: int, iteration_s: float) -> None:
        """Add this iteration to the running counters (/metrics)."""
        c = self.counters
        c.iterations_total += 1
        c.busy_slots_total += len(schedule.chunks)
        c.prompt_tokens_total += schedule.num_prompt_tokens
        c.tokens_predicted_total += num_sampled
        if schedule.num_tokens:
            # Draft tokens are generation work: their time counts with the predicted tokens'.
            share = schedule.num_prompt_tokens / schedule.num_tokens
            c.prompt_seconds_total += iteration_s * share
            c.tokens_predicted_seconds_total += iteration_s * (1 - share)

    def _record(self, schedule, t0: float, iteration_s: float, decode_s: float, num_preempted: int,
                num_accepted: int) -> None:
        """Append this iteration's stats to the ring the dashboards and benches read."""
        with self._cv:
            self.iterations.append(
                IterationStats(
                    start_s=t0,
                    num_seqs=len(schedule.chunks),
                    num_prompt_tokens=schedule.num_prompt_tokens,
                    num_decode_tokens=schedule.num_decode_tokens,
                    kv_used=self.scheduler.kv_used,
                    kv_total=self.scheduler.config.kv_cells,
                    num_running=len(self.scheduler.running),
                    num_waiting=len(self.scheduler.waiting),
                    iteration_ms=iteration_s * 1000,
                    decode_ms=decode_s * 1000,
                    num_preemptions=num_preempted,
                    kv_cached=self.scheduler.kv_cached,
                    num_draft_tokens=schedule.num_draft_tokens,
                    num_accepted_tokens=num_accepted,
                )
            )

    def _progress(self, schedule, before: bool) -> None:
        """Prompt progress for the requests that asked for it: 0 before their first prompt chunk, then after each."""
        for chunk in schedule.chunks:
            r = chunk.request
            total = len(r.prompt_tokens)
            if not r.return_progress or chunk.start_pos >= total:
                continue
            slot = -1 if r.slot is None else r.slot
            if before:
                if not r.progress_started:
                    r.progress_started = True
                    r.events.put(Progress(total, r.num_cached_tokens, r.num_cached_tokens, 0.0, slot))
                continue
            started = r.first_scheduled_s if r.first_scheduled_s is not None else r.arrival_s
            r.events.put(Progress(total, r.num_cached_tokens, min(r.num_computed, total),
                                  max(0.0, (self.clock() - started) * 1000), slot))

    def _verify(self, chunk: Chunk, first_index: int, now: float) -> int:
        """Sample a drafting sequence position by position, keeping draft tokens while each is what was sampled.

        The sample after the last kept draft token is emitted too (the correction, or a bonus token when
        the whole draft was kept); the cells of the rejected draft tokens leave the KV cache before it is.
        Counts are taken before each token is emitted, so a request that ends inside the draft reports them.
        Returns the draft tokens kept."""
        r = chunk.request
        draft = chunk.tokens[1:]
        k = len(draft)
        c = self.counters
        c.spec_drafts_total += 1
        c.spec_draft_tokens_total += k
        row = c.spec_by_class.setdefault(r.class_name, [0, 0, 0])
        row[0] += 1
        row[1] += k
        d = r.drafter
        if d is not None:
            d.num_drafts += 1
            d.num_drafted += k
        per_pos = c.spec_accepted_per_pos
        kept = self._verify_rows(r, draft, first_index, now, row, per_pos)
        if d is not None:
            d.learn(k, kept)
        return kept

    def _verify_rows(self, r: Request, draft: list[int], first_index: int, now: float, row: list,
                     per_pos: list) -> int:
        c, d, k = self.counters, r.drafter, len(draft)
        kept = 0
        for i in range(k + 1):
            if r.status is not RequestStatus.RUNNING:
                break
            token = self._choose(r, first_index + i)
            if i < k and token == draft[i] and not self.model.is_eog(token):
                kept += 1
                c.spec_accepted_tokens_total += 1
                row[2] += 1
                if len(per_pos) <= i:
                    per_pos.append(0)
                per_pos[i] += 1
                if d is not None:
                    d.num_accepted += 1
                self._emit(r, token, first_index + i, now)
                continue
            if i < k:
                with self._cv:
                    self.scheduler.rollback(r, k - i)
            self._emit(r, token, first_index + i, now)
            break
        return kept

    def _send(self, r: Request, ev) -> None:
        """Hand a request its next event; while sequences are sampled they wait for the iteration's end."""
        if self._outbox is None:
            r.events.put(ev)
        else:
            self._outbox.append((r, ev))

    def _choose(self, r: Request, batch_index: int) -> int:
        if r.budget is None:
            return self.model.sample(r.sampler, r.params, batch_index)
        return self._next_token(r, batch_index)

    def _sample_one(self, r: Request, batch_index: int, now: float) -> None:
        if r.status is not RequestStatus.RUNNING:
            return
        self._emit(r, self._choose(r, batch_index), batch_index, now)

    def _emit(self, r: Request, token: int, batch_index: int, now: float) -> None:
        """Take a sampled token: end on EOS, stream its text, stop on a stop string or a limit."""
        logprob = None if r.params.logprobs is None else self.model.logprob(batch_index, token, r.params.logprobs)
        if r.first_token_s is None:
            r.first_token_s = now
        utf8, stops = r.text_state
        if not r.params.ignore_eos and self.model.is_eog(token):
            self._emit_tail(r)
            with self._cv:
                self._finish(r, RequestStatus.FINISHED_STOP)
            return
        r.output_tokens.append(token)
        r.last_token_s = now
        piece = self.model.special_bytes(token) if token in r.params.special_ids else self.model.token_bytes(token)
        if r.budget is not None:
            r.budget.accept(token, piece)
        text, hit = stops.push(utf8.push(piece))
        # One Delta per token keeps streamed token counts honest even when text is held back
        # (a partial UTF-8 character or a possible stop-string prefix).
        started = r.first_scheduled_s if r.first_scheduled_s is not None else r.arrival_s
        first = r.first_token_s
        self._send(r, Delta(text, 1, logprob, (token,), -1 if r.slot is None else r.slot, r.num_cached_tokens,
                            max(0.0, (first - started) * 1000), (now - first) * 1000))
        if hit:
            with self._cv:
                self._finish(r, RequestStatus.FINISHED_STOP)
            return
        if len(r.output_tokens) >= r.params.max_tokens or r.num_tokens >= self.model.n_ctx:
            self._emit_tail(r)
            with self._cv:
                self._finish(r, RequestStatus.FINISHED_LENGTH)

    def _next_token(self, r: Request, batch_index: int) -> int:  # r.budget is set
        """The sampled token, or the reasoning budget's forced one when the sampler (its grammar) takes it."""
        budget = r.budget
        forced = budget.next_forced()
        if forced is not None:
            if self.model.force(r.sampler, r.params, forced):
                return forced
            # The request's grammar admits no end of thought here: the grammar wins, the thought goes on.
            budget.give_up()
        return self.model.sample(r.sampler, r.params, batch_index)

    def _emit_tail(self, r: Request) -> None:
        utf8, stops = r.text_state
        text, hit = stops.push(utf8.flush())
        if not hit:
            text += stops.flush()
        if text:
            self._send(r, Delta(text, 0))

    def _finish(self, r: Request, status: RequestStatus, error: str | None = None) -> None:
        """Release a request from the engine and send its last event; caller holds the lock.

        In STATIC mode a member that ends before the rest of its batch frees its KV at once but
        is answered only when the whole batch has ended, as request-level batching servers do
        (Orca, §2.2): that wait is what iteration-level scheduling removes.
        """
        slot = self.scheduler.finish(r, status, now=self.clock())
        self.model.free_sampler(r.sampler)
        r.sampler = None
        r.error = error
        batch_still_running = self.scheduler.config.mode is Mode.STATIC and self.scheduler.running
        if batch_still_running and slot is not None and error is None:
            self._held.append((r, slot))
            return
        self._deliver(r, slot)
        if not self.scheduler.running:
            now = self.clock()
            for held, held_slot in self._held:
                held.finished_s = now
                self._deliver(held, held_slot)
            self._held.clear()

    def _deliver(self, r: Request, slot: int | None) -> None:
        stats = r.make_stats()
        self.counters.requests_finished[stats.finish_reason] += 1
        stops = r.text_state[1] if r.text_state is not None else None
        word = (stops.matched_stop or "") if stops is not None and stops.stopped else ""
        self._send(r, Finished(stats.finish_reason, stats, r.error, -1 if slot is None else slot,
                               tuple(r.output_tokens), word,
                               r.budget.num_thought_tokens if r.budget is not None else 0))
        for listener in self.finished_listeners:
            try:
                listener(stats)
            except Exception:
                log.exception("finished-request listener failed")

    def _fail_running(self, message: str) -> None:
        with self._cv:
            for r in list(self.scheduler.running):
                self._finish(r, RequestStatus.FINISHED_ERROR, error=message)
