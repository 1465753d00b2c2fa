"""Speculative decoding from a sequence's own context: n-gram drafts, verified inside the engine's one batch.

A drafting sequence's chunk is its last sampled token followed by up to k draft tokens, all with logits;
the engine samples position by position and keeps drafted tokens while each equals the sample taken at
the position before it (for a draft that is a single proposal, sampling from the target and comparing is
exactly the standard acceptance rule, so sampled output keeps the target distribution and greedy output
is the model's own; but logits computed for a batch of several tokens differ in the last bits from those of
one token, so at a near-tie greedy may pick the other token, as stock llama-server's drafting does). The
cells of rejected draft tokens are removed at once.

Whether and how far a sequence drafts is decided per iteration by one rule, from this box's measured costs and
each source's measured acceptance: see "The cost rule" below (decide). Drafting is long for verbatim copying on a
lone stream, short or none for loose matches, and stands aside as the batch fills; a source the rule cuts to
nothing is still tried at full length now and then, so its acceptance is measured rather than assumed.

Draft sources, named as llama-server's `--spec-type`:
  ngram-lookup   Hearth's own: the longest recent n-gram (of several sizes) that ends the sequence and
                 occurred before, whose continuation is proposed; the draft length follows acceptance.
  ngram-simple   the last size_n tokens looked up in the sequence, the size_m that followed proposed.
  ngram-map-k    as ngram-simple, proposed once the key has been seen min_hits times (k4v: the same here).
  ngram-mod      a hash of the last n_match tokens to the token that followed them, shared by every
                 sequence of the model and chained into a draft of n_min..n_max tokens.
  draft-simple   a smaller model of the same vocabulary drafts greedily (app/engine/draft_model.py): all drafting
                 sequences together, one draft decode per draft token; its own step time counts in the cost.
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Callable
from dataclasses import dataclass, field

NGRAM_TYPES = ("ngram-lookup", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod")
# Types that draft with a second model (RunnerConfig.draft_model, llama-server's -md).
DRAFT_MODEL_TYPES = ("draft-simple",)
SPEC_TYPES = ("none", *NGRAM_TYPES, *DRAFT_MODEL_TYPES)
# llama-server's types that Hearth does not draft with, and why (the runner refuses them by name).
UNSUPPORTED_TYPES = {
    "ngram-cache": "needs lookup cache files; use ngram-mod or ngram-lookup",
    "draft-eagle3": "EAGLE-3 heads are not supported; use ngram-lookup",
    "draft-mtp": "MTP heads are not supported; use ngram-lookup",
    "draft-dflash": "not supported; use ngram-lookup",
    "draft-dspark": "not supported; use ngram-lookup",
}
# ngram-lookup: the n-gram sizes tried, longest first; a longer match predicts its continuation better.
LOOKUP_SIZES = (16, 8, 4, 2)
LOOKUP_DRAFT_MAX = 64
# ngram-mod's table: one per engine, reset when a quarter full (as llama.cpp does at 4 Mi entries).
MOD_TABLE_MAX = 1 << 20
# draft-simple: llama-server's --spec-draft-n-max default (common_params_speculative_draft.n_max).
DRAFT_MODEL_N_MAX = 3


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings of one engine (llama-server's --spec-* flags)."""

    type: str = "none"
    # --spec-draft-n-max: draft tokens per sequence per iteration at most (None: the type's own size,
    # LOOKUP_DRAFT_MAX for ngram-lookup, size_m for ngram-simple / map-k, n_max for ngram-mod).
    n_max: int | None = None
    n_min: int = 0  # --spec-draft-n-min: a shorter proposal is not verified
    ngram_size_n: int = 12  # ngram-simple / map-k: lookup length
    ngram_size_m: int = 48  # ngram-simple / map-k: continuation length
    ngram_min_hits: int = 1  # ngram-map-k: times the key must have been seen
    mod_n_match: int = 24  # ngram-mod: tokens hashed
    mod_n_min: int = 48
    mod_n_max: int = 64
    # Drafting stands aside while more sequences than this decode at once (the batch is the lever then).
    max_seqs: int = 4
    # draft-simple: a draft stops at a token the draft model gives less than this probability (among its 10 most
    # likely, llama-server's --spec-draft-p-min); and whether its length follows the measured costs (off: every
    # iteration drafts up to n_max while the batch allows, as llama-server does; for oracles and tests).
    p_min: float = 0.0
    draft_by_cost: bool = True

    def __post_init__(self):
        if self.type in UNSUPPORTED_TYPES:
            raise ValueError(f"--spec-type {self.type}: {UNSUPPORTED_TYPES[self.type]}")
        if self.type not in SPEC_TYPES:
            raise ValueError(f"unknown --spec-type {self.type!r}; one of: {', '.join(SPEC_TYPES)}")
        for name in ("n_min", "ngram_size_n", "ngram_size_m", "ngram_min_hits", "mod_n_match",
                     "mod_n_min", "mod_n_max", "max_seqs"):
            if getattr(self, name) < 0:
                raise ValueError(f"speculative setting {name} must be ≥ 0, not {getattr(self, name)}")
        if self.n_max is not None and self.n_max < 0:
            raise ValueError(f"--spec-draft-n-max must be ≥ 0, not {self.n_max}")
        if self.ngram_size_n < 1 or self.mod_n_match < 1:
            raise ValueError("an n-gram must hold at least one token")
        if not 0.0 <= self.p_min <= 1.0:
            raise ValueError(f"--spec-draft-p-min must be within [0, 1], not {self.p_min}")

    @property
    def enabled(self) -> bool:
        """True when sequences may draft at all."""
        return self.type != "none" and self.draft_max > 0

    @property
    def draft_max(self) -> int:
        """The most draft tokens one sequence verifies in an iteration."""
        if self.type == "none":
            return 0
        if self.type == "ngram-mod":
            own = self.mod_n_max
        elif self.type in DRAFT_MODEL_TYPES:
            # A draft model has no length of its own: --spec-draft-n-max is the length (llama-server's default 3).
            return DRAFT_MODEL_N_MAX if self.n_max is None else self.n_max
        elif self.type in ("ngram-simple", "ngram-map-k", "ngram-map-k4v"):
            own = self.ngram_size_m
        else:
            own = LOOKUP_DRAFT_MAX
        return own if self.n_max is None else min(self.n_max, own)

    def as_dict(self) -> dict:
        """The settings, for /props and the dashboard."""
        out = {"type": self.type, "n_max": self.draft_max, "n_min": self.n_min, "max_seqs": self.max_seqs}
        if self.uses_draft_model:
            out.update(p_min=self.p_min, draft_by_cost=self.draft_by_cost)
        return out

    @property
    def uses_draft_model(self) -> bool:
        """True when the drafts come from a second model (draft-simple)."""
        return self.type in DRAFT_MODEL_TYPES


