"""KV tiers below the KV cache: prefix-cache entries evicted from it are kept in host RAM and restored on a hit.

Without a tier, an entry the prefix cache evicts (its cells were needed) is gone: the next request with
that prefix prefills it again. With one, the entry's cells are copied out of the KV cache first, with
llama.cpp's per-sequence state API (`llama_state_seq_get_data`), and kept least-recently-used under a byte
budget; a later request whose prompt shares more of it than the KV cache still holds gets those cells
back (`llama_state_seq_set_data`) instead of computing them. The bytes are the cells' own, so a restored
prefix gives the same logits as one that never left the cache.

How the cells travel (llama.cpp's constraints, read in the vendored llama-kv-cache.cpp):
- A state is written from, and read into, a sequence id below the context's n_seq_max (state_write_meta
  lists a cell's sequences only up to it), while the prefix cache's entries live at ids above the slots.
  So the model reserves one more id, the transfer sequence: an entry's cells are seq_cp'd to it, saved,
  and it is cleared; a restore reads into it and seq_cp's what the request needs to the request's slot.
- State writing leaves out the cells a sliding window masks from the sequence's last position. On a
  sliding-window model (Gemma 3) an entry is therefore saved in windows of n_swa positions, each from
  the transfer sequence holding that window alone, so every cell of every layer is kept and any prefix of
  a saved entry can be restored, not only its whole length. A restored window that comes back shorter
  than it went out (a window type this does not know) fails the restore, and the prompt is prefilled.
- A restore needs free cells for what it keeps plus the window in transit; it evicts cached prefixes for them (which
  go to the tier in turn) and gives up, leaving the prompt to be prefilled, when running sequences hold
  too many cells.

Pure Python: the KV operations go to `KvStates` (the llama.cpp model, or a fake in tests).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from app.engine.prefix_cache import MIN_MATCH_TOKENS, PrefixCache, common_prefix

log = logging.getLogger(__name__)

MIB = 1 << 20
# llama-server's --cache-ram: -1 no limit, 0 disabled, else MiB.
CACHE_RAM_UNLIMITED = -1
# Hearth's default: a quarter of llama-server's 8 GiB. A household NAS has 8-32 GiB shared with the models'
# weights, so 8 GiB could push it into swap; 2 GiB holds ~110 Gemma 3 270M voice prompts of 2,000 tokens
# (18 KiB a token) or ~8 of an 8B model with grouped-query attention (128 KiB a token) — the household's
# hot prefixes, not every conversation ever evicted.
DEFAULT_CACHE_RAM_MIB = 2048


class KvStates(Protocol):
    """What the tiers need from the model: its KV cache's sequences and their saved states."""

    transfer_seq: int  # a sequence id no slot or cache entry uses, below the context's n_seq_max
    n_swa: int

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None: ...
    def seq_rm(self, seq: int, p0: int, p1: int) -> None: ...
    def state_save(self, seq: int) -> bytearray: ...
    def state_load(self, seq: int, data: bytearray) -> bool: ...
    def seq_pos_range(self, seq: int) -> tuple[int, int]: ...


def cache_ram_bytes(mib: int) -> int | None:
    """--cache-ram in bytes: None for no limit (-1), 0 for off."""
    if mib < CACHE_RAM_UNLIMITED:
        raise ValueError(f"--cache-ram must be -1 (no limit), 0 (off) or a size in MiB, not {mib}")
    return None if mib == CACHE_RAM_UNLIMITED else mib * MIB


@dataclass
class SavedPrefix:
    """A prefix-cache entry's cells outside the KV cache: one llama.cpp state per window of positions."""

    tokens: list[int]
    window: int  # positions per state (the last may hold fewer)
    states: list[bytearray]
    last_use_s: float

    @property
    def num_bytes(self) -> int:
        """Bytes the states take."""
        return sum(len(s) for s in self.states)


@dataclass
class TierCounters:
    """Monotonic totals since start, for /metrics."""

    saves_total: int = 0  # entries copied out of the KV cache
    saved_bytes_total: int = 0
    save_seconds_total: float = 0.0
    hits_total: int = 0  # admissions that got cells back from the tier
    restored_tokens_total: int = 0
    restore_seconds_total: float = 0.0
    failures_total: int = 0  # restores llama.cpp refused (the prompt was prefilled)
    dropped_total: int = 0  # entries dropped to stay within the budget


class RamTier:
    """Saved prefixes in host RAM, least recently used first out, never more than max_bytes (None: no limit)."""

    def __init__(self, max_bytes: int | None, clock: Callable[[], float] = time.monotonic):
        self.max_bytes = max_bytes
        self.clock = clock
        self._items: collections.OrderedDict[int, SavedPrefix] = collections.OrderedDict()  # LRU first
        self.num_bytes = 0
        self.num_dropped = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, saved: SavedPrefix) -> bool:
        return id(saved) in self._items

    def put(self, saved: SavedPrefix) -> bool:
        """Keep a saved prefix, dropping the least recently used ones it needs room from; False when it cannot fit."""
        size = saved.num_bytes
        if self.max_bytes is not None and size > self.max_bytes:
            return False
        # What it covers is redundant (a prefix of it restores from it); what covers it makes it so.
        for other in list(self._items.values()):
            n = common_prefix(other.tokens, saved.tokens)
            if n == len(other.tokens):
                self.remove(other)
            elif n == len(saved.tokens):
                self.touch(other)
                return True
        while self.max_bytes is not None and self._items and self.num_bytes + size > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.num_bytes -= old.num_bytes
            self.num_dropped += 1
        saved.last_use_s = self.clock()
        self._items[id(saved)] = saved
        self.num_bytes += size
        return True

    def touch(self, saved: SavedPrefix) -> None:
        """Mark a saved prefix used now."""
        saved.last_use_s = self.clock()
        self._items.move_to_end(id(saved))

    def remove(self, saved: SavedPrefix) -> None:
        """Forget a saved prefix (restored whole: the KV cache holds it again)."""
        if self._items.pop(id(saved), None) is not None:
            self.num_bytes -= saved.num_bytes

    def best(self, tokens: list[int]) -> tuple[SavedPrefix | None, int]:
        """The saved prefix sharing the most leading tokens with `tokens`, and how many it shares."""
        best, best_n = None, 0
        for saved in self._items.values():
            if saved.tokens[0] != tokens[0]:
                continue
            n = common_prefix(saved.tokens, tokens)
            if n > best_n:
                best, best_n = saved, n
        return best, best_n

    def items(self) -> list[SavedPrefix]:
        """The saved prefixes, least recently used first."""
        return list(self._items.values())


