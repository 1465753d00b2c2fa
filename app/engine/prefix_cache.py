"""Automatic prefix caching: a radix tree over token ids whose nodes are cells of the unified KV cache.

The choice (SGLang's RadixAttention rather than vLLM's hashed blocks): llama.cpp addresses KV cells by
(sequence id, position), and `llama_memory_seq_cp` on a unified cache gives a sequence the cells of
another without copying data. A tree of token runs maps onto that directly, at token granularity:

- A node is a run of tokens at positions [depth, depth + len) whose KV cells exist once in the cache.
  Its children continue it. Two children may hold the same tokens when two sequences computed them
  at the same time (their cells are distinct); matching takes the longer.
- An owner is a sequence id that holds every cell on a root-to-node path: a running request's slot,
  or a cache entry (the cells of a finished request, kept under an id of its own). The holders of a
  node include the holders of its children; a node nobody holds has no cells and leaves the tree.
- A new request takes its longest match, gets those cells with seq_cp (metadata only) and prefills
  the rest. Running sequences' cells are in the tree as they are computed, so a request can share a
  prefix that another request is still using.
- A finished request's path becomes a cache entry; an entry whose path is a prefix of the new one's
  is dropped (the new one holds all its cells). Entries are evicted least-recently-used, each one a
  leaf, when cells are needed, before any running sequence is preempted.

Sliding-window models: llama.cpp's find_slot reuses a cell held by exactly one sequence once it has
slid out of that sequence's window, then purges that sequence's older positions, so a cached prefix
loses cells a later request still needs (tests/e2e/test_prefix_cache_llama.py measures it on Gemma 3:
seq_pos_min of a cached prefix went from 0 to 500 after one fragmented prefill). With `guard`, every
owner holds its cells under two sequence ids, so no cell is ever held by one sequence alone and
nothing is overwritten; this needs the full-size SWA cache (llama.cpp's `swa_full`, the default of
llama_context_default_params), which is as large as the non-SWA one.

Pure Python: the KV operations go to a `KvMemory` (the llama.cpp model, or a fake in tests).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

# llama.cpp's LLAMA_MAX_SEQ: a unified cache accepts sequence ids below it in seq_cp/seq_rm.
MAX_SEQ_IDS = 256
# Shorter matches (a BOS token, a chat template's first line) save no time worth a seq_cp, and change
# where the prompt's chunks start, which can flip near-ties in greedy output (CPU kernels are not
# batch-invariant).
MIN_MATCH_TOKENS = 16


@dataclass(frozen=True)
class Tag:
    """Whose cells an owner holds: the member whose request computed them, and whether its class is private.

    It travels with the cells from a slot to the cache entry they become, so the KV tiers know whose words an
    evicted entry holds (removed with the member) and which may never be written to disk."""

    owner: str | None = None
    private: bool = False


UNTAGGED = Tag()


# Architectures whose memory is (partly) a recurrent state, which llama.cpp cannot share or cut by
# position (llama_model_is_recurrent / is_hybrid on the loaded model say so authoritatively; this list
# lets the Models page say it from the GGUF header, before a load).
RECURRENT_ARCHITECTURES = frozenset({
    "arwkv7", "falcon-h1", "granitehybrid", "jamba", "kimi-linear", "lfm2", "lfm2moe", "mamba", "mamba2",
    "nemotron_h", "nemotron_h_moe", "plamo2", "qwen3next", "rwkv6", "rwkv6qwen2", "rwkv7",
})


def reuse_note(architecture: str | None, n_swa: int | None) -> str:
    """What the prefix cache can do for a model of this architecture and sliding window, in one line."""
    if architecture in RECURRENT_ARCHITECTURES:
        return "no prefix reuse: the model keeps a recurrent state, which cannot be shared by position"
    if n_swa:
        return f"prefix reuse, sliding window of {n_swa} tokens kept in a full-size SWA cache"
    return "prefix reuse"


class KvMemory(Protocol):
    """The two KV-cache operations the prefix cache needs (positions [p0, p1), -1 = open end)."""

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None: ...
    def seq_rm(self, seq: int, p0: int, p1: int) -> None: ...


class NoMemory:
    """A KvMemory that does nothing: for scheduler tests that drive the cells themselves."""

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Nothing to copy."""

    def seq_rm(self, seq: int, p0: int, p1: int) -> None:
        """Nothing to remove."""