NO_SPEC = SpecConfig()


class ModTable:
    """ngram-mod's shared table: hash of n_match tokens → the token that followed them (last one seen)."""

    def __init__(self, n_match: int, limit: int = MOD_TABLE_MAX):
        self.n = n_match
        self.limit = limit
        self.entries: dict[tuple[int, ...], int] = {}

    def add_range(self, tokens: list[int], start: int, end: int) -> None:
        """Add the n-grams that end before position `end` and start at or after `start`."""
        n, entries = self.n, self.entries
        for i in range(max(start, 0), end - n):
            entries[tuple(tokens[i : i + n])] = tokens[i + n]
        if len(entries) > self.limit // 4:
            entries.clear()

    def chain(self, context: list[int], n_max: int) -> list[int]:
        """Up to n_max tokens predicted one after another from the context's last n_match tokens."""
        n = self.n
        if len(context) < n:
            return []
        window = collections.deque(context[-n:], maxlen=n)
        out: list[int] = []
        get = self.entries.get
        while len(out) < n_max:
            nxt = get(tuple(window))
            if nxt is None:
                break
            out.append(nxt)
            window.append(nxt)
        return out


class Acceptance:
    """How often drafts from one source are kept, as a chain: p = P(draft token i kept | token i-1 kept).

    Counted over verified drafts with forgetting (a draft of k with a kept is a kept successes in a + 1 trials,
    or k in k when all were kept), on top of a prior worth `weight` trials that never fades: as evidence ages
    (each iteration a source is passed over ages it too) the estimate returns to the prior, so a source that was
    poor for a while is tried again later."""

    def __init__(self, prior: float, weight: float = 4.0, forget: float = 0.9):
        self.prior = prior
        self.weight = weight
        self.forget = forget
        self.kept = 0.0
        self.trials = 0.0
        # The cost rule's record of this source (see decide): its exploration schedule and what it decided.
        self.explore_every = EXPLORE_FIRST  # cuts between two full-length tries
        self.num_cuts_since_try = 0
        self.tried = False  # whether any draft of this source was verified yet (else its first cut is a try)
        self.decisions = {DRAFT: 0, CUT: 0, EXPLORE: 0}  # how often each was decided
        self.last: Decision | None = None

    @property
    def p(self) -> float:
        """The estimated per-token acceptance."""
        return (self.kept + self.prior * self.weight) / (self.trials + self.weight)

    def observe(self, drafted: int, kept: int) -> None:
        """Fold in one verified draft."""
        f = self.forget
        self.tried = True
        self.kept = f * self.kept + kept
        self.trials = f * self.trials + kept + (1 if kept < drafted else 0)

    def age(self, factor: float = 0.98) -> None:
        """Let the evidence fade a little (the source was passed over this iteration)."""
        self.kept *= factor
        self.trials *= factor


    def as_dict(self) -> dict:
        """This source's acceptance and the cost rule's decisions about it, for /props and the Bench page."""
        return {"acceptance_estimate": round(self.p, 4), "prior": self.prior, "decisions": dict(self.decisions),
                "explore_every_cuts": self.explore_every if self.prior >= EXPLORE_MIN_PRIOR else None,
                "last": None if self.last is None else self.last.as_dict()}


