"""Iteration-level scheduling: who is admitted, what goes into the next batch, who is preempted.

Pure Python: no llama.cpp here, so tests drive it with a fake model.
"""

from __future__ import annotations

import bisect
import collections
import math
import statistics
import time
from dataclasses import dataclass

from app.engine.prefix_cache import MIN_MATCH_TOKENS, NO_MATCH, KvMemory, Match, NoMemory, PrefixCache, Tag, common_prefix
from app.engine.request import ContextOverflow, QueueFull, Request, RequestStatus
from app.engine.speculation import (
    NO_SPEC,
    Drafter,
    ModTable,
    SpecConfig,
    VerifyCosts,
    VerifyPrice,
    decide,
    new_stats,
)
from app.policy import Mode

# The first iterations after a load run cold (weights paged in, buffers allocated: 2 s where a warm one took 20 ms
# here), so the engine leaves them out of the cost fit; the paces reported from the fit (full batch, reachable) wait
# for PACE_MIN_SAMPLES warm iterations, and the overview says "measuring" until then instead of "out of reach".
PACE_WARMUP_ITERATIONS = 8
PACE_MIN_SAMPLES = 32
# The full batch's pace is the median period of the last this many iterations in which every slot decoded and
# nothing else ran (what each of those sequences waited for its next token), once FULL_BATCH_MIN_PERIODS were seen;
# the fit's extrapolation before that. The fit forgets over ~100 iterations of every shape, so after a busier or
# quieter spell it told the Overview a pace the clients no longer saw (71 ms against their 56 at 8 streams).
FULL_BATCH_WINDOW = 64
FULL_BATCH_MIN_PERIODS = 16


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits the scheduler works within."""

    max_seqs: int  # sequence slots in the context (n_seq_max)
    kv_cells: int  # KV cache cells shared by all sequences (unified cache)
    max_batch_tokens: int  # n_batch: llama.cpp aborts on more tokens than this in one decode
    token_budget: int  # tokens per iteration (decode tokens first, then prompt chunks)
    mode: Mode = Mode.CONTINUOUS
    max_waiting: int = 256
    # Admission keeps this many cells free per running sequence, so newcomers don't
    # immediately push the others into preemption.
    decode_reserve_cells: int = 16
    # The SLO budget (Sarathi-Serve, with the time a sequence has banked): a class's TPOT target is a
    # mean, so a decoding sequence's next token is due by its first token + `slo_headroom` × target ×
    # the tokens it has; each iteration's prefill tokens are what fits, by the measured cost of an
    # iteration, before the earliest such deadline among decoding sequences. A sequence that runs ahead
    # of its pace (decode-only iterations are shorter than the target) banks time that a later prompt
    # chunk spends; one behind its pace (resumed after a preemption, or an iteration longer than the cost
    # model said) still lets an iteration take `slo_headroom` × the tightest target, so prompts always
    # move and one late sequence never holds the others up. A chunk is at least `min_prefill_tokens` unless it ends its prompt:
    # a smaller piece waits while the time is banked, since a few prompt tokens beside the decode tokens
    # cost more per token. No iteration is stretched by prefill beyond `slo_max_stall` tightest targets
    # (no long pause in a stream). A prefilling sequence's own tokens are not between two of its outputs:
    # its TTFT gains from big chunks, but the prompts queued behind it in the same iteration are held to
    # its TPOT target too. Where the target cannot be met even without prefill (a slow or busy machine),
    # prefill may still make an iteration `slow_machine_stretch` times as long as its decode tokens
    # alone: smaller chunks would no longer buy the target, only pay the iteration's fixed cost more
    # often. Off: the whole token_budget.
    slo_budget: bool = True
    slo_headroom: float = 0.9
    slo_max_stall: float = 5.0
    min_prefill_tokens: int = 32
    slow_machine_stretch: float = 2.0
    # Slot and KV preemption by priority: a more urgent waiting request takes the slot of a preemptible,
    # less urgent one, whose cells stay cached; a sequence resumed less than this long ago is spared.
    preempt_protect_s: float = 2.0
    # Automatic prefix caching (app/engine/prefix_cache.py); kv_guard: hold every cell under two
    # sequence ids, which sliding-window models need for their cached cells to survive.
    prefix_cache: bool = True
    kv_guard: bool = False
    # Speculative decoding (app/engine/speculation.py): decoding sequences may add draft tokens to their
    # chunk from what the prefill budget leaves, while the measured costs say a draft pays.
    spec: SpecConfig = NO_SPEC

    def __post_init__(self):
        if self.max_seqs < 1:
            raise ValueError("max_seqs must be at least 1")
        if self.token_budget < self.max_seqs:
            raise ValueError(
                f"token_budget ({self.token_budget}) must be at least max_seqs ({self.max_seqs}): "
                "every running sequence needs one decode token per iteration"
            )
        if self.token_budget > self.max_batch_tokens:
            raise ValueError(
                f"token_budget ({self.token_budget}) cannot exceed max_batch_tokens ({self.max_batch_tokens})"
            )


class _Solved:
    """One cost of CostModel's fit, read as if the fit were solved after every observation: observations folded in
    since the last solve are solved first, both before it is read and before it is set by hand."""

    def __set_name__(self, owner, name: str) -> None:
        self.slot = f"_{name}"

    def __get__(self, model, owner=None):
        if model is None:
            return self
        if model._unsolved:
            model._solve()
        return getattr(model, self.slot)

    def __set__(self, model, value: float) -> None:
        if model._unsolved:
            model._solve()
        setattr(model, self.slot, value)


class CostModel:
    """The measured cost of one iteration on this model and machine: ms = base + per decode token + per prefill token.

    Fitted online by least squares with exponential forgetting over the engine's own iterations, pulled
    toward a prior (a small model on a CPU) by a ridge term so the first iterations already give a budget.
    """

    PRIOR_MS = (5.0, 2.0, 0.5)  # base, per decode token, per prefill token

    def __init__(self, prior_ms: tuple[float, float, float] = PRIOR_MS, forget: float = 0.99,
                 prior_weight: float = 0.5):
        self.prior_ms = prior_ms
        self.forget = forget
        self.prior_weight = prior_weight
        self._xx = [[0.0] * 3 for _ in range(3)]
        self._xy = [0.0] * 3
        self.num_samples = 0
        self._base_ms, self._decode_ms, self._prefill_ms = prior_ms
        # Observations folded in since the last solve: the fit is solved when a cost is read (or every
        # SOLVE_EVERY observations), not after every iteration (a runner without SLO targets never reads it).
        self._unsolved = 0

    # Once the fit has its warm samples, an iteration counts as at most this many times its prediction: a runner
    # paused for seconds (another process on the cores, a page fault) would otherwise move the paces for the next
    # hundred iterations, while a machine that really slows down still pulls the fit up step by step.
    MAX_SURPRISE = 3.0
    # The surprise cap above reads the fit as last solved: at most this many observations old.
    SOLVE_EVERY = 16

    def observe(self, num_decode: int, num_prefill: int, iteration_ms: float) -> None:
        """Fold one measured iteration into the fit."""
        if self.num_samples >= PACE_MIN_SAMPLES:
            predicted = self._base_ms + self._decode_ms * num_decode + self._prefill_ms * num_prefill
            iteration_ms = min(iteration_ms, self.MAX_SURPRISE * predicted)
        x = (1.0, float(num_decode), float(num_prefill))
        f = self.forget
        for i in range(3):
            self._xy[i] = f * self._xy[i] + x[i] * iteration_ms
            row, xi = self._xx[i], x[i]
            for j in range(3):
                row[j] = f * row[j] + xi * x[j]
        self.num_samples += 1
        self._unsolved += 1
        if self._unsolved >= self.SOLVE_EVERY:
            self._solve()

    base_ms = _Solved()
    decode_ms = _Solved()
    prefill_ms = _Solved()

    def _solve(self) -> None:
        self._unsolved = 0
        # (XᵀX + wI) θ = Xᵀy + w θ₀. The matrix is symmetric positive definite (the ridge term), so a Cholesky
        # solve written out for 3 × 3 is stable without pivoting; it runs every iteration, and the general
        # elimination with pivoting cost the engine thread some 3 % of a free-decode iteration (issue 44).
        (a11, a12, a13), (_, a22, a23), (_, _, a33) = self._xx
        w, p, xy = self.prior_weight, self.prior_ms, self._xy
        b1, b2, b3 = xy[0] + w * p[0], xy[1] + w * p[1], xy[2] + w * p[2]
        d1 = a11 + w
        if d1 < 1e-12:
            return
        l11 = math.sqrt(d1)
        l21, l31 = a12 / l11, a13 / l11
        d2 = a22 + w - l21 * l21
        if d2 < 1e-12:
            return
        l22 = math.sqrt(d2)
        l32 = (a23 - l31 * l21) / l22
        d3 = a33 + w - l31 * l31 - l32 * l32
        if d3 < 1e-12:
            return
        l33 = math.sqrt(d3)
        y1 = b1 / l11
        y2 = (b2 - l21 * y1) / l22
        y3 = (b3 - l31 * y1 - l32 * y2) / l33
        t3 = y3 / l33
        t2 = (y2 - l32 * t3) / l22
        t1 = (y1 - l21 * t2 - l31 * t3) / l11
        # A cost is never negative; a per-token cost of 0 would make the budget unbounded.
        self._base_ms = max(t1, 0.0)
        self._decode_ms = max(t2, 1e-3)
        self._prefill_ms = max(t3, 1e-3)

    def iteration_ms(self, num_decode: int, num_prefill: int) -> float:
        """Predicted time of an iteration with these tokens (the linear fit; see ChunkCosts for chunk sizes)."""
        return self.base_ms + self.decode_ms * num_decode + self.prefill_ms * num_prefill

    def prefill_within(self, target_ms: float, num_decode: int) -> int:
        """Prefill tokens an iteration with num_decode decode tokens can add and still take at most target_ms."""
        spare = target_ms - self.iteration_ms(num_decode, 0)
        return int(spare / self.prefill_ms) if spare > 0 else 0

    def as_dict(self) -> dict:
        """The fitted costs, for /metrics."""
        return {"base_ms": round(self.base_ms, 3), "decode_ms_per_token": round(self.decode_ms, 4),
                "prefill_ms_per_token": round(self.prefill_ms, 4), "num_samples": self.num_samples}


class ChunkCosts:
    """What a prompt token costs by the size of the chunk it is computed in, as measured, and the knee.

    The linear fit (CostModel) says a prompt token costs the same in any chunk; on real hardware a thin chunk
    pays the iteration's fixed cost (reading every weight once) for few tokens, and small matrix products run
    below the machine's peak. Each iteration with prompt tokens is binned by its chunk size (the largest of
    SIZES it reaches); a bin keeps a forgetting mean of (iteration ms − the fit's decode tokens' share) per
    prompt token. The knee is the smallest measured size whose cost per token is within `tolerance` of the
    cheapest measured: chunks below it buy latency with throughput, chunks above it buy little. Until two
    bins have `min_samples` each, the knee is `default`.
    """

    SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048)

    def __init__(self, max_tokens: int, default: int = 32, tolerance: float = 0.15, min_samples: int = 4,
                 forget: float = 0.9):
        self.max_tokens = max_tokens
        self.default = min(default, max_tokens)
        self.tolerance = tolerance
        self.min_samples = min_samples
        self.forget = forget
        self._mean: dict[int, float] = {}
        self._count: dict[int, int] = {}
        self.knee = self.default

    def observe(self, num_prompt: int, prompt_ms: float) -> None:
        """Fold in one iteration's prompt tokens and the time they took (the iteration less its decode tokens)."""
        if num_prompt < self.SIZES[0] or prompt_ms <= 0:
            return
        size = self.SIZES[bisect.bisect_right(self.SIZES, num_prompt) - 1]
        per_token = prompt_ms / num_prompt
        old = self._mean.get(size)
        self._mean[size] = per_token if old is None else self.forget * old + (1 - self.forget) * per_token
        self._count[size] = self._count.get(size, 0) + 1
        self.knee = self._knee()

    @property
    def measured(self) -> bool:
        """Whether the knee comes from measured chunk costs (two sizes with min_samples each), not the default."""
        return sum(n >= self.min_samples for n in self._count.values()) >= 2

    def _knee(self) -> int:
        measured = {size: ms for size, ms in self._mean.items() if self._count[size] >= self.min_samples}
        if len(measured) < 2:  # not `measured` yet
            return self.default
        cheapest = min(measured.values())
        knee = min(size for size, ms in measured.items() if ms <= cheapest * (1 + self.tolerance))
        return min(knee, self.max_tokens)

    def as_dict(self) -> dict:
        """The measured bins (ms per prompt token, samples) and the knee, for /props."""
        return {"knee_tokens": self.knee, "measured_knee": self.measured,
                "ms_per_token_by_chunk": {str(size): {"ms_per_token": round(ms, 4), "samples": self._count[size]}
                                          for size, ms in sorted(self._mean.items())}}


