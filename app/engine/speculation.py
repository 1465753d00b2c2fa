"""Speculative decoding from a sequence's own context: n-gram drafts, verified inside the engine's one batch.

A drafting sequence's chunk is its last sampled token followed by up to k draft tokens, all with logits;
the engine samples position by position and keeps drafted tokens while each equals the sample taken at
the position before it (for a draft that is a single proposal, sampling from the target and comparing is
exactly the standard acceptance rule, so sampled output keeps the target distribution and greedy output
is the model's own; but logits computed for a batch of several tokens differ in the last bits from those of
one token, so at a near-tie greedy may pick the other token, as stock llama-server's drafting does). The
cells of rejected draft tokens are removed at once.

Whether and how far a sequence drafts is decided per iteration by the scheduler, from the measured costs: the
i-th draft token is verified while its chance of being kept (p**i, p the source's per-token acceptance, see
Acceptance) beats its cost as a share of what the batch yields without drafts (cost_ratio); so drafting is long
for verbatim copying on a lone stream, short or none for loose matches, and stands aside as the batch fills.

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

import collections
import math
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

    @property
    def p(self) -> float:
        """The estimated per-token acceptance."""
        return (self.kept + self.prior * self.weight) / (self.trials + self.weight)

    def observe(self, drafted: int, kept: int) -> None:
        """Fold in one verified draft."""
        f = self.forget
        self.kept = f * self.kept + kept
        self.trials = f * self.trials + kept + (1 if kept < drafted else 0)

    def age(self, factor: float = 0.98) -> None:
        """Let the evidence fade a little (the source was passed over this iteration)."""
        self.kept *= factor
        self.trials *= factor


# Priors per draft source: a long verbatim match is usually copied on; a 2-token match often is not.
PRIORS = {"lookup:16": 0.9, "lookup:8": 0.8, "lookup:4": 0.6, "lookup:2": 0.4, "mod": 0.9, "simple": 0.8}


def new_stats() -> dict[str, Acceptance]:
    """One engine's acceptance record per draft source (shared by its sequences: the model's habits)."""
    return {key: Acceptance(prior) for key, prior in PRIORS.items()}


def draft_length(p: float, cost_ratio: float, limit: int) -> int:
    """Draft tokens worth verifying: the i-th pays while its chance of being kept, p**i, beats cost_ratio.

    cost_ratio is what a verified token costs in the batch's own output: (ms per token in an iteration) ×
    (tokens the batch yields without drafts) / (ms of such an iteration)."""
    if limit <= 0 or p <= cost_ratio:
        return 0
    if p >= 0.999 or cost_ratio <= 0:
        return limit
    return min(limit, int(math.log(cost_ratio) / math.log(p)))


MAX_COST_RATIO = 0.85  # below the longest lookup's prior (0.9): a verbatim match is always tried


# A draft token's cost as a share of a plain iteration's yield while the fit cannot say (a small model on a CPU:
# a logits row of a big vocabulary is a fair part of a decode step).
PRIOR_COST_RATIO = 0.3


def cost_ratio(num_decode: int, decode_only_ms: float, token_ms: float) -> float:
    """A verified draft token's cost as a share of what the batch yields per ms without drafts (see draft_length)."""
    if num_decode <= 0:
        return 0.0
    if decode_only_ms <= 0 or token_ms <= 0:
        # The fit right after a long prompt's chunks can put a decode iteration at 0 ms or less: drafts are not
        # free then (a first answer verified 9 tokens of a 2-token match that way, all rejected).
        return PRIOR_COST_RATIO
    # At most MAX_COST_RATIO: a fit that finds no fixed cost per iteration (a loaded machine's noisy samples)
    # would otherwise say no draft ever pays, and the acceptance of a reliable source would never be tried again.
    return min(MAX_COST_RATIO, token_ms * num_decode / decode_only_ms)


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
    _mod_done: int = 0

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

    def propose(self, tokens: list[int], limit: int, ratio: float = 0.0) -> tuple[list[int], bool]:
        """Draft tokens to follow `tokens` (the sequence so far, its last sampled token included), at most limit.

        ratio: a verified token's cost (cost_ratio); a draft is cut to the length worth verifying at its source's
        acceptance. Returns (the draft, whether a candidate was found but was not worth its cost)."""
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
        stats = self.stats.get(source)
        worth = draft_length(stats.p, ratio, len(draft)) if stats is not None else len(draft)
        if worth < max(c.n_min, 1) or (c.type == "ngram-mod" and worth < min(c.mod_n_min, limit)):
            if stats is not None:
                stats.age()
            return [], True
        self.last_source = source
        return draft[:worth], False

    def _propose_mod(self, tokens: list[int], limit: int) -> list[int]:
        c, mod = self.config, self.mod
        assert mod is not None
        if self._mod_done + 32 < len(tokens) or self._mod_done == 0:
            mod.add_range(tokens, self._mod_done - mod.n, len(tokens))
            self._mod_done = len(tokens)
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