# Priors per draft source: a long verbatim match is usually copied on; a 2-token match often is not.
PRIORS = {"lookup:16": 0.9, "lookup:8": 0.8, "lookup:4": 0.6, "lookup:2": 0.4, "mod": 0.9, "simple": 0.8}


def new_stats() -> dict[str, Acceptance]:
    """One engine's acceptance record per draft source (shared by its sequences: the model's habits)."""
    return {key: Acceptance(prior) for key, prior in PRIORS.items()}


# -- The cost rule --------------------------------------------------------------------------------------------
#
# How a draft's length is decided: this is the one place (decide), every n-gram source goes through it.
#
# 1. A source proposes a draft of L tokens: its own length (LOOKUP_DRAFT_MAX, size_m, or ngram-mod's chain of up
#    to n_max), within what the iteration leaves. ngram-mod proposes nothing shorter than n_min (llama.cpp).
# 2. Its acceptance p (Acceptance: token i kept given token i-1 was) says a draft of k keeps on average
#    E(k) = p + p² + … + p^k tokens.
# 3. The price (VerifyPrice) is this box's own: T(m), the measured ms of an iteration that computes m tokens with
#    logits (VerifyCosts: decode-only iterations binned by m, the cost fit's slope between and beyond the measured
#    sizes), and the plain rate r = n / T(n) tokens per ms of the n decoding sequences. A draft of k is worth
#        gain(k) = E(k) − r · (T(m0 + k) − T(m0) + k · D)   tokens
#    (m0: tokens with logits already in the batch; D: the ms of making one draft token, a draft model's measured
#    step shared by the sequences it drafts for, 0 for n-grams): what it keeps, less what the same time decodes
#    without it.
# 4. The lengths weighed are n_min..L (ngram-mod: mod_n_min..L, all or nothing, as llama.cpp drafts it): both ends
#    and the powers of two between. The best is drafted when its gain is positive: DRAFT.
# 5. Otherwise the draft is cut to nothing (CUT), and the source's evidence ages toward its prior — except that a
#    source that copies verbatim (prior ≥ EXPLORE_MIN_PRIOR: long n-gram matches, ngram-mod, ngram-simple/map-k)
#    goes out at full length L at its very first cut, when nothing about it is measured yet (llama-server drafts
#    from the first match; a prior is not a measurement), and then once `explore_every` cuts have passed since its
#    last try (EXPLORE): so a prior or an old failure that says "not worth it" is measured again instead of
#    assumed. explore_every starts at EXPLORE_FIRST, doubles after each exploration (up to EXPLORE_MAX), and
#    returns to EXPLORE_FIRST as soon as the source drafts on its merits, so a source that keeps failing is
#    retried ever more rarely.
# Short matches (prior below EXPLORE_MIN_PRIOR) are not explored: their full length is long and usually wrong, and
# their acceptance is measured anyway by the short drafts the rule gives them whenever those pay. A draft model
# (prior app.engine.draft_model.DRAFT_PRIOR) goes through the same rule, its source "draft", and is not explored
# either: its drafts are guesses, not copies.