@dataclass(slots=True)
class Chunk:
    """Tokens of one sequence in this iteration's batch (treat as read-only).

    Not frozen: one is made per sequence per iteration, and a frozen dataclass's __init__ costs
    ~1.6 us against ~0.3 us for a slotted one (hearth bench overhead).
    """

    request: Request
    tokens: list[int]
    start_pos: int
    want_logits: bool  # true when the chunk ends at the sequence's last token: a sample follows
    # Draft tokens after the sequence's last sampled token (tokens[1:]); each gets logits for verification.
    num_draft: int = 0


@dataclass(frozen=True)
class Schedule:
    """One iteration's batch: decode chunks first, then prompt chunks."""

    chunks: list[Chunk]
    num_decode_tokens: int
    num_prompt_tokens: int
    num_draft_tokens: int = 0
    # Why no sequence drafted this iteration ("" when one did or speculation is off), for the overview.
    spec_note: str = ""
    # Time the draft model took to propose this batch's drafts (inside schedule(), not the target's decode).
    draft_ms: float = 0.0

    @property
    def num_tokens(self) -> int:
        """Tokens in the batch."""
        return self.num_decode_tokens + self.num_prompt_tokens + self.num_draft_tokens


class Scheduler:
    """Keeps the waiting queue and the running set; builds one batch per iteration.

    Invariants: a request is in exactly one of waiting (sorted by sort_key) or running;
    a running request holds one slot, and the prefix cache's path of that slot holds exactly its
    num_computed tokens; kv_used counts the cells running sequences hold, shared cells once.
    KV operations (sharing, freeing) go to `memory`, the model's cache.
    """

    def __init__(self, config: SchedulerConfig, memory: KvMemory | None = None):
        self.config = config
        self.cache = PrefixCache(
            memory or NoMemory(), config.max_seqs, enabled=config.prefix_cache, guard=config.kv_guard
        )
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.free_slots: list[int] = list(range(config.max_seqs))
        self.num_preemptions_total = 0
        # (class name, "slot" | "kv") → preemptions: "slot" for a more urgent request's admission,
        # "kv" when the cache had no room for a batch.
        self.preemptions_by_class: collections.Counter[tuple[str, str]] = collections.Counter()
        self.cost = CostModel()
        self.full_batch_periods: collections.deque[float] = collections.deque(maxlen=FULL_BATCH_WINDOW)
        # Until measured, the knee is the smallest chunk the budget cuts anyway: the budget as it was.
        self.chunks = ChunkCosts(config.token_budget, default=config.min_prefill_tokens)
        # The pace the last budgeted iteration kept instead of a target out of its reach (None: in reach).
        self.reachable_tpot_ms: float | None = None
        # The last iteration's prefill limit and the TPOT target it came from (None: no target ran).
        self.prefill_budget = config.token_budget
        self.tightest_tpot_ms: float | None = None
        # The priority of the most urgent request whose prompt holds image or audio not yet all computed (set by
        # the engine's MediaStep before each iteration; None: none): less urgent prompts wait meanwhile.
        self.media_prompt_priority: int | None = None
        # STATIC mode: once a batch is admitted, nothing more joins until it is empty.
        self._static_closed = False
        # ngram-mod's table, shared by every sequence of the model as in llama.cpp.
        spec = config.spec
        self.mod_table = ModTable(spec.mod_n_match) if spec.type == "ngram-mod" else None
        self.spec_stats = new_stats()
        # What verifying m tokens with logits costs here, as measured (the cost rule's price, speculation.py).
        self.verify_costs = VerifyCosts()
        self.spec_note = "off" if not spec.enabled else ""
        # KV tiers below the KV cache (app/engine/kv_tiers.py), set by the engine when they are on.
        self.tiers = None
        # The draft model (app/engine/draft_model.py) for --spec-type draft-simple, set by attach_draft.
        self.draft_model = None
        self.draft_ms = 0.0

    def attach_draft(self, draft_model) -> None:
        """Draft with a second model (a DraftModel); its acceptance is learnt as the "draft" source's."""
        self.draft_model = draft_model
        self.spec_stats["draft"] = draft_model.acceptance

    # -- queue -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request in admission order; refuse when it can never fit or the queue is full."""
        max_tokens = self.config.kv_cells
        if len(request.prompt_tokens) >= max_tokens:
            raise ContextOverflow(len(request.prompt_tokens), max_tokens)
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFull(self.config.max_waiting)
        request.status = RequestStatus.WAITING
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        keys = [r.sort_key() for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, request.sort_key()), request)

    @property
    def kv_used(self) -> int:
        """KV cells the running sequences hold (a cell shared by several counts once)."""
        return self.cache.cells_running

    @property
    def kv_cached(self) -> int:
        """KV cells held only by the prefix cache: evicted before anything is preempted."""
        return self.cache.cells_cached

    @property
    def has_work(self) -> bool:
        """True while anything is waiting or running."""
        return bool(self.waiting or self.running)

    # -- admission ------------------------------------------------------------------------

    def _may_admit(self) -> bool:
        if self.config.mode is Mode.STATIC:
            if not self.running:
                self._static_closed = False
            return not self._static_closed
        return True

    @property
    def max_running(self) -> int:
        """Sequences allowed to run at once: one in SERIAL mode, every slot otherwise."""
        return 1 if self.config.mode is Mode.SERIAL else self.config.max_seqs

    def _admit(self, now: float) -> None:
        if not self._may_admit():
            return
        i = 0
        while i < len(self.waiting):
            candidate = self.waiting[i]
            # The last token is always computed: its logits give the next sample. A preempted sequence
            # resumes from its own cached cells even when it asked not to use the cache (cache_prompt).
            lookup = candidate.cache_prompt or candidate.num_preemptions > 0
            # Alone with a RAM tier, a request takes the cache as llama-server's slot would (_cache_to_itself):
            # any common prefix, however short, as llama-server reuses it.
            alone = self.tiers is not None and not self.running
            match = (self.cache.match(candidate.all_tokens[:-1], 1 if alone else MIN_MATCH_TOKENS) if lookup
                     else NO_MATCH)
            if alone and match.num_tokens and \
                    self.tiers.offers(candidate.all_tokens[:-1]) >= match.num_tokens + MIN_MATCH_TOKENS:
                # A tier holds a longer prefix: it comes back whole, its first cells too, as llama-server loads a
                # better cached prompt into its slot, rather than after a short match's cells of another prompt.
                match = NO_MATCH
            if self._awaits_prefix(candidate, match):
                i += 1
                continue
            short = self._shortage(candidate, match)
            if short is not None:
                victim = self.slot_victim(candidate, now)
                if victim is None:
                    break
                self.preempt(victim, reason=short)
                continue  # the victim's cells are cached now: look again
            self.waiting.pop(i)
            candidate.slot = self.free_slots.pop(0)
            candidate.status = RequestStatus.RUNNING
            candidate.admitted_s = now
            candidate.num_computed = num_kv = self.cache.attach(candidate.slot, match)
            self.cache.tag(candidate.slot, Tag(candidate.owner, candidate.private))
            if alone:
                self._cache_to_itself(candidate.slot)
            num_disk = 0
            if self.tiers is not None and lookup:
                disk_before = self.tiers.counters.disk_restored_tokens_total
                candidate.num_computed = self.tiers.restore(candidate.slot, candidate.all_tokens[:-1],
                                                            candidate.num_computed)
                num_disk = self.tiers.counters.disk_restored_tokens_total - disk_before
            if candidate.first_scheduled_s is None:
                candidate.first_scheduled_s = now
                candidate.num_cached_tokens = candidate.num_computed
                self.cache.count_query(candidate.num_tokens, candidate.num_computed,
                                       candidate.num_computed - num_kv, num_disk)
            self.running.append(candidate)
        if self.config.mode is Mode.STATIC and self.running:
            self._static_closed = True

    def _cache_to_itself(self, slot: int) -> None:
        """A request that runs alone gets the KV cache to itself: the cached prefixes it does not reuse move to the
        RAM tier (they come back on a hit), so its new cells lie right after the prefix it reuses, where a fresh
        runner, or llama-server's slot, puts them.

        Where cells lie changes the answer: llama.cpp's attention rounds by cell index and by the extent of the
        cells in use (flash attention splits a decode's keys by index; without it the softmax and V sums group by
        index), so a greedy near-tie could tip on what earlier requests left cached (issue 53: a transcription's
        audio cells changed the next chat's answer). Without a RAM tier nothing is moved: evicting would lose
        the prefixes, so there answers may still depend on them. A prefix the request reuses most of keeps only what
        they share: its tail is overwritten, as in llama-server's slot, rather than copied out."""
        self.cache.evict_all(slot)

    def _shortage(self, candidate: Request, match: Match) -> str | None:
        """What keeps a candidate out now: "slot", "kv", or None when it can be admitted."""
        if not self.free_slots or len(self.running) >= self.max_running:
            return "slot"
        # Cells the running sequences will hold once their pending tokens (the prompts of
        # sequences admitted in this very loop included) are computed, not just kv_used.
        # Cells held only by the cache count as free: they are evicted when needed.
        free = self.config.kv_cells - self.kv_used - sum(r.num_pending for r in self.running)
        reserve = self.config.decode_reserve_cells * len(self.running)
        # Shared cells count once: what running sequences already hold costs the newcomer nothing.
        need = candidate.num_tokens - match.num_running
        # The first sequence of an empty engine always gets in: alone it fits by add_request's check.
        if self.running and need + reserve > free:
            return "kv"
        return None

    def slot_victim(self, candidate: Request, now: float) -> Request | None:
        """The running sequence a waiting candidate may preempt: preemptible, less urgent, not just resumed.

        Only in continuous mode (serial and static are the A/B baselines); among several, the least
        urgent, then the most recently arrived. None when nothing may be preempted for it.
        """
        if self.config.mode is not Mode.CONTINUOUS:
            return None
        protect = self.config.preempt_protect_s
        eligible = [
            r for r in self.running
            if r.slo.preemptible and r.priority > candidate.priority
            and not (r.num_preemptions and r.admitted_s is not None and now - r.admitted_s < protect)
        ]
        return max(eligible, key=lambda r: (r.priority, r.arrival_s, r.seq), default=None)

    def _awaits_prefix(self, candidate: Request, match: Match) -> bool:
        """True when a running request is still computing a longer prefix of this candidate's prompt.

        Requests that arrive together with one long shared prefix would each compute it; the others
        wait instead (an iteration or a few) and then take it from the cache. A static batch is
        admitted whole, so it never waits.
        """
        if not candidate.cache_prompt or not self.cache.enabled or self.config.mode is Mode.STATIC:
            return False
        wanted = candidate.all_tokens[:-1]
        for r in self.running:
            n = common_prefix(wanted, r.all_tokens)
            if n - match.num_tokens >= MIN_MATCH_TOKENS and r.num_computed < n:
                return True
        return False

    # -- batch ----------------------------------------------------------------------------

    def schedule(self, admit: bool = True, now: float | None = None, draft: bool = True) -> Schedule:
        """Admit in policy order, then build one batch: decode tokens first, then prompt chunks, then drafts."""
        now = time.monotonic() if now is None else now
        if admit:
            self._admit(now)
        budget = self.config.token_budget
        chunks: list[Chunk] = []
        num_decode = 0
        for r in self.running:
            if r.is_decoding:
                chunks.append(Chunk(r, [r.all_tokens[-1]], r.num_computed, True))
                num_decode += 1
        # No per-iteration cap at the knee: capping iterations at it while an interactive request was in cost the
        # household mix at 8 its throughput and voice its TTFT on this 2-core CPU (0.84× and 0.59× of llama-server
        # against 1.34× and 0.11× without, `hearth bench replay --scenario household --levels 8 --serve
        # --llama-server --repeats 3`): a knee measured on a loaded machine can come out small, and a small cap
        # slices every prompt thin. The knee floors prefill (see _prefill_limit); n_batch stays the cap.
        budget -= num_decode
        num_prompt = 0
        # The most urgent prompt is held only to the paces of sequences at least as urgent as itself: a voice
        # prompt does not wait on a chat answer's TPOT (voice first); the prompts behind it keep its own pace.
        prompting = [r.priority for r in self.running if not r.is_decoding and r.num_pending > 0]
        prefill_left = min(budget, self._prefill_limit(num_decode, now, min(prompting, default=None)))
        self.prefill_budget = max(prefill_left, 0)
        # Prompt chunks in admission order: the most urgent prefill first, then the oldest.
        urgent: tuple[int, int] | None = None  # (priority, prompt tokens the iteration may hold) of the first target
        for r in sorted(self.running, key=Request.sort_key):
            if prefill_left <= 0:
                break
            if r.is_decoding or r.num_pending <= 0:
                continue
            if self.media_prompt_priority is not None and r.priority > self.media_prompt_priority:
                # A more urgent prompt still holds image or audio (its encode takes the cores a prefill would): the
                # prefill waits (decoding sequences do not), so that request's first token comes sooner.
                continue
            # Tokens only up to the prompt's next image: the engine's MediaStep evaluates the image itself.
            pending = r.num_pending if r.media is None else r.media.text_run(r.num_computed, r.num_pending)
            if pending <= 0:
                continue
            n = min(pending, prefill_left)
            if urgent is not None and r.priority > urgent[0]:
                n = min(n, urgent[1] - num_prompt)
            if n < min(pending, self.config.min_prefill_tokens, budget - num_prompt):
                break  # a small piece of a long prompt costs more per token than it is worth: bank the time
            tokens = r.all_tokens[r.num_computed : r.num_computed + n]
            chunks.append(Chunk(r, tokens, r.num_computed, n == r.num_pending))
            prefill_left -= n
            num_prompt += n
            if urgent is None and self.config.slo_budget and r.slo.tpot_ms:
                # Less urgent prompts behind this one would lengthen the iteration it computes in (its
                # first token's): they get what its TPOT target leaves; its own tokens are never cut. In the
                # iteration that ends its prompt (its first token comes out of it) they get nothing at all.
                within = self.cost.prefill_within(r.slo.tpot_ms * self.config.slo_headroom, num_decode)
                urgent = (r.priority, num_prompt if n == r.num_pending else max(within, num_prompt))
        num_draft = 0
        self.draft_ms = 0.0
        if self.config.spec.enabled:
            left = min(prefill_left, budget - num_prompt)
            num_draft, self.spec_note = self._add_drafts(chunks[:num_decode], num_decode, left, draft)
        schedule = Schedule(chunks, num_decode, num_prompt, num_draft, self.spec_note, self.draft_ms)
        self.make_room(schedule.num_tokens)
        return schedule

    def _add_drafts(self, decode_chunks: list[Chunk], num_decode: int, room: int, allowed: bool) -> tuple[int, str]:
        """Extend decode chunks with draft tokens within `room`; returns (draft tokens added, why none were)."""
        spec = self.config.spec
        if not allowed:
            return 0, "standing aside: the KV cache is full"
        if num_decode == 0:
            return 0, ""
        if self.tightest_tpot_ms is not None and self.config.slo_budget:
            # The TPOT budget was counted in prefill tokens; a draft token costs a decode token's time.
            room = int(room * self.cost.prefill_ms / self.cost.decode_ms)
        if num_decode > spec.max_seqs:
            return 0, f"standing aside: {num_decode} sequences decode (drafts above {spec.max_seqs} cost the batch)"
        if any(not r.is_decoding and r.num_pending > 0 for r in self.running):
            return 0, "standing aside: prompts are being prefilled"
        # The model's logit rows beyond one per sequence are sized for one draft of draft_max (ModelConfig.n_outputs_extra).
        room = min(room, spec.draft_max)
        if room <= 0:
            return 0, "standing aside: the TPOT budget leaves no room"
        if self.draft_model is not None:
            return self._add_model_drafts(decode_chunks, num_decode, room)
        # A verified draft token needs its own row of logits, as a decode token: priced by measured decode batches.
        price = VerifyPrice(self.verify_ms, num_decode)
        share = max(1, room // num_decode)
        added = 0
        gated = 0
        for c in decode_chunks:
            r = c.request
            per_request = r.params.speculative_n_max
            if per_request == 0:
                continue
            if r.drafter is None:
                r.drafter = Drafter(spec, mod=self.mod_table, stats=self.spec_stats)
            limit = min(share, room - added, r.params.max_tokens - len(r.output_tokens) - 1,
                        self.config.kv_cells - 1 - c.start_pos)
            if per_request is not None:
                limit = min(limit, per_request)
            if limit <= 0:
                continue
            proposal, passed_over = r.drafter.propose(r.all_tokens, limit, price)
            gated += passed_over
            if not proposal:
                continue
            price.base += len(proposal)
            c.tokens = c.tokens + proposal
            c.num_draft = len(proposal)
            added += len(proposal)
        if added:
            return added, ""
        if gated:
            return 0, "standing aside: drafts were not worth their cost at this load"
        return 0, "no draft: nothing in the context to copy"

    def verify_ms(self, num_tokens: int) -> float:
        """Measured ms of an iteration computing num_tokens tokens with logits (VerifyCosts, the fit beyond)."""
        return self.verify_costs.ms(num_tokens, self.cost)

    def _add_model_drafts(self, decode_chunks: list[Chunk], num_decode: int, room: int) -> tuple[int, str]:
        """Extend decode chunks with the draft model's tokens, every candidate sequence in one call (draft_model.py).

        A draft token costs its verification plus its share of a draft step (one step drafts a token for every
        drafting sequence); its length is what that cost and the "draft" source's acceptance make worth verifying,
        unless draft_by_cost is off (then the limits alone, as llama-server). Drafts shorter than n_min are dropped."""
        spec, dm = self.config.spec, self.draft_model
        share = max(1, room // num_decode)
        candidates: list[tuple[Chunk, int]] = []
        assigned = 0
        for c in decode_chunks:
            r = c.request
            limit = min(share, room - assigned, r.params.max_tokens - len(r.output_tokens) - 1,
                        self.config.kv_cells - 1 - c.start_pos)
            if r.params.speculative_n_max is not None:
                limit = min(limit, r.params.speculative_n_max)
            if limit > 0:
                candidates.append((c, limit))
                assigned += limit
        if not candidates:
            return 0, "no draft: no sequence may draft now"
        stats = self.spec_stats["draft"]
        if spec.draft_by_cost:
            # The cost rule (speculation.decide), as for every source: verification at this box's measured batch
            # costs, plus the draft model's own step (measured once it has run), shared by the n sequences drafting.
            n = len(candidates)
            price = VerifyPrice(self.verify_ms, num_decode, dm.step_ms(n, self.cost.iteration_ms(n, 0)) / n)
            worth = decide(stats, max(limit for _, limit in candidates), max(spec.n_min, 1), price)
            if worth <= 0:
                return 0, "standing aside: the draft model's tokens are not worth their cost at this load"
            candidates = [(c, min(limit, worth)) for c, limit in candidates]
        drafts = dm.propose([(c.request.slot, c.request.all_tokens, limit) for c, limit in candidates])
        self.draft_ms = dm.last_ms
        added = 0
        for (c, _), proposal in zip(candidates, drafts):
            if len(proposal) < max(spec.n_min, 1):
                continue
            r = c.request
            if r.drafter is None:
                r.drafter = Drafter(spec, stats=self.spec_stats)
            r.drafter.last_source = "draft"
            c.tokens = c.tokens + proposal
            c.num_draft = len(proposal)
            added += len(proposal)
        if added:
            return added, ""
        return 0, "no draft: the draft model was not confident enough (p_min) or is catching up"

    def _prefill_limit(self, num_decode: int, now: float, priority: int | None = None) -> int:
        """Prefill tokens this iteration may carry: what the TPOT targets of the decoding sequences at least as
        urgent as `priority` (the most urgent waiting prompt's; None: all) leave (see SchedulerConfig)."""
        decoding = [r for r in self.running if r.slo.tpot_ms and r.is_decoding
                    and (priority is None or r.priority <= priority)]
        self.tightest_tpot_ms = min(r.slo.tpot_ms for r in decoding) if decoding else None
        if not self.config.slo_budget or self.tightest_tpot_ms is None:
            self.reachable_tpot_ms = None
            return self.config.token_budget
        h = self.config.slo_headroom
        per_iteration_ms = self.tightest_tpot_ms * h
        decode_only_ms = self.cost.iteration_ms(num_decode, 0)
        # The pace this batch can keep and still prefill at the knee: a target tighter than that would starve
        # the prompts in thin, dear slices for a pace the hardware cannot give, so the budget keeps this one.
        knee_ms = self.cost.iteration_ms(num_decode, self.chunks.knee)
        self.reachable_tpot_ms = knee_ms / h if knee_ms > per_iteration_ms and self.chunks.measured else None
        if decode_only_ms > per_iteration_ms:
            limit_ms = self.config.slow_machine_stretch * decode_only_ms
        else:
            banked_ms = min(self._slack_ms(r, now) for r in decoding)
            limit_ms = min(max(banked_ms, per_iteration_ms), self.config.slo_max_stall * self.tightest_tpot_ms)
        within = self.cost.prefill_within(limit_ms, num_decode)
        # Until the chunk costs are measured the knee is a guess: the budget as it was (pieces below
        # min_prefill_tokens bank their time).
        return max(within, self.chunks.knee) if self.chunks.measured else within

    def full_batch_decode_ms(self) -> float:
        """The TPOT every sequence gets while every slot decodes: measured (the median period of recent full
        decode-only iterations) once enough were seen, else the cost fit's prediction."""
        if len(self.full_batch_periods) >= FULL_BATCH_MIN_PERIODS:
            return statistics.median(self.full_batch_periods)
        return self.cost.iteration_ms(self.config.max_seqs, 0)

    def full_batch_tpot_ms(self) -> float:
        """The TPOT a full batch (every slot decoding) keeps on this hardware while prompts prefill at the knee.

        A class target below it cannot be kept at the household's busiest without starving prefill: the
        overview marks it out of reach, and the budget keeps this pace instead (see _prefill_limit)."""
        return self.cost.iteration_ms(self.config.max_seqs, self.chunks.knee) / self.config.slo_headroom

    @property
    def pace_measured(self) -> bool:
        """Whether the cost fit has seen enough warm iterations for its paces to be reported (else: measuring)."""
        return self.cost.num_samples >= PACE_MIN_SAMPLES

    def feasibility(self) -> dict:
        """The knee, the chunk costs behind it and the paces it gives, for /props and /metrics.

        `pace_measured` false: the paces are the prior's and the first iterations', not to be shown as verdicts."""
        reachable = self.reachable_tpot_ms if self.pace_measured else None
        return {**self.chunks.as_dict(), "full_batch_tpot_ms": round(self.full_batch_tpot_ms(), 2),
                "full_batch_decode_ms": round(self.full_batch_decode_ms(), 2),
                "full_batch_periods": len(self.full_batch_periods),
                "headroom": self.config.slo_headroom,
                "slots": self.config.max_seqs,
                "pace_measured": self.pace_measured, "warm_iterations": self.cost.num_samples,
                "reachable_tpot_ms": None if reachable is None else round(reachable, 2)}

    def _slack_ms(self, r: Request, now: float) -> float:
        """How long the next iteration may take and this sequence still keep its mean TPOT pace (headroom included)."""
        if r.first_token_s is None:
            return r.slo.tpot_ms * self.config.slo_headroom
        due_s = r.first_token_s + r.slo.tpot_ms * self.config.slo_headroom * len(r.output_tokens) / 1000
        return (due_s - now) * 1000

    def make_room(self, num_cells: int) -> int:
        """Evict cached prefixes until num_cells cells are free (as far as the cache can); returns cells freed."""
        short = num_cells - (self.config.kv_cells - self.cache.cells_total)
        return self.cache.evict(short) if short > 0 else 0

    def rollback(self, request: Request, num_tokens: int) -> None:
        """Take a sequence's last num_tokens computed tokens back out (rejected drafts): KV cells and cache path."""
        if num_tokens <= 0:
            return
        assert request.slot is not None
        self.cache.truncate(request.slot, num_tokens)
        request.num_computed -= num_tokens

    def commit(self, schedule: Schedule) -> None:
        """Record that the batch went through the model: its tokens are now in the KV cache."""
        for c in schedule.chunks:
            self.cache.extend(c.request.slot, c.tokens)
            c.request.num_computed += len(c.tokens)

    # -- preemption and release ---------------------------------------------------------

    def choose_victim(self) -> Request | None:
        """The sequence to preempt when the KV cache is full: a preemptible class's first, then the
        lowest-priority, most recently arrived (a full cache must give way somewhere)."""
        if not self.running:
            return None
        return max(self.running, key=lambda r: (r.slo.preemptible, r.priority, r.arrival_s, r.seq))

    def preempt(self, victim: Request, reason: str = "kv") -> int:
        """Take a running sequence out and requeue it; returns the slot it held.

        Its cells stay in the prefix cache, so resuming recomputes only what was evicted meanwhile
        (everything, when the cache is off).
        """
        slot = self._release(victim, keep=True)
        victim.num_computed = 0
        victim.num_preemptions += 1
        victim.status = RequestStatus.WAITING
        self.num_preemptions_total += 1
        self.preemptions_by_class[(victim.class_name, reason)] += 1
        self._enqueue(victim)
        return slot

    def finish(self, request: Request, status: RequestStatus, now: float | None = None) -> int | None:
        """Take a request out of the engine (finished, cancelled or failed); returns its freed slot."""
        slot = None
        if request in self.running:
            # A failed iteration may have left its cells half-written: only clean ends are cached.
            keep = request.cache_prompt and status is not RequestStatus.FINISHED_ERROR
            slot = self._release(request, keep=keep)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        request.finished_s = time.monotonic() if now is None else now
        return slot

    def _release(self, request: Request, keep: bool) -> int:
        self.running.remove(request)
        slot = request.slot
        assert slot is not None
        self.cache.release(slot, keep=keep)
        request.slot = None
        bisect.insort(self.free_slots, slot)
        return slot

    def find(self, request_id: int) -> Request | None:
        """The waiting or running request with this id."""
        for r in self.running + self.waiting:
            if r.request_id == request_id:
                return r
        return None