class Node:
    """A run of tokens with one set of KV cells, at positions [depth, depth + len(tokens))."""

    __slots__ = ("tokens", "depth", "parent", "children", "holders")

    def __init__(self, tokens: list[int], depth: int, parent: Node | None):
        self.tokens = tokens
        self.depth = depth
        self.parent = parent
        self.children: list[Node] = []
        self.holders: set[int] = set()

    @property
    def end(self) -> int:
        """Position after the node's last token."""
        return self.depth + len(self.tokens)


@dataclass(frozen=True)
class Match:
    """The longest cached prefix of some tokens: where it ends and how much of it running sequences hold."""

    num_tokens: int
    num_running: int  # leading tokens whose cells a running sequence holds already (not evictable)
    node: Node | None  # the node the match ends in (None: no match)
    offset: int  # tokens matched inside that node


NO_MATCH = Match(0, 0, None, 0)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class PrefixCacheCounters:
    """Monotonic totals since start, for /metrics."""

    # Prompt tokens of admitted requests, counted once at a request's first admission (those that asked not to
    # use the cache, cache_prompt false, with no hit): the client's prompt_tokens, all requests together.
    query_tokens_total: int = 0
    hit_tokens_total: int = 0  # of those, tokens not computed: the client's cached_tokens
    # Of the hits, tokens a KV tier restored (app/engine/kv_tiers.py), and of those, tokens read from the disk
    # tier; hit - restored came straight from the KV cache, so the parts add up to query_tokens_total.
    restored_tokens_total: int = 0
    disk_restored_tokens_total: int = 0
    evicted_tokens_total: int = 0  # cells freed by evicting cache entries
    evictions_total: int = 0