class KvTiers:
    """Moves prefix-cache entries between the KV cache and the RAM tier (hooks of the cache and the scheduler)."""

    def __init__(self, cache: PrefixCache, states: KvStates, ram: RamTier, kv_cells: int,
                 clock: Callable[[], float] = time.monotonic):
        self.cache = cache
        self.states = states
        self.ram = ram
        self.kv_cells = kv_cells
        self.clock = clock
        self.counters = TierCounters()
        self.window = states.n_swa or 0  # 0: one state for the whole entry
        cache.reserve_seq(states.transfer_seq)
        cache.on_evict = self.save

    @property
    def num_bytes(self) -> int:
        """Bytes the RAM tier holds."""
        return self.ram.num_bytes

    # -- out of the KV cache ------------------------------------------------------------------

    def save(self, entry: int, tokens: list[int]) -> None:
        """Copy an entry's cells out before the prefix cache drops it (the cache's on_evict hook)."""
        if len(tokens) < MIN_MATCH_TOKENS:
            return
        t0 = time.perf_counter()
        s, T = self.states, self.states.transfer_seq
        window = self.window or len(tokens)
        blobs = []
        try:
            for a in range(0, len(tokens), window):
                b = min(a + window, len(tokens))
                s.seq_cp(entry, T, a, b)
                blobs.append(s.state_save(T))
                s.seq_rm(T, -1, -1)
        except Exception:
            s.seq_rm(T, -1, -1)
            log.exception("saving a cached prefix of %d tokens failed; it is dropped", len(tokens))
            return
        saved = SavedPrefix(list(tokens), window, blobs, self.clock())
        c = self.counters
        c.save_seconds_total += time.perf_counter() - t0
        if self.ram.put(saved):
            c.saves_total += 1
            c.saved_bytes_total += saved.num_bytes
        c.dropped_total = self.ram.num_dropped

    # -- back into it ----------------------------------------------------------------------

    def restore(self, slot: int, tokens: list[int], num_cached: int) -> int:
        """Give an admitted slot, which holds `num_cached` leading tokens' cells, more of them from the tier.

        Returns the tokens the slot holds afterwards (num_cached when the tier has nothing better)."""
        if not len(self.ram) or not tokens:
            return num_cached
        saved, m = self.ram.best(tokens)
        k = num_cached
        if saved is None or m - k < MIN_MATCH_TOKENS:
            return k
        window = saved.window
        # Free cells at the peak, the last window in transit: the cells kept from the windows before it plus
        # that window's (a kept cell is the restored one, shared by seq_cp, not a copy). Cached prefixes give way.
        a_last = (m - 1) // window * window
        need = max(0, a_last - k) + min(a_last + window, len(saved.tokens)) - a_last
        short = need - (self.kv_cells - self.cache.cells_total)
        if short > 0 and self.cache.evict(short) < short:
            return k
        t0 = time.perf_counter()
        s, T = self.states, self.states.transfer_seq
        seqs = self.cache.seq_ids(slot)
        ok = True
        try:
            for i in range(k // window, (m - 1) // window + 1):
                a, b = i * window, min((i + 1) * window, len(saved.tokens))
                if not s.state_load(T, saved.states[i]) or s.seq_pos_range(T) != (a, b - 1):
                    ok = False
                    break
                lo, hi = max(a, k), min(b, m)
                # Every id of the slot at once: between two windows no cell may be held by one sequence
                # alone, or the next window's restore could take it for a slid-out cell (see PrefixCache).
                for seq in seqs:
                    s.seq_cp(T, seq, lo, hi)
        finally:
            s.seq_rm(T, -1, -1)
        c = self.counters
        if not ok:
            for seq in seqs:
                s.seq_rm(seq, k, -1)
            c.failures_total += 1
            log.warning("llama.cpp refused a saved prefix of %d tokens; it is dropped and the prompt prefilled",
                        len(saved.tokens))
            self.ram.remove(saved)
            return k
        self.cache.adopt(slot, tokens[k:m])
        if m == len(saved.tokens):
            self.ram.remove(saved)  # whole again in the KV cache; saved anew if evicted again
        else:
            self.ram.touch(saved)
        c.hits_total += 1
        c.restored_tokens_total += m - k
        c.restore_seconds_total += time.perf_counter() - t0
        return m


def attach_tiers(scheduler, model, max_bytes: int | None, clock: Callable[[], float] = time.monotonic) -> KvTiers | None:
    """Hook a RAM tier into a scheduler's prefix cache, if the model can save states and the cache is on."""
    if max_bytes == 0 or not scheduler.cache.enabled or getattr(model, "transfer_seq", None) is None:
        return None
    tiers = KvTiers(scheduler.cache, model, RamTier(max_bytes, clock), scheduler.config.kv_cells, clock)
    scheduler.tiers = tiers
    return tiers
