"""Draft-model speculative decoding (llama-server's -md with --spec-type draft-simple): a smaller model of the same
vocabulary proposes the draft tokens that the engine verifies in its one batch (app/engine/speculation.py).

The draft model has a llama_context of its own: the target's slots (n_seq_max) and n_ctx, one row of logits per
sequence per step, no KV tiers, no prefix-cache twins. Its KV cache is kept lazily: per slot, the tokens whose cells
it holds. Before a sequence drafts, the common prefix of that record and the sequence's tokens stays, the rest is
removed (seq_rm) and the missing tokens are decoded. That one rule follows slot reuse, the prefix cache,
preemption and rejected drafts without mirroring any of the target's KV operations: the draft's cells at positions
[0, n) depend on tokens [0, n) only.

Drafting is greedy and batched across every drafting sequence: the first decode brings each sequence up to date
(usually the one or two tokens the last verification added, with logits on its last token), then one decode per
draft token with one token per still-drafting sequence. A sequence stops at its limit, at an end-of-generation
token (the target never keeps one), or when the draft model's top probability is below p_min (taken among its 10
most likely tokens, as llama-server's top-k 10 draft sampler gives it). A sequence far behind (a fresh prompt)
catches up one n_batch piece per iteration and drafts once it is level, so no iteration stalls on a long draft
prefill.

The draft model's own time is measured per decode (a CostModel of its own); the scheduler adds a draft token's
share of a draft step to its verification cost, so drafting stands aside when the draft model is too slow to pay.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from app.engine.prefix_cache import common_prefix
from app.engine.scheduler import Chunk, CostModel
from app.engine.speculation import Acceptance

# The per-token acceptance a draft model is assumed to have before it has been measured.
DRAFT_PRIOR = 0.7
# Draft decodes measured before the draft's own cost fit replaces the estimate from its size.
MIN_COST_SAMPLES = 4
# llama.cpp's common_speculative_are_compatible: vocabularies may differ by this many tokens, and token texts are
# compared from this id on (the first ids are control tokens that converters number differently).
SPEC_VOCAB_MAX_SIZE_DIFFERENCE = 128
SPEC_VOCAB_CHECK_START_TOKEN_ID = 5


@dataclass(slots=True)
class _Slot:
    """What a batch reads of a chunk's request: its sequence id."""

    slot: int
    request_id: int = -1


def vocab_mismatch(target, draft) -> str | None:
    """Why `draft` cannot draft for `target` (llama.cpp's common_speculative_are_compatible), or None when it can.

    Both models give vocab_facts() (type, add_bos, bos, add_eos, eos, n_vocab) and vocab_texts(start, end)."""
    t, d = target.vocab_facts(), draft.vocab_facts()
    if t["type"] != d["type"]:
        return f"the vocabulary types differ (target {t['type']}, draft {d['type']})"
    if t["add_bos"] != d["add_bos"] or (t["add_bos"] and t["bos"] != d["bos"]):
        return (f"the BOS tokens differ (target adds {t['add_bos']}, id {t['bos']}; "
                f"draft adds {d['add_bos']}, id {d['bos']})")
    if t["add_eos"] != d["add_eos"] or (t["add_eos"] and t["eos"] != d["eos"]):
        return (f"the EOS tokens differ (target adds {t['add_eos']}, id {t['eos']}; "
                f"draft adds {d['add_eos']}, id {d['eos']})")
    nt, nd = t["n_vocab"], d["n_vocab"]
    if abs(nt - nd) > SPEC_VOCAB_MAX_SIZE_DIFFERENCE:
        return (f"the vocabulary sizes differ by more than {SPEC_VOCAB_MAX_SIZE_DIFFERENCE} "
                f"(target {nt} tokens, draft {nd})")
    end = min(nt, nd)
    step = 16384
    for start in range(SPEC_VOCAB_CHECK_START_TOKEN_ID, end, step):
        stop = min(start + step, end)
        a, b = target.vocab_texts(start, stop), draft.vocab_texts(start, stop)
        if a != b:
            i = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
            return f"token {start + i} differs (target {a[i]!r}, draft {b[i]!r})"
    return None