DRAFT, CUT, EXPLORE = "draft", "cut", "explore"
EXPLORE_FIRST = 4
EXPLORE_MAX = 256
EXPLORE_MIN_PRIOR = 0.8


@dataclass(frozen=True, slots=True)
class Decision:
    """What the cost rule decided for one proposal, and the figures it decided by."""

    kind: str  # DRAFT, CUT or EXPLORE
    length: int  # draft tokens sent (0 for CUT)
    proposed: int  # L: what the source proposed
    best: int  # the length with the highest gain
    p: float
    kept_tokens: float  # E(best)
    cost_tokens: float  # r · (T(m0 + best) − T(m0))

    def as_dict(self) -> dict:
        """The decision with its reason in words."""
        gain = self.kept_tokens - self.cost_tokens
        why = (f"a draft of {self.best} keeps ~{self.kept_tokens:.1f} tokens at p {self.p:.2f} for the time of "
               f"{self.cost_tokens:.1f} plain ones (gain {gain:+.1f})")
        if self.kind == EXPLORE:
            why = f"tried at full length {self.length} to measure it; " + why
        return {"decision": self.kind, "length": self.length, "proposed": self.proposed, "best": self.best,
                "p": round(self.p, 4), "kept_tokens": round(self.kept_tokens, 2),
                "cost_tokens": round(self.cost_tokens, 2), "why": why}


def expected_kept(p: float, k: int) -> float:
    """E(k) = p + p² + … + p^k: the draft tokens a chain of acceptance p keeps on average."""
    if p >= 1.0:
        return float(k)
    return p * (1.0 - p**k) / (1.0 - p)


class VerifyCosts:
    """What an iteration computing m tokens with logits (decodes and draft tokens, no prompt) costs on this box.

    Each such iteration is binned by m (the largest of SIZES it reaches); a bin keeps forgetting means of m and of
    the iteration's ms. T(m) interpolates between the bins measured min_samples times, and goes on with the cost
    fit's per-token slope below and beyond them; with none measured it is the fit (the scheduler's CostModel)."""

    SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)

    def __init__(self, forget: float = 0.8, min_samples: int = 2):
        self.forget = forget
        self.min_samples = min_samples
        self._bins: dict[int, list[float]] = {}  # size → [mean m, mean ms, samples]
        self._points: list[tuple[float, float]] | None = []  # measured (m, ms), by m; None: to be rebuilt

    def observe(self, m: int, ms: float) -> None:
        """Fold in one decode-only iteration of m tokens with logits that took ms."""
        if m <= 0 or ms <= 0:
            return
        size = self.SIZES[max(bisect.bisect_right(self.SIZES, m) - 1, 0)]
        b = self._bins.get(size)
        if b is None:
            self._bins[size] = [float(m), ms, 1]
        else:
            f = self.forget
            b[0], b[1], b[2] = f * b[0] + (1 - f) * m, f * b[1] + (1 - f) * ms, b[2] + 1
        self._points = None

    def ms(self, m: int, fit) -> float:
        """T(m): the measured cost where there is one, the fit's (CostModel) slope beyond; fit alone before."""
        pts = self._points
        if pts is None:
            pts = self._points = sorted((b[0], b[1]) for b in self._bins.values() if b[2] >= self.min_samples)
        if not pts:
            return fit.iteration_ms(m, 0)
        slope = fit.decode_ms
        i = bisect.bisect_left(pts, (m, -1.0))
        if i == 0:
            return max(pts[0][1] - slope * (pts[0][0] - m), 1e-3)
        if i == len(pts):
            return pts[-1][1] + slope * (m - pts[-1][0])
        (m0, t0), (m1, t1) = pts[i - 1], pts[i]
        return t0 + (t1 - t0) * (m - m0) / (m1 - m0)

    def as_dict(self) -> dict:
        """The measured bins: ms of an iteration by tokens with logits, for /props."""
        return {str(size): {"tokens": round(b[0], 1), "ms": round(b[1], 2), "samples": int(b[2])}
                for size, b in sorted(self._bins.items())}


