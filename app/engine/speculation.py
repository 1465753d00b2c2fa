"""Speculative decoding from a sequence's own context: n-gram drafts, verified inside the engine's one batch.

A drafting sequence's chunk is its last sampled token followed by up to k draft tokens, all with logits;
the engine samples position by position and keeps drafted tokens while each equals the sample taken at
the position before it (for a draft that is a single proposal, sampling from the target and comparing is
exactly the standard acceptance rule, so sampled output keeps the target distribution and greedy output
is identical to decoding without drafts). The cells of rejected draft tokens are removed at once.

Whether a sequence drafts is decided per iteration by the scheduler (see `worth_drafting`), from the
measured iteration costs: drafting pays while the tokens it is expected to add per millisecond of
verification beat what the batch already produces per millisecond, so it stands aside as the batch fills.

Draft sources, named as llama-server's `--spec-type`:
  ngram-lookup   Hearth's own: the longest recent n-gram (of several sizes) that ends the sequence and
                 occurred before, whose continuation is proposed; the draft length follows acceptance.
  ngram-simple   the last size_n tokens looked up in the sequence, the size_m that followed proposed.
  ngram-map-k    as ngram-simple, proposed once the key has been seen min_hits times (k4v: the same here).
  ngram-mod      a hash of the last n_match tokens to the token that followed them, shared by every
                 sequence of the model and chained into a draft of n_min..n_max tokens.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

NGRAM_TYPES = ("ngram-lookup", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod")
SPEC_TYPES = ("none", *NGRAM_TYPES)
# llama-server's types that Hearth does not draft with, and why (the runner refuses them by name).
UNSUPPORTED_TYPES = {
    "ngram-cache": "needs lookup cache files; use ngram-mod or ngram-lookup",
    "draft-simple": "draft models are not supported yet; use ngram-lookup",
    "draft-eagle3": "EAGLE-3 heads are not supported; use ngram-lookup",
    "draft-mtp": "MTP heads are not supported; use ngram-lookup",
    "draft-dflash": "not supported; use ngram-lookup",
    "draft-dspark": "not supported; use ngram-lookup",
}
# ngram-lookup: the n-gram sizes tried, longest first; a longer match predicts its continuation better.
LOOKUP_SIZES = (16, 8, 4, 2)
LOOKUP_DRAFT_MAX = 16
# ngram-mod's table: one per engine, reset when a quarter full (as llama.cpp does at 4 Mi entries).
MOD_TABLE_MAX = 1 << 20


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
        elif self.type in ("ngram-simple", "ngram-map-k", "ngram-map-k4v"):
            own = self.ngram_size_m
        else:
            own = LOOKUP_DRAFT_MAX
        return own if self.n_max is None else min(self.n_max, own)

    def as_dict(self) -> dict:
        """The settings, for /props and the dashboard."""
        return {"type": self.type, "n_max": self.draft_max, "n_min": self.n_min, "max_seqs": self.max_seqs}


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


@dataclass
class Drafter:
    """One sequence's draft source and its acceptance record."""

    config: SpecConfig
    mod: ModTable | None = None
    # ngram-lookup / simple / map-k: per n-gram size, n-gram → (end position of its latest occurrence, hits).
    _index: dict[int, dict[tuple[int, ...], tuple[int, int]]] = field(default_factory=dict)
    _indexed: int = 0  # tokens [0, _indexed) have had their n-grams indexed
    # ngram-lookup's draft length: doubled after a fully accepted draft, cut to what was accepted (+1) otherwise.
    length: int = 0
    # Acceptance per drafted token, smoothed (the scheduler's estimate of what a draft is worth).
    acceptance: float = 0.5
    num_drafts: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    _mod_done: int = 0

    def __post_init__(self):
        c = self.config
        self.length = max(4, c.draft_max // 2) if c.type == "ngram-lookup" else c.draft_max
        if c.type == "ngram-lookup":
            self._sizes = LOOKUP_SIZES
        elif c.type in ("ngram-simple", "ngram-map-k", "ngram-map-k4v"):
            self._sizes = (c.ngram_size_n,)
        else:
            self._sizes = ()
        for n in self._sizes:
            self._index[n] = {}

    # -- proposing ----------------------------------------------------------------------

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Draft tokens to follow `tokens` (the sequence so far, its last sampled token included), at most limit."""
        c = self.config
        limit = min(limit, c.draft_max)
        if limit <= 0:
            return []
        if c.type == "ngram-mod":
            draft = self._propose_mod(tokens, limit)
        else:
            draft = self._propose_lookup(tokens, limit)
        if len(draft) < max(c.n_min, 1):
            return []
        return draft

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

    def _propose_lookup(self, tokens: list[int], limit: int) -> list[int]:
        c = self.config
        last = len(tokens) - 1
        # Everything before the last token is indexed: an occurrence found ends earlier than the suffix.
        self._index_upto(tokens, last)
        want = limit if c.type != "ngram-lookup" else min(limit, self.length)
        min_hits = c.ngram_min_hits if c.type in ("ngram-map-k", "ngram-map-k4v") else 1
        for n in self._sizes:
            if last + 1 < n:
                continue
            hit = self._index[n].get(tuple(tokens[last - n + 1 :]))
            if hit is None or hit[1] < min_hits:
                continue
            end = hit[0]
            draft = tokens[end + 1 : end + 1 + want]
            if draft:
                return draft
        return []

    # -- learning -----------------------------------------------------------------------

    def learn(self, drafted: int, accepted: int) -> None:
        """Fold one verified draft into the acceptance estimate (and ngram-lookup's draft length); the engine
        counts num_drafts / num_drafted / num_accepted itself, token by token."""
        if drafted <= 0:
            return
        self.acceptance = 0.7 * self.acceptance + 0.3 * (accepted / drafted)
        if self.config.type == "ngram-lookup":
            if accepted >= drafted:
                self.length = min(self.config.draft_max, max(self.length, drafted) * 2)
            else:
                self.length = max(2, accepted + 1)


def worth_drafting(acceptance: float, num_decode: int, decode_only_ms: float, verify_ms_per_token: float) -> bool:
    """True while a draft token's expected yield per ms of verification beats the batch's own tokens per ms.

    A draft token costs about one prefill token's time (`verify_ms_per_token`) and yields `acceptance`
    tokens on average; without it the iteration yields num_decode tokens in decode_only_ms.
    """
    if num_decode <= 0 or decode_only_ms <= 0:
        return True
    return acceptance / verify_ms_per_token > num_decode / decode_only_ms