class PrefixCache:
    """The radix tree, the owners' paths and the cache entries, kept in step with the KV cache."""

    def __init__(
        self,
        memory: KvMemory,
        num_slots: int,
        enabled: bool = True,
        guard: bool = False,
        max_seq_ids: int = MAX_SEQ_IDS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.memory = memory
        self.num_slots = num_slots
        self.enabled = enabled
        self.guard = guard and enabled
        self.clock = clock
        self.root = Node([], 0, None)
        self.tails: dict[int, Node] = {}  # owner → the last node of its path
        self.entries: dict[int, float] = {}  # cache entry → last use (insertion order is not LRU)
        self.tags: dict[int, Tag] = {}  # slot or entry → whose cells it holds (absent: UNTAGGED)
        first_entry = num_slots * (2 if self.guard else 1)
        step = 2 if self.guard else 1
        self._free_entry_ids = list(range(first_entry, max_seq_ids - step + 1, step))
        self.cells_total = 0
        self.cells_running = 0  # cells of nodes with at least one slot among their holders
        self.counters = PrefixCacheCounters()
        # Called with (entry, its tokens) before an evicted entry's cells are dropped (app/engine/kv_tiers.py).
        self.on_evict: Callable[[int, list[int]], None] | None = None

    # -- reading ------------------------------------------------------------------------

    @property
    def cells_cached(self) -> int:
        """Cells held only by cache entries (evictable)."""
        return self.cells_total - self.cells_running

    @property
    def max_entries(self) -> int:
        """Cache entries that can exist at once (sequence ids are limited)."""
        return len(self._free_entry_ids) + len(self.entries)

    def is_slot(self, owner: int) -> bool:
        """True for a running request's slot, false for a cache entry."""
        return owner < self.num_slots

    def _twin(self, owner: int) -> int:
        return owner + self.num_slots if self.is_slot(owner) else owner + 1

    def _seqs(self, owner: int) -> tuple[int, ...]:
        return (owner, self._twin(owner)) if self.guard else (owner,)

    def seq_ids(self, owner: int) -> tuple[int, ...]:
        """The sequence ids an owner's cells are held under (two with the guard)."""
        return self._seqs(owner)

    def reserve_seq(self, seq: int) -> None:
        """Keep a sequence id for someone else (the tiers' transfer sequence): no entry will use it."""
        self._free_entry_ids = [e for e in self._free_entry_ids if seq not in self._seqs(e)]

    def path_tokens(self, owner: int) -> list[int]:
        """The tokens on an owner's path, from position 0."""
        return [t for n in self._path(self.tails[owner]) for t in n.tokens]

    def _running(self, node: Node) -> bool:
        return any(h < self.num_slots for h in node.holders)

    def length(self, owner: int) -> int:
        """Tokens on an owner's path."""
        tail = self.tails.get(owner)
        return tail.end if tail is not None else 0

    def match(self, tokens: list[int], min_tokens: int = MIN_MATCH_TOKENS) -> Match:
        """The longest prefix of tokens whose cells are in the cache, at least min_tokens long (NO_MATCH when the
        cache is off)."""
        if not self.enabled:
            return NO_MATCH
        if len(tokens) < min_tokens:
            return NO_MATCH
        node, pos, running = self.root, 0, 0
        while pos < len(tokens):
            best, best_n = None, 0
            for child in node.children:
                if child.tokens[0] == tokens[pos]:
                    n = common_prefix(child.tokens, tokens[pos : pos + len(child.tokens)])
                    if n > best_n:
                        best, best_n = child, n
            if best is None:
                break
            if self._running(best):
                running = pos + best_n
            pos += best_n
            if best_n < len(best.tokens):
                return Match(pos, running, best, best_n) if pos >= min_tokens else NO_MATCH
            node = best
        if node is self.root or pos < min_tokens:
            return NO_MATCH
        return Match(pos, running, node, len(node.tokens))

    # -- changing -------------------------------------------------------------------------

    def _add_holder(self, node: Node, owner: int) -> None:
        if self.is_slot(owner) and not self._running(node):
            self.cells_running += len(node.tokens)
        node.holders.add(owner)

    def _remove_holder(self, node: Node, owner: int) -> None:
        node.holders.discard(owner)
        if self.is_slot(owner) and not self._running(node):
            self.cells_running -= len(node.tokens)

    def _path(self, tail: Node) -> list[Node]:
        """Nodes from the root's child down to tail."""
        path = []
        node: Node | None = tail
        while node is not None and node is not self.root:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    def _split(self, node: Node, offset: int) -> Node:
        """Cut node after offset tokens; returns the new upper part (node keeps the lower part)."""
        head = Node(node.tokens[:offset], node.depth, node.parent)
        head.holders = set(node.holders)
        parent = node.parent
        assert parent is not None
        parent.children[parent.children.index(node)] = head
        node.tokens = node.tokens[offset:]
        node.depth += offset
        node.parent = head
        head.children.append(node)
        return head

    def attach(self, slot: int, match: Match) -> int:
        """Give an admitted request's slot the cells of a match; returns the tokens it need not compute."""
        assert slot not in self.tails, f"slot {slot} already holds cells"
        if match.node is None or match.num_tokens == 0:
            self.tails[slot] = self.root
            return 0
        node = match.node
        if match.offset < len(node.tokens):
            node = self._split(node, match.offset)
        source = min(node.holders)
        for seq in self._seqs(slot):
            self.memory.seq_cp(source, seq, 0, node.end)
        for n in self._path(node):
            self._add_holder(n, slot)
        self.tails[slot] = node
        now = self.clock()
        for h in node.holders:
            if h in self.entries:
                self.entries[h] = now
        return node.end

    def tag(self, slot: int, tag: Tag) -> None:
        """Say whose request a slot serves: its cells, cached when it ends, carry the tag."""
        if tag == UNTAGGED:
            self.tags.pop(slot, None)
        else:
            self.tags[slot] = tag

    def count_query(self, num_prompt: int, num_hit: int, num_restored: int = 0, num_disk: int = 0) -> None:
        """Count a request's first admission for /metrics: its prompt, the tokens it did not compute, and of those
        the ones a tier restored (num_disk of them from the disk tier)."""
        c = self.counters
        c.query_tokens_total += num_prompt
        c.hit_tokens_total += num_hit
        c.restored_tokens_total += num_restored
        c.disk_restored_tokens_total += num_disk

    def extend(self, slot: int, tokens: list[int]) -> None:
        """Record that a slot's next tokens were computed (their cells now exist)."""
        if not tokens:
            return
        start = self.tails[slot].end
        self.adopt(slot, tokens)
        if self.guard:
            self.memory.seq_cp(slot, self._twin(slot), start, -1)

    def adopt(self, slot: int, tokens: list[int]) -> None:
        """Record that a slot's next tokens' cells exist under every id of the slot already (restored from a
        tier): extend without its guard copy."""
        if not tokens:
            return
        tail = self.tails[slot]
        start = tail.end
        if tail is not self.root and tail.holders == {slot}:
            # A private tail has no children (theirs would be held by this slot): grow it in place.
            tail.tokens.extend(tokens)
        else:
            node = Node(list(tokens), start, tail)
            tail.children.append(node)
            node.holders.add(slot)
            self.tails[slot] = node
        self.cells_total += len(tokens)
        self.cells_running += len(tokens)

    def truncate(self, slot: int, num_tokens: int) -> None:
        """Take a slot's last num_tokens tokens off its path and out of the KV cache (rejected draft tokens).

        They were added by the last extend, so they lie in the slot's own tail node."""
        tail = self.tails[slot]
        assert tail is not self.root and tail.holders == {slot} and not tail.children, "only a private tail is cut"
        assert 0 < num_tokens <= len(tail.tokens), f"cannot cut {num_tokens} of {len(tail.tokens)} tokens"
        new_end = tail.end - num_tokens
        del tail.tokens[len(tail.tokens) - num_tokens :]
        self.cells_total -= num_tokens
        self.cells_running -= num_tokens
        if not tail.tokens:
            parent = tail.parent
            assert parent is not None
            parent.children.remove(tail)
            self.tails[slot] = parent
        for seq in self._seqs(slot):
            self.memory.seq_rm(seq, new_end, -1)

    def release(self, slot: int, keep: bool) -> None:
        """Take a slot out: its cells become a cache entry (keep) or are freed where nobody else holds them."""
        tail = self.tails.pop(slot, None)
        tag = self.tags.pop(slot, UNTAGGED)
        if tail is None:
            return
        entry = None
        if keep and self.enabled and tail is not self.root:
            entry = self._new_entry_id()
        if entry is not None:
            for seq in self._seqs(entry):
                self.memory.seq_cp(slot, seq, -1, -1)
            for n in self._path(tail):
                self._remove_holder(n, slot)
                n.holders.add(entry)
            self.tails[entry] = tail
            self.entries[entry] = self.clock()
            if tag != UNTAGGED:
                self.tags[entry] = tag
        else:
            self._drop_path(tail, slot)
        for seq in self._seqs(slot):
            self.memory.seq_rm(seq, -1, -1)
        if entry is not None:
            self._drop_covered(entry)

    def _drop_path(self, tail: Node, owner: int) -> int:
        """Remove owner from its path; nodes left without holders leave the tree. Returns cells freed."""
        freed = 0
        node: Node | None = tail
        while node is not None and node is not self.root:
            self._remove_holder(node, owner)
            parent = node.parent
            if not node.holders:
                assert not node.children, "a node without holders has no children"
                assert parent is not None
                parent.children.remove(node)
                freed += len(node.tokens)
            node = parent
        self.cells_total -= freed
        return freed

    def _drop_covered(self, entry: int) -> None:
        """Drop entries whose whole path lies on this entry's path: it already holds all their cells."""
        for n in self._path(self.tails[entry]):
            for h in list(n.holders):
                if h != entry and h in self.entries and self.tails[h] is n:
                    self._drop_entry(h)

    def _drop_entry(self, entry: int) -> int:
        freed = self._drop_path(self.tails.pop(entry), entry)
        del self.entries[entry]
        self.tags.pop(entry, None)
        for seq in self._seqs(entry):
            self.memory.seq_rm(seq, -1, -1)
        self._free_entry_ids.append(entry)
        return freed

    def _evict_entry(self, entry: int) -> int:
        """Drop an entry to make room (a lower tier may keep a copy first); returns cells freed."""
        if self.on_evict is not None:
            self.on_evict(entry, self.path_tokens(entry))
        return self._drop_entry(entry)

    def _new_entry_id(self) -> int | None:
        if not self._free_entry_ids and self.entries:
            self._evict_entry(min(self.entries, key=self.entries.__getitem__))
            self.counters.evictions_total += 1
        return self._free_entry_ids.pop() if self._free_entry_ids else None

    def _exclusive_cells(self, entry: int) -> int:
        """Cells that dropping this entry would free."""
        n, node = 0, self.tails[entry]
        while node is not self.root and node.holders == {entry}:
            n += len(node.tokens)
            node = node.parent
        return n

    def evict(self, num_cells: int) -> int:
        """Free at least num_cells cells held only by the cache, least recently used entries first."""
        freed = 0
        while freed < num_cells:
            candidates = [e for e in self.entries if self._exclusive_cells(e) > 0]
            if not candidates:
                break
            victim = min(candidates, key=self.entries.__getitem__)
            n = self._evict_entry(victim)
            freed += n
            self.counters.evictions_total += 1
            self.counters.evicted_tokens_total += n
        return freed

    def evict_all(self, slot: int | None = None) -> int:
        """Evict every cache entry, least recently used first (a lower tier keeps a copy); returns cells freed.

        Cells a running slot shares with an entry stay: only what the entries alone hold leaves the KV cache. An
        entry that `slot` reuses most of (they share at least as many tokens as the entry alone holds) is cut back
        to what they share, as llama-server's slot overwrites its own tail: its tail is dropped, not copied out."""
        freed = 0
        for entry in sorted(self.entries, key=self.entries.__getitem__):
            alone = self._exclusive_cells(entry)
            if alone == 0:
                continue  # every cell is held by a running slot too: evicting it frees nothing
            shared = sum(len(n.tokens) for n in self._path(self.tails[entry]) if slot in n.holders)
            n = self._drop_entry(entry) if slot is not None and shared >= alone else self._evict_entry(entry)
            freed += n
            self.counters.evictions_total += 1
            self.counters.evicted_tokens_total += n
        return freed

    def clear(self) -> None:
        """Drop every cache entry (running slots keep their cells)."""
        for entry in list(self.entries):
            self._drop_entry(entry)

    def check(self) -> list[str]:
        """Invariant violations, for tests: holders nest, counters agree with the nodes."""
        problems, total, running = [], 0, 0
        stack = list(self.root.children)
        while stack:
            node = stack.pop()
            total += len(node.tokens)
            running += len(node.tokens) if self._running(node) else 0
            if not node.holders or not node.tokens:
                problems.append(f"node at {node.depth} has no holders or no tokens")
            for child in node.children:
                if not child.holders <= node.holders:
                    problems.append(f"node at {child.depth} has holders its parent lacks")
                if child.depth != node.end:
                    problems.append(f"node at {child.depth} does not continue its parent ending at {node.end}")
            stack.extend(node.children)
        if (total, running) != (self.cells_total, self.cells_running):
            problems.append(f"counted {self.cells_total}/{self.cells_running} cells, nodes hold {total}/{running}")
        for owner, tail in self.tails.items():
            for n in self._path(tail):
                if owner not in n.holders:
                    problems.append(f"owner {owner} is missing from a node on its path")
        return problems