class VerifyPrice:
    """One iteration's price of draft tokens (see the cost rule): T(m) and the batch's plain rate r = n / T(n), plus
    what making a draft token costs besides its verification (a draft model's step, shared by the sequences it
    drafts for; nothing for an n-gram)."""

    __slots__ = ("ms", "base", "rate", "make_ms")

    def __init__(self, ms: Callable[[int], float], num_decode: int, make_ms: float = 0.0):
        self.ms = ms
        self.base = num_decode  # tokens with logits in the batch so far
        t = ms(num_decode)
        self.rate = num_decode / t if t > 0 else 0.0
        self.make_ms = make_ms

    def cost_tokens(self, k: int) -> float:
        """Plain tokens the time of k more draft tokens would have decoded: r · (T(m0 + k) − T(m0) + k · make)."""
        return self.rate * (max(0.0, self.ms(self.base + k) - self.ms(self.base)) + k * self.make_ms)


def _lengths(shortest: int, longest: int) -> list[int]:
    """The draft lengths weighed: both ends and the powers of two between."""
    out = [shortest]
    k = 1
    while k < longest:
        if k > shortest:
            out.append(k)
        k *= 2
    if longest > shortest:
        out.append(longest)
    return out


def decide(stats: Acceptance, proposed: int, shortest: int, price: VerifyPrice | None) -> int:
    """The cost rule (see above): the draft length to send of a proposal of `proposed` tokens, 0 for none."""
    if proposed < shortest:
        return 0
    if price is None:  # no price: verification is free
        stats.last = Decision(DRAFT, proposed, proposed, proposed, stats.p, expected_kept(stats.p, proposed), 0.0)
        stats.decisions[DRAFT] += 1
        return proposed
    p = stats.p
    best, best_kept, best_cost, best_gain = shortest, 0.0, 0.0, -math.inf
    for k in _lengths(shortest, proposed):
        kept, cost = expected_kept(p, k), price.cost_tokens(k)
        if kept - cost > best_gain:
            best, best_kept, best_cost, best_gain = k, kept, cost, kept - cost
    if best_gain > 0:
        kind, length = DRAFT, best
        stats.explore_every, stats.num_cuts_since_try = EXPLORE_FIRST, 0
    elif stats.prior >= EXPLORE_MIN_PRIOR and (not stats.tried or stats.num_cuts_since_try + 1 >= stats.explore_every):
        kind, length = EXPLORE, proposed
        stats.explore_every, stats.num_cuts_since_try = min(2 * stats.explore_every, EXPLORE_MAX), 0
    else:
        kind, length = CUT, 0
        stats.num_cuts_since_try += 1
        stats.age()
    stats.decisions[kind] += 1
    stats.last = Decision(kind, length, proposed, best, p, best_kept, best_cost)
    return length


