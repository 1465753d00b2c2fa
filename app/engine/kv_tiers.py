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

import array
import collections
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from app.engine.prefix_cache import MIN_MATCH_TOKENS, UNTAGGED, PrefixCache, common_prefix
from app.paths import open_private, private_dir, private_file

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
    owner: str | None = None  # the member whose request left these cells (removed with the member)
    private: bool = False  # of a private class: kept in RAM, never written to disk

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
    # The disk tier: hits among hits_total, tokens among restored_tokens_total, time reading files.
    disk_hits_total: int = 0
    disk_restored_tokens_total: int = 0
    disk_read_seconds_total: float = 0.0


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
        """Mark a saved prefix used now (one dropped meanwhile stays dropped)."""
        saved.last_use_s = self.clock()
        if id(saved) in self._items:
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
                 clock: Callable[[], float] = time.monotonic, disk: DiskTier | None = None):
        self.cache = cache
        self.states = states
        self.ram = ram
        self.disk = disk
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
        saved = self._copy_out(entry, tokens)
        if saved is None:
            return
        c = self.counters
        if self.ram.put(saved):
            c.saves_total += 1
            c.saved_bytes_total += saved.num_bytes
        c.dropped_total = self.ram.num_dropped
        if self.disk is not None:
            self.disk.submit(saved)

    def _copy_out(self, entry: int, tokens: list[int]) -> SavedPrefix | None:
        """An entry's cells as states, window by window, through the transfer sequence."""
        if len(tokens) < MIN_MATCH_TOKENS:
            return None
        tag = self.cache.tags.get(entry, UNTAGGED)
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
            return None
        self.counters.save_seconds_total += time.perf_counter() - t0
        return SavedPrefix(list(tokens), window, blobs, self.clock(), tag.owner, tag.private)

    def _unwritten(self) -> list[tuple[int, list[int]]]:
        """The KV cache's entries (with their tokens) that the disk tier lacks."""
        if self.disk is None or not self.disk.accepting:
            return []
        found = []
        for entry in list(self.cache.entries):
            if self.cache.tags.get(entry, UNTAGGED).private:
                continue  # a private class's prompt never goes to disk
            tokens = self.cache.path_tokens(entry)
            if len(tokens) >= MIN_MATCH_TOKENS and not self.disk.holds(tokens):
                found.append((entry, tokens))
        return found

    @property
    def idle_write_delay_s(self) -> float:
        """How long the engine idles before idle() writes the prefixes the disk tier lacks."""
        return self.disk.idle_write_delay_s if self.disk is not None else IDLE_WRITE_DELAY_S

    def has_unwritten(self) -> bool:
        """True when the KV cache holds a prefix the disk tier lacks (the engine writes it once idle a moment)."""
        return bool(self._unwritten())

    def idle(self) -> None:
        """The engine has nothing to do: drop the disk's expired entries, write the KV cache's prefixes it lacks."""
        if self.disk is not None:
            self.disk.expire()
        for entry, tokens in self._unwritten():
            saved = self._copy_out(entry, tokens)
            if saved is not None:
                self.disk.submit(saved)

    def persist(self, timeout_s: float = 8.0) -> None:
        """Before the runner stops: every cached prefix the disk lacks written, the writes waited for."""
        if self.disk is None:
            return
        self.idle()
        for saved in self.ram.items():
            self.disk.submit(saved)
        if not self.disk.flush(timeout_s):
            log.warning("KV disk tier: writes still under way after %.0f s at shutdown; they are lost", timeout_s)

    # -- back into it ----------------------------------------------------------------------

    def offers(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` the RAM tier (or the disk tier) could restore: its best match."""
        if not tokens:
            return 0
        best = self.ram.best(tokens)[1] if len(self.ram) else 0
        if self.disk is not None and len(self.disk):
            best = max(best, self.disk.best(tokens)[1])
        return best

    def restore(self, slot: int, tokens: list[int], num_cached: int) -> int:
        """Give an admitted slot, which holds `num_cached` leading tokens' cells, more of them from the tier.

        Returns the tokens the slot holds afterwards (num_cached when the tier has nothing better)."""
        if not tokens or not (len(self.ram) or (self.disk is not None and len(self.disk))):
            return num_cached
        saved, m = self.ram.best(tokens)
        k = num_cached
        from_disk = False
        if self.disk is not None:
            entry, m_disk = self.disk.best(tokens)
            if entry is not None and m_disk > max(m, k) + MIN_MATCH_TOKENS:
                t0 = time.perf_counter()
                loaded = self.disk.load(entry)
                self.counters.disk_read_seconds_total += time.perf_counter() - t0
                if loaded is not None:
                    saved, m, from_disk = loaded, common_prefix(loaded.tokens, tokens), True
                    self.ram.put(saved)  # a later hit on it reads memory
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
            if from_disk:
                self.disk.forget(saved.tokens)
            return k
        self.cache.adopt(slot, tokens[k:m])
        if m == len(saved.tokens):
            self.ram.remove(saved)  # whole again in the KV cache; saved anew if evicted again
        else:
            self.ram.touch(saved)
        c.hits_total += 1
        c.restored_tokens_total += m - k
        if from_disk:
            c.disk_hits_total += 1
            c.disk_restored_tokens_total += m - k
        c.restore_seconds_total += time.perf_counter() - t0
        return m


def attach_tiers(scheduler, model, max_bytes: int | None, clock: Callable[[], float] = time.monotonic,
                 disk: DiskTier | None = None) -> KvTiers | None:
    """Hook the tiers into a scheduler's prefix cache, if any is on, the model can save states and the cache is on."""
    if (max_bytes == 0 and disk is None) or not scheduler.cache.enabled or getattr(model, "transfer_seq", None) is None:
        return None
    tiers = KvTiers(scheduler.cache, model, RamTier(max_bytes, clock), scheduler.config.kv_cells, clock, disk)
    scheduler.tiers = tiers
    return tiers


# -- the disk tier ----------------------------------------------------------------------------

# File format: MAGIC, a little-endian u32 header length, the header (JSON: key, n_tokens, window, sizes, sha256),
# then the payload: the tokens (int32 LE) and the states, one after another. sha256 covers the payload.
MAGIC = b"HEARTHKV1\n"
SUFFIX = ".kv"
TMP_PREFIX = ".tmp-"
DEFAULT_CACHE_DISK_MIB = 4096
# An entry not used for this long is deleted (the Models and runners setting runner_cache_disk_max_age_h): a
# household's hot prefixes are used daily, while a conversation's words should not lie on disk for good.
DEFAULT_CACHE_DISK_MAX_AGE_H = 72
WRITE_RETRY_S = 60.0
# How long the engine stays idle before it copies the KV cache's new prefixes out for the disk tier.
IDLE_WRITE_DELAY_S = 1.0
# The parts of a runner that decide what a KV cell holds and how llama.cpp lays a state out; any change
# gives another key, so another folder, and the old entries are never read.
FORMAT_VERSION = 1


def tier_key(model_path: str, template: str, settings: dict) -> dict:
    """What a disk entry is valid for: the model file's identity, the chat template, the KV settings."""
    st = os.stat(model_path)
    return {"format": FORMAT_VERSION, "model": os.path.basename(model_path), "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "template_sha256": hashlib.sha256(template.encode()).hexdigest(),
            **settings}


def key_digest(key: dict) -> str:
    """A key's folder name."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def entry_name(tokens: list[int]) -> str:
    """The file name of a saved prefix: a digest of its tokens."""
    return hashlib.sha256(array.array("i", tokens).tobytes()).hexdigest()[:32] + SUFFIX


@dataclass
class DiskEntry:
    """A saved prefix on disk, as the index knows it (its states stay in the file until a hit)."""

    name: str
    tokens: list[int]
    num_bytes: int
    last_use_s: float  # wall-clock seconds (the file's mtime)
    written: bool = True  # False while its write is queued
    owner: str | None = None


class DiskTier:
    """Saved prefixes in files under `root/<key digest>/`, least recently used first out under max_bytes.

    Written by a thread of its own (the engine never waits on the disk to save), atomically: a temporary
    file, fsync, rename, fsync of the folder, so a crash leaves a whole entry or none. Read on a hit by the
    engine thread, checked against its header and checksum; an unreadable, truncated or corrupted entry
    is dropped with a warning and the prompt is prefilled.
    """

    def __init__(self, root: str | os.PathLike, key: dict, max_bytes: int | None, max_age_s: float | None = None,
                 clock: Callable[[], float] = time.time, idle_write_delay_s: float = IDLE_WRITE_DELAY_S):
        self.key = key
        self.idle_write_delay_s = idle_write_delay_s  # how long the engine idles before it copies prefixes out
        self.max_age_s = max_age_s  # None: entries never expire
        self.clock = clock  # wall-clock time: ages are counted from the files' mtimes, across restarts
        self.digest = key_digest(key)
        # Entries hold the family's prompts and answers as token ids: owner-only folders and files.
        private_dir(root)
        self.dir = private_dir(Path(root) / self.digest)
        with open_private(self.dir / "key.json", "w") as f:
            f.write(json.dumps(key, sort_keys=True, indent=1) + "\n")
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._index: dict[str, DiskEntry] = {}
        self.num_dropped = 0  # dropped for the budget
        self.num_bad = 0  # dropped as unreadable
        self.num_expired = 0  # dropped as older than max_age_s
        self.num_written = 0
        self.num_failed_writes = 0
        self._retry_after = 0.0  # monotonic time before which nothing is submitted (a write just failed)
        self._closed = False
        self._scan()
        self._queue: queue.Queue[SavedPrefix | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="hearth-kv-disk", daemon=True)
        self._writer.start()

    # -- index ------------------------------------------------------------------------------

    def _scan(self) -> None:
        for path in self.dir.iterdir():
            if path.name.startswith(TMP_PREFIX):
                # A write a crash cut short (kill -9, power loss): never renamed, so never an entry; gone.
                log.warning("KV disk tier: removing %s, a write cut short (the runner was killed or the power "
                            "failed while it was written); its prompt will be prefilled", path.name)
                path.unlink(missing_ok=True)
                continue
            if path.suffix != SUFFIX:
                continue
            try:
                header, tokens = self._read_head(path)
                st = path.stat()
                if st.st_mode & 0o077:
                    private_file(path)  # written by an older Hearth, readable by every local user
                self._index[path.name] = DiskEntry(path.name, tokens, st.st_size, st.st_mtime, owner=header.get("owner"))
            except (OSError, ValueError) as exc:
                self._drop_bad(path, exc)
        self.expire()

    def _read_head(self, path: Path) -> tuple[dict, list[int]]:
        """A file's header and tokens, checked for everything but the checksum (the states are not read)."""
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                raise ValueError("not a Hearth KV entry")
            (n,) = struct.unpack("<I", f.read(4) or b"\0\0\0\0")
            header = json.loads(f.read(n))
            if header.get("key") != self.digest:
                raise ValueError("written for another model or KV settings")
            tokens = array.array("i")
            tokens.frombytes(f.read(4 * header["n_tokens"]))
            if len(tokens) != header["n_tokens"]:
                raise ValueError("truncated")
            expected = len(MAGIC) + 4 + n + 4 * header["n_tokens"] + sum(header["sizes"])
            if os.fstat(f.fileno()).st_size != expected:
                raise ValueError("truncated or with trailing bytes")
        return header, tokens.tolist()

    def _drop_bad(self, path: Path, why) -> None:
        log.warning("KV disk tier: dropping %s (%s); its prompt will be prefilled", path.name, why)
        self.num_bad += 1
        path.unlink(missing_ok=True)
        with self._lock:
            self._index.pop(path.name, None)

    def __len__(self) -> int:
        return len(self._index)

    @property
    def num_bytes(self) -> int:
        """Bytes of the entries on disk."""
        with self._lock:
            return sum(e.num_bytes for e in self._index.values())

    def expire(self) -> int:
        """Delete the entries not used for max_age_s; returns how many."""
        if self.max_age_s is None:
            return 0
        cutoff = self.clock() - self.max_age_s
        with self._lock:
            old = [e for e in self._index.values() if e.written and e.last_use_s < cutoff]
        for e in old:
            self._remove(e)
        self.num_expired += len(old)
        return len(old)

    def best(self, tokens: list[int]) -> tuple[DiskEntry | None, int]:
        """The entry sharing the most leading tokens with `tokens`, and how many it shares."""
        self.expire()
        best, best_n = None, 0
        with self._lock:
            entries = list(self._index.values())
        for e in entries:
            if e.written and e.tokens and e.tokens[0] == tokens[0]:
                n = common_prefix(e.tokens, tokens)
                if n > best_n:
                    best, best_n = e, n
        return best, best_n

    def holds(self, tokens: list[int]) -> bool:
        """True when an entry on disk (or on its way there) covers these tokens."""
        name = entry_name(tokens)
        with self._lock:
            if name in self._index:  # the usual answer: this very prefix was written
                return True
            entries = list(self._index.values())
        n = len(tokens)
        return any(len(e.tokens) >= n and e.tokens[0] == tokens[0] and e.tokens[:n] == tokens for e in entries)

    # -- reading ----------------------------------------------------------------------------

    def load(self, entry: DiskEntry) -> SavedPrefix | None:
        """An entry's states, checked; None (the entry dropped, with a warning) when they cannot be trusted."""
        path = self.dir / entry.name
        try:
            with open(path, "rb") as f:
                if f.read(len(MAGIC)) != MAGIC:
                    raise ValueError("not a Hearth KV entry")
                (n,) = struct.unpack("<I", f.read(4))
                header = json.loads(f.read(n))
                if header.get("key") != self.digest:
                    raise ValueError("written for another model or KV settings")
                payload = bytearray(4 * header["n_tokens"] + sum(header["sizes"]))
                if f.readinto(payload) != len(payload) or f.read(1):
                    raise ValueError("truncated or with trailing bytes")
            if hashlib.sha256(payload).hexdigest() != header["sha256"]:
                raise ValueError("checksum mismatch")
        except FileNotFoundError:
            # Deleted by serve meanwhile (expired, or its member removed): forgotten, not unreadable.
            log.info("KV disk tier: %s was removed meanwhile; its prompt will be prefilled", path.name)
            with self._lock:
                self._index.pop(path.name, None)
            return None
        except (OSError, ValueError, KeyError, struct.error) as exc:
            self._drop_bad(path, exc)
            return None
        tokens = array.array("i")
        nt = 4 * header["n_tokens"]
        tokens.frombytes(bytes(payload[:nt]))
        states, pos = [], nt
        for size in header["sizes"]:
            states.append(payload[pos : pos + size])
            pos += size
        now = self.clock()
        entry.last_use_s = now
        os.utime(path, (now, now))
        return SavedPrefix(tokens.tolist(), header["window"], states, time.monotonic(), header.get("owner"))

    # -- writing ----------------------------------------------------------------------------

    @property
    def accepting(self) -> bool:
        """False for a while after a write failed (a full disk)."""
        return not self._closed and time.monotonic() >= self._retry_after

    def submit(self, saved: SavedPrefix) -> None:
        """Write a saved prefix in the background, unless the disk holds it (or more of it) already."""
        if saved.private or (self.max_bytes is not None and saved.num_bytes > self.max_bytes):
            return
        if not self.accepting or self.holds(saved.tokens):
            return
        with self._lock:
            # Reserved now, so a second submit before the write sees it.
            self._index[entry_name(saved.tokens)] = DiskEntry(entry_name(saved.tokens), list(saved.tokens),
                                                               saved.num_bytes, self.clock(), written=False,
                                                               owner=saved.owner)
        self._queue.put(saved)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every submitted entry is written; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def _write_loop(self) -> None:
        while True:
            saved = self._queue.get()
            try:
                if saved is None:
                    return
                self._write(saved)
            except Exception as exc:
                # A full or failing disk is not asked again at every idle moment: once a minute at most.
                self._retry_after = time.monotonic() + WRITE_RETRY_S
                log.warning("KV disk tier: writing an entry failed (%s); it stays in RAM only", exc)
                with self._lock:
                    self._index.pop(entry_name(saved.tokens), None)
                    # Counted last, once reported and forgotten: a reader of the count finds both done.
                    self.num_failed_writes += 1
            finally:
                self._queue.task_done()

    def _write(self, saved: SavedPrefix) -> None:
        name = entry_name(saved.tokens)
        tokens = array.array("i", saved.tokens).tobytes()
        digest = hashlib.sha256(tokens)
        for s in saved.states:
            digest.update(s)
        header = json.dumps({"key": self.digest, "n_tokens": len(saved.tokens), "window": saved.window,
                             "sizes": [len(s) for s in saved.states], "sha256": digest.hexdigest(),
                             "owner": saved.owner}).encode()
        tmp = self.dir / f"{TMP_PREFIX}{name}"
        try:
            with open_private(tmp, "wb") as f:
                f.write(MAGIC + struct.pack("<I", len(header)) + header + tokens)
                for s in saved.states:
                    f.write(s)
                f.flush()
                os.fsync(f.fileno())
            now = self.clock()
            os.utime(tmp, (now, now))  # its age counts on the tier's clock
            os.replace(tmp, self.dir / name)
        except OSError:
            tmp.unlink(missing_ok=True)  # a full disk: no half entry left behind
            raise
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self.num_written += 1
        with self._lock:
            entry = self._index.get(name)
            if entry is not None:
                entry.num_bytes = (self.dir / name).stat().st_size
                entry.written = True
            # What the new entry covers is redundant now.
            covered = [e for e in self._index.values() if e.name != name and len(e.tokens) < len(saved.tokens)
                       and saved.tokens[: len(e.tokens)] == e.tokens]
        for e in covered:
            self._remove(e)
        self._enforce_budget(keep=name)

    def forget(self, tokens: list[int]) -> None:
        """Delete the entry of exactly these tokens (llama.cpp refused its states)."""
        with self._lock:
            entry = self._index.get(entry_name(tokens))
        if entry is not None:
            self._remove(entry)

    def _remove(self, entry: DiskEntry) -> None:
        (self.dir / entry.name).unlink(missing_ok=True)
        with self._lock:
            self._index.pop(entry.name, None)

    def _enforce_budget(self, keep: str) -> None:
        if self.max_bytes is None:
            return
        while True:
            with self._lock:
                total = sum(e.num_bytes for e in self._index.values())
                others = [e for e in self._index.values() if e.name != keep]
            if total <= self.max_bytes or not others:
                return
            self._remove(min(others, key=lambda e: e.last_use_s))
            self.num_dropped += 1

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish the writes under way (up to timeout_s) and stop the writer; later submits are ignored."""
        self._closed = True
        self.flush(timeout_s)
        self._queue.put(None)
        self._writer.join(timeout_s)


# -- serve's side: the tier's folders while no runner holds them ------------------------------


def _entries(root: str | os.PathLike):
    """Every entry file under the tier's root (one folder per key)."""
    root = Path(root)
    if not root.is_dir():
        return
    for folder in root.iterdir():
        if folder.is_dir() and not folder.is_symlink():
            yield from (p for p in folder.iterdir() if p.suffix == SUFFIX and not p.name.startswith(TMP_PREFIX))


def entry_owner(path: Path) -> str | None:
    """The member an entry file was written for (None: unknown, or not an entry)."""
    try:
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                return None
            (n,) = struct.unpack("<I", f.read(4))
            return json.loads(f.read(n)).get("owner")
    except (OSError, ValueError, struct.error):
        return None


def expire_entries(root: str | os.PathLike, max_age_s: float, now: float) -> int:
    """Delete the entries under root not used for max_age_s (a model no runner serves keeps its files); returns how many."""
    removed = 0
    for path in list(_entries(root)):
        try:
            if path.stat().st_mtime < now - max_age_s:
                path.unlink()
                removed += 1
        except FileNotFoundError:
            continue
    return removed


def remove_owner_entries(root: str | os.PathLike, owners: Callable[[str], bool]) -> int:
    """Delete the entries under root written for a member `owners` accepts (a removed member's); returns how many."""
    removed = 0
    for path in list(_entries(root)):
        owner = entry_owner(path)
        if owner is not None and owners(owner):
            path.unlink(missing_ok=True)
            removed += 1
    return removed