class DraftModel:
    """A draft model's context and what its KV cache holds per slot; proposes drafts for many sequences at once.

    `model` is a backend with its own context (LlamaModel, or a fake): n_ctx, n_batch, decode(chunks),
    seq_rm(seq, p0, p1), top_token(batch_index, with_p) -> (token, p), is_eog(token). size_ratio is the draft's
    weights over the target's: until its own steps are measured, a draft step is assumed to cost that share of a
    target iteration of as many tokens (decoding is bound by reading the weights)."""

    def __init__(self, model, p_min: float = 0.0, size_ratio: float = 1.0, info: dict | None = None,
                 clock=time.perf_counter):
        self.model = model
        self.p_min = p_min
        self.size_ratio = size_ratio
        self.info = dict(info or {})  # what /props shows of the draft model (path, name, size)
        self.clock = clock
        self.held: dict[int, list[int]] = {}  # slot → the tokens whose cells the draft's KV holds, by position
        self.acceptance = Acceptance(DRAFT_PRIOR)
        # ms = base + per draft-step token + per catch-up token, over the draft's own decodes.
        self.cost = CostModel(prior_ms=(1.0, 1.0, 0.25))
        self.last_ms = 0.0
        self.num_calls_total = 0
        self.num_decodes_total = 0
        self.num_drafted_total = 0  # draft tokens proposed (before n_min)
        self.num_synced_total = 0  # tokens decoded to bring sequences level
        self.seconds_total = 0.0
        self.num_failed_total = 0  # draft decodes refused (no KV slot): the records involved were dropped

    # -- costs ------------------------------------------------------------------------------

    @property
    def measured(self) -> bool:
        """Whether step costs come from the draft's own decodes (else from its size)."""
        return self.cost.num_samples >= MIN_COST_SAMPLES

    def step_ms(self, num_seqs: int, target_ms: float) -> float:
        """The time of one draft step with num_seqs sequences; target_ms: a target iteration of as many tokens."""
        if self.measured:
            return self.cost.iteration_ms(num_seqs, 0)
        return target_ms * self.size_ratio

    # -- drafting -----------------------------------------------------------------------------

    def propose(self, wants: list[tuple[int, list[int], int]]) -> list[list[int]]:
        """Greedy drafts for several sequences at once: wants holds (slot, tokens so far with the last sampled one,
        limit); returns a draft (at most limit tokens, maybe none) per entry, in order."""
        t0 = self.clock()
        drafts: list[list[int]] = [[] for _ in wants]
        try:
            live = [(i, slot, tokens, limit) for i, (slot, tokens, limit) in enumerate(wants)
                    if limit > 0 and tokens and min(tokens) >= 0]  # an image's positions are no tokens
            firsts = self._catch_up(live)
            drafting = []
            for i, slot, _tokens, limit in live:
                first = firsts.get(i)
                if first is not None and self._keeps(*first):
                    drafts[i].append(first[0])
                    if limit > 1:
                        drafting.append((i, slot, limit))
            while drafting:
                chunks = [Chunk(_Slot(slot), [drafts[i][-1]], len(self.held[slot]), True) for i, slot, _ in drafting]
                rows = self._decode(chunks, len(chunks), 0)
                if rows is None:
                    break
                still = []
                for (i, slot, limit), row in zip(drafting, rows):
                    self.held[slot].append(drafts[i][-1])
                    token, p = self.model.top_token(row, self.p_min > 0)
                    if self._keeps(token, p):
                        drafts[i].append(token)
                        if len(drafts[i]) < limit:
                            still.append((i, slot, limit))
                drafting = still
        finally:
            self.last_ms = (self.clock() - t0) * 1000
            self.seconds_total += self.last_ms / 1000
            self.num_calls_total += 1
        self.num_drafted_total += sum(len(d) for d in drafts)
        return drafts

    def _keeps(self, token: int, p: float) -> bool:
        return p >= self.p_min and not self.model.is_eog(token)

    def _catch_up(self, live: list[tuple[int, int, list[int], int]]) -> dict[int, tuple[int, float]]:
        """Bring each sequence's draft cells level with its tokens but the last, and decode the last with logits
        (one n_batch piece at most: a sequence further behind drafts in a later iteration). Returns the first draft
        token and its probability per entry index that got there."""
        plan = []
        for i, slot, tokens, _limit in live:
            held = self.held.setdefault(slot, [])
            # At least the last token is decoded: its logits give the first draft token.
            n = min(common_prefix(held, tokens), len(tokens) - 1)
            if n < len(held):
                self.model.seq_rm(slot, n, -1)
                del held[n:]
            plan.append((i, slot, tokens, n))
        budget = self.model.n_batch
        chunks, owners = [], []
        for i, slot, tokens, n in plan:
            if budget <= 0:
                break
            end = min(len(tokens), n + budget)
            chunks.append(Chunk(_Slot(slot), tokens[n:end], n, end == len(tokens)))
            owners.append(i)
            budget -= end - n
        if not chunks:
            return {}
        needed = sum(len(c.tokens) for c in chunks) + sum(limit for *_, limit in live)
        self._make_room(needed, {slot for _, slot, _, _ in live})
        num_tokens = sum(len(c.tokens) for c in chunks)
        rows = self._decode(chunks, len(chunks), num_tokens - len(chunks))
        if rows is None:
            return {}
        self.num_synced_total += num_tokens - len(chunks)
        firsts = {}
        for i, c, row in zip(owners, chunks, rows):
            self.held[c.request.slot].extend(c.tokens)
            if c.want_logits:
                firsts[i] = self.model.top_token(row, self.p_min > 0)
        return firsts

    def _make_room(self, needed: int, drafting: set[int]) -> None:
        """Drop the records of slots that are not drafting now (largest first) until `needed` cells are free."""
        free = self.model.n_ctx - sum(len(h) for h in self.held.values())
        for slot in sorted((s for s in self.held if s not in drafting and self.held[s]),
                           key=lambda s: -len(self.held[s])):
            if free >= needed:
                return
            free += len(self.held[slot])
            self.forget(slot)

    def _decode(self, chunks: list[Chunk], num_step: int, num_sync: int) -> list[int] | None:
        """One draft decode; the logit row of each chunk, or None when refused (the records involved are dropped:
        a refused batch may have written some of its cells)."""
        t0 = self.clock()
        rc, rows = self.model.decode(chunks)
        ms = (self.clock() - t0) * 1000
        self.num_decodes_total += 1
        if rc != 0:
            self.num_failed_total += 1
            for c in chunks:
                self.forget(c.request.slot)
            return None
        self.cost.observe(num_step, num_sync, ms)
        return rows

    def forget(self, slot: int) -> None:
        """Free every draft cell of a slot."""
        if self.held.get(slot):
            self.model.seq_rm(slot, 0, -1)
        self.held[slot] = []

    def clear(self) -> None:
        """Free every draft cell (the engine stops; the model may be reused)."""
        for slot in list(self.held):
            self.forget(slot)

    def stats(self) -> dict:
        """The draft model's counters and fitted step costs, for /props."""
        return {**self.info, "p_min": self.p_min, "acceptance_estimate": round(self.acceptance.p, 4),
                "calls": self.num_calls_total, "decodes": self.num_decodes_total,
                "drafted_tokens": self.num_drafted_total, "synced_tokens": self.num_synced_total,
                "failed_decodes": self.num_failed_total, "seconds": round(self.seconds_total, 3),
                "cost_measured": self.measured, "cost": self.cost.as_dict(), "size_ratio": round(self.size_ratio, 4)}