@dataclass
class Drafter:
    """One sequence's draft source: its n-gram index, and which source its last draft came from."""

    config: SpecConfig
    mod: ModTable | None = None
    stats: dict[str, Acceptance] = field(default_factory=new_stats)
    # ngram-lookup / simple / map-k: per n-gram size, n-gram → (end position of its latest occurrence, hits).
    _index: dict[int, dict[tuple[int, ...], tuple[int, int]]] = field(default_factory=dict)
    _indexed: int = 0  # tokens [0, _indexed) have had their n-grams indexed
    num_drafts: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    last_source: str = ""
    _mod_next: int = -1  # ngram-mod: the first n-gram start not yet in the table (-1: nothing added yet)

    def __post_init__(self):
        c = self.config
        if c.type == "ngram-lookup":
            self._sizes = LOOKUP_SIZES
        elif c.type in ("ngram-simple", "ngram-map-k", "ngram-map-k4v"):
            self._sizes = (c.ngram_size_n,)
        else:
            self._sizes = ()
        for n in self._sizes:
            self._index[n] = {}

    # -- proposing ----------------------------------------------------------------------

    def propose(self, tokens: list[int], limit: int, price: VerifyPrice | None = None) -> tuple[list[int], bool]:
        """Draft tokens to follow `tokens` (the sequence so far, its last sampled token included), at most limit.

        price: what verified tokens cost this iteration (None: nothing); the cost rule (decide) sets the length.
        Returns (the draft, whether a candidate was found but cut to nothing)."""
        c = self.config
        limit = min(limit, c.draft_max)
        if limit <= 0:
            return [], False
        if c.type == "ngram-mod":
            source, draft = "mod", self._propose_mod(tokens, limit)
        else:
            source, draft = self._propose_lookup(tokens, limit)
        if not draft:
            return [], False
        # ngram-mod drafts n_min..n_max or nothing (llama.cpp); every source drafts at least --spec-draft-n-min.
        shortest = max(c.n_min, 1, min(c.mod_n_min, limit) if c.type == "ngram-mod" else 1)
        stats = self.stats.get(source)
        worth = decide(stats, len(draft), shortest, price) if stats is not None else len(draft)
        if worth <= 0:
            return [], True
        self.last_source = source
        return draft[:worth], False

    def _propose_mod(self, tokens: list[int], limit: int) -> list[int]:
        c, mod = self.config, self.mod
        assert mod is not None
        # The table learns the sequence as llama.cpp's does: every n-gram before the last sampled token (its
        # "prompt" there), first all of them, then in chunks once 32 tokens have passed the first n-gram start not
        # yet added. That start trails the end by n_match, so a chunk is added every 33 - n_match tokens (9 at
        # n_match 24): a loop a few dozen tokens long is drafted from its second turn.
        known = len(tokens) - 1
        if self._mod_next < 0 or self._mod_next + 32 < known:
            mod.add_range(tokens, max(self._mod_next, 0), known)
            self._mod_next = max(known - mod.n, 0)
        draft = mod.chain(tokens, min(limit, c.mod_n_max))
        # llama.cpp proposes nothing shorter than n_min (when the limit allows that many at all).
        if len(draft) < min(c.mod_n_min, limit):
            return []
        return draft

    def _index_upto(self, tokens: list[int], end: int) -> None:
        """Index the n-grams that end at positions [_indexed, end)."""
        for n, table in self._index.items():
            for i in range(max(self._indexed, n - 1), end):
                key = tuple(tokens[i - n + 1 : i + 1])
                old = table.get(key)
                table[key] = (i, 1 if old is None else old[1] + 1)
        self._indexed = max(self._indexed, end)

    def _propose_lookup(self, tokens: list[int], limit: int) -> tuple[str, list[int]]:
        c = self.config
        last = len(tokens) - 1
        # Everything before the last token is indexed: an occurrence found ends earlier than the suffix.
        self._index_upto(tokens, last)
        min_hits = c.ngram_min_hits if c.type in ("ngram-map-k", "ngram-map-k4v") else 1
        for n in self._sizes:
            if last + 1 < n:
                continue
            hit = self._index[n].get(tuple(tokens[last - n + 1 :]))
            if hit is None or hit[1] < min_hits:
                continue
            end = hit[0]
            draft = tokens[end + 1 : end + 1 + limit]
            if draft:
                return (f"lookup:{n}" if c.type == "ngram-lookup" else "simple"), draft
        return "", []

    # -- learning -----------------------------------------------------------------------

    def learn(self, drafted: int, accepted: int) -> None:
        """Fold one verified draft into its source's acceptance; the engine counts num_drafts / num_drafted /
        num_accepted itself, token by token."""
        stats = self.stats.get(self.last_source)
        if drafted > 0 and stats is not None:
            stats.observe(drafted, accepted)
