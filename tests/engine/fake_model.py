"""A fake ModelBackend: exact unified-KV accounting, recorded batches, deterministic tokens, no llama.cpp.

Cells are physical as in llama.cpp's unified cache: seq_cp gives a sequence the cells of another
(shared, counted once), a cell is freed when no sequence holds it any more.
The fake checks what llama.cpp would refuse or silently get wrong (a sequence's positions not
continuing its cells, two chunks of one sequence in a batch, logits read for the wrong sequence,
a sampler used after it was freed, a copy or removal that leaves a hole in a sequence) and records
each problem in `violations`, so a test can assert that the engine never did any of it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from app.engine.engine import DECODE_NO_KV_SLOT, DECODE_OK
from app.engine.request import SamplingParams
from app.engine.scheduler import Chunk


class FakeClock:
    """A clock that moves only when told to; the fake model moves it once per accepted decode."""

    def __init__(self, start_s: float = 100.0):
        self._now_s = start_s
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now_s

    def advance(self, seconds: float) -> None:
        """Move the clock forward."""
        with self._lock:
            self._now_s += seconds


@dataclass(frozen=True)
class BatchEntry:
    """One chunk of a batch as the fake model received it."""

    request_id: int
    slot: int
    start_pos: int
    tokens: tuple[int, ...]
    want_logits: bool
    num_draft: int = 0  # draft tokens at the end of the chunk, each verified (logits for each)


@dataclass
class FakeSampler:
    """Remembers the prompt, so sample() can check it reads the logits of the right sequence."""

    prompt: tuple[int, ...]
    params: SamplingParams
    freed: bool = False
    steps: int = 0  # tokens sampled or forced so far
    forced_at: set[int] = field(default_factory=set)  # the output positions that were forced


def default_next_token(history: tuple[int, ...]) -> int:
    """A deterministic function of a sequence's tokens, in 10..99 (never EOS)."""
    weighted = sum((i + 1) * t for i, t in enumerate(history))
    return 10 + (weighted * 7919 + len(history)) % 90


class FakeModel:
    """Stands in for LlamaModel: n_ctx cells shared by n_seq_max sequences, one decode at a time."""

    def __init__(
        self,
        n_ctx: int = 256,
        n_batch: int = 64,
        n_seq_max: int = 4,
        eos_token: int = 2,
        ignore_eos_token: int = 3,
        pieces: dict[int, bytes] | None = None,
        scripts: dict[tuple[int, ...], list[int]] | None = None,
        kv_capacity: int | None = None,
        decode_step_s: float = 0.010,
        decode_delay_s: float = 0.0,
        clock: FakeClock | None = None,
        on_decode: Callable[[int, list[Chunk]], None] | None = None,
        n_swa: int = 0,
        share_blocker: str | None = None,
        specials: dict[int, bytes] | None = None,
        refuse_forced: frozenset[int] = frozenset(),
        transfer_seq: int | None = None,
    ):
        self.n_ctx = n_ctx
        self.n_swa = n_swa
        # The sequence KV states are saved from and restored into (LlamaModel's, with kv_transfer); None: no states.
        self.transfer_seq = transfer_seq
        self.refuse_states = False  # state_load answers False, as llama.cpp refusing a state
        self.num_state_loads = 0
        self.share_blocker = share_blocker
        self.n_batch = n_batch
        self.n_seq_max = n_seq_max
        self.eos_token = eos_token
        # What the real sampler picks instead of EOS when ignore_eos biases EOS to -inf.
        self.ignore_eos_token = ignore_eos_token
        self.pieces = dict(pieces or {})
        # Special tokens: their text shows only when rendered with the markup (special_bytes), as llama.cpp's.
        self.specials = dict(specials or {})
        # Tokens a forced step is refused for, as a grammar that does not admit them would.
        self.refuse_forced = frozenset(refuse_forced)
        self.forced: list[int] = []  # tokens taken through force(), in order
        self._forced_now: set[int] = set()  # the sequence being sampled: its forced output positions
        # A script is the answer to one exact prompt; after it ends the model says EOS.
        self.scripts = {tuple(k): list(v) for k, v in (scripts or {}).items()}
        # Cells that really exist; less than n_ctx simulates a cache that cannot hold n_ctx tokens.
        self.kv_capacity = n_ctx if kv_capacity is None else kv_capacity
        self.decode_step_s = decode_step_s
        self.decode_delay_s = decode_delay_s
        self.clock = clock or FakeClock()
        self.on_decode = on_decode

        self.seqs: dict[int, list[int]] = {}  # sequence id → its cell ids by position
        self.cell_tokens: dict[int, int] = {}
        self.refs: dict[int, int] = {}  # cell id → sequences holding it (absent: free)
        self._next_cell = 0
        self.kv_ops: list[tuple] = []  # seq_cp / seq_rm calls, in order
        self.batches: list[list[BatchEntry]] = []  # accepted decodes, in order
        self.rejected: list[list[BatchEntry]] = []  # decodes answered with "no KV slot"
        self.cleared: list[int] = []  # clear_seq calls, by slot
        self.violations: list[str] = []
        self.num_decode_calls = 0
        self.live_samplers = 0
        self._rows: dict[int, tuple[int, tuple[int, ...]]] = {}
        # As a draft model (top_token): history → (token, probability); None: the scripts' own next token.
        self.draft_rule: Callable[[tuple[int, ...]], tuple[int, float]] | None = None

    # -- KV cache and decode ----------------------------------------------------------------

    @property
    def kv_used(self) -> int:
        """Cells held by any sequence (a shared cell counts once)."""
        return len(self.refs)

    @property
    def cells(self) -> dict[int, list[int]]:
        """Each slot's tokens in the cache, by position."""
        return {slot: self.tokens_of(slot) for slot in range(self.n_seq_max)}

    def tokens_of(self, seq: int) -> list[int]:
        """The tokens whose cells a sequence holds, by position."""
        return [self.cell_tokens[c] for c in self.seqs.get(seq, [])]

    def kv_share_blocker(self) -> str | None:
        """Why sequences could not share cells (None: they can)."""
        return self.share_blocker

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Give dst the cells of src at positions [p0, p1) (shared, not copied)."""
        self.kv_ops.append(("cp", src, dst, p0, p1))
        cells = self.seqs.get(src, [])
        p0 = max(p0, 0)
        p1 = len(cells) if p1 < 0 else p1
        target = self.seqs.setdefault(dst, [])
        if p1 > len(cells):
            self.violations.append(f"seq_cp({src}, {dst}, {p0}, {p1}): source holds only {len(cells)} cells")
        if len(target) != p0:
            self.violations.append(f"seq_cp({src}, {dst}, {p0}, {p1}): target holds {len(target)} cells, a hole")
        for c in cells[p0:p1]:
            target.append(c)
            self.refs[c] += 1

    def seq_rm(self, seq: int, p0: int, p1: int) -> None:
        """Take positions [p0, p1) out of a sequence; cells nobody holds any more are free."""
        self.kv_ops.append(("rm", seq, p0, p1))
        cells = self.seqs.get(seq, [])
        p0 = max(p0, 0)
        if p1 >= 0 and p1 < len(cells):
            self.violations.append(f"seq_rm({seq}, {p0}, {p1}) leaves a hole in {len(cells)} cells")
        for c in cells[p0:]:
            self.refs[c] -= 1
            if not self.refs[c]:
                del self.refs[c]
                del self.cell_tokens[c]
        del cells[p0:]
        if p0 == 0 and seq < self.n_seq_max:
            self.cleared.append(seq)

    def decode(self, chunks: list[Chunk]) -> tuple[int, list[int]]:
        """Accept the whole batch if its tokens fit the free cells, else return 1 and change nothing."""
        self.num_decode_calls += 1
        if self.on_decode is not None:
            self.on_decode(self.num_decode_calls, chunks)
        entries = [
            BatchEntry(c.request.request_id, c.request.slot, c.start_pos, tuple(c.tokens), c.want_logits,
                       getattr(c, "num_draft", 0))
            for c in chunks
        ]
        n = sum(len(e.tokens) for e in entries)
        if n == 0:
            self.violations.append(f"decode #{self.num_decode_calls}: empty batch")
        if n > self.n_batch:
            # The real backend refuses too: llama.cpp would abort the process.
            self.violations.append(f"decode #{self.num_decode_calls}: {n} tokens > n_batch {self.n_batch}")
            raise ValueError(f"batch of {n} tokens exceeds n_batch {self.n_batch}")
        slots = [e.slot for e in entries]
        if len(set(slots)) != len(slots):
            self.violations.append(f"decode #{self.num_decode_calls}: a slot appears twice: {slots}")
        for e in entries:
            if e.slot is None or not 0 <= e.slot < self.n_seq_max:
                self.violations.append(f"decode #{self.num_decode_calls}: bad slot {e.slot}")
            elif e.start_pos != len(self.seqs.get(e.slot, [])):
                self.violations.append(
                    f"decode #{self.num_decode_calls}: slot {e.slot} holds {len(self.seqs.get(e.slot, []))} cells "
                    f"but the chunk starts at {e.start_pos}"
                )
            if not e.tokens:
                self.violations.append(f"decode #{self.num_decode_calls}: empty chunk for slot {e.slot}")
        logit_idx: list[int] = []
        pos = 0
        for e in entries:
            pos += len(e.tokens)
            if e.num_draft:
                logit_idx.append(pos - 1 - e.num_draft)
            else:
                logit_idx.append(pos - 1 if e.want_logits else -1)
        if self.kv_used + n > self.kv_capacity:
            self.rejected.append(entries)
            return DECODE_NO_KV_SLOT, logit_idx
        self._rows = {}
        for e, idx in zip(entries, logit_idx):
            cells = self.seqs.setdefault(e.slot, [])
            for t in e.tokens:
                self.cell_tokens[self._next_cell] = t
                self.refs[self._next_cell] = 1
                cells.append(self._next_cell)
                self._next_cell += 1
            if idx >= 0:
                history = tuple(self.tokens_of(e.slot))
                # A draft chunk has a row per verified position: the history up to that position.
                for j in range(e.num_draft + 1):
                    self._rows[idx + j] = (e.slot, history[: len(history) - e.num_draft + j])
        self.batches.append(entries)
        self.clock.advance(self.decode_step_s)
        if self.decode_delay_s:
            time.sleep(self.decode_delay_s)
        return DECODE_OK, logit_idx

    def state_save(self, seq: int) -> bytearray:
        """A sequence's cells as a state: its tokens by position (the fake's cells are their tokens)."""
        return bytearray(",".join(str(t) for t in self.tokens_of(seq)).encode())

    def state_load(self, seq: int, data: bytearray) -> bool:
        """Give an emptied sequence new cells with a saved state's tokens; False when refused or out of cells."""
        self.num_state_loads += 1
        self.seq_rm(seq, -1, -1)
        tokens = [int(t) for t in bytes(data).decode().split(",") if t]
        if self.refuse_states or self.kv_used + len(tokens) > self.kv_capacity:
            return False
        cells = self.seqs.setdefault(seq, [])
        for t in tokens:
            self.cell_tokens[self._next_cell] = t
            self.refs[self._next_cell] = 1
            cells.append(self._next_cell)
            self._next_cell += 1
        return True

    def seq_pos_range(self, seq: int) -> tuple[int, int]:
        """Smallest and largest position a sequence holds (-1, -1: none)."""
        n = len(self.seqs.get(seq, []))
        return (0, n - 1) if n else (-1, -1)

    def clear_seq(self, slot: int) -> None:
        """Free every cell of one sequence."""
        self.seq_rm(slot, -1, -1)

    # -- sampling ---------------------------------------------------------------------------

    def make_sampler(self, params: SamplingParams, prompt_tokens: list[int]) -> FakeSampler:
        """A sampler that knows its prompt (the real one returns None for plain greedy)."""
        self.live_samplers += 1
        return FakeSampler(tuple(prompt_tokens), params)

    def free_sampler(self, sampler: FakeSampler | None) -> None:
        """Release a sampler; freeing one twice is a violation."""
        if sampler is None:
            return
        if sampler.freed:
            self.violations.append(f"sampler for prompt {sampler.prompt[:4]}... freed twice")
            return
        sampler.freed = True
        self.live_samplers -= 1

    def sample(self, sampler: FakeSampler, params: SamplingParams, batch_index: int) -> int:
        """The next token of the sequence whose logits sit at batch_index in the last accepted decode."""
        if sampler is None or sampler.freed:
            self.violations.append("sample() with a missing or freed sampler")
        row = self._rows.get(batch_index)
        if row is None:
            self.violations.append(f"sample() at batch index {batch_index}, which has no logits")
            return self.eos_token
        _slot, history = row
        prompt = sampler.prompt if sampler is not None else ()
        if history[: len(prompt)] != prompt:
            self.violations.append(f"sample() read the logits of another sequence at index {batch_index}")
        self._forced_now = sampler.forced_at if sampler is not None else set()
        token = self.next_token(prompt, history)
        if params.ignore_eos and self.is_eog(token):
            token = self.ignore_eos_token
        if sampler is not None:
            sampler.steps += 1
        return token

    def force(self, sampler: FakeSampler, params: SamplingParams, token: int) -> bool:
        """Take a forced token (recorded), unless it is one of refuse_forced."""
        if sampler is None or sampler.freed:
            self.violations.append("force() with a missing or freed sampler")
        if token in self.refuse_forced:
            return False
        self.forced.append(token)
        if sampler is not None:
            sampler.forced_at.add(sampler.steps)
            sampler.steps += 1
        return True

    def top_token(self, batch_index: int, with_p: bool = False) -> tuple[int, float]:
        """A draft model's greedy step at batch_index: draft_rule's pick, else what the script of the prompt the
        history starts with says next (default_next_token without one), with probability 1."""
        row = self._rows.get(batch_index)
        if row is None:
            self.violations.append(f"top_token() at batch index {batch_index}, which has no logits")
            return self.eos_token, 1.0
        _slot, history = row
        if self.draft_rule is not None:
            return self.draft_rule(history)
        prompt = max((p for p in self.scripts if history[: len(p)] == p), key=len, default=())
        return self.next_token(prompt, history), 1.0

    def vocab_facts(self) -> dict:
        """What the draft/target vocabulary check compares (draft_model.vocab_mismatch)."""
        return {"type": 1, "add_bos": True, "bos": 1, "add_eos": False, "eos": self.eos_token, "n_vocab": 512}

    def vocab_texts(self, start: int, end: int) -> list[bytes]:
        """Token texts of ids [start, end)."""
        return [self.token_bytes(t) for t in range(start, end)]

    def logprob(self, batch_index: int, token: int, top_n: int) -> dict:
        """A fixed log-probability entry (the real one comes from the logits)."""
        entry = {"token": self.token_bytes(token).decode(), "logprob": -0.5, "bytes": list(self.token_bytes(token))}
        return {**entry, "top_logprobs": [entry] * top_n}

    def next_token(self, prompt: tuple[int, ...], history: tuple[int, ...]) -> int:
        """The token that follows history: the prompt's script if it has one, else default_next_token."""
        script = self.scripts.get(tuple(prompt))
        if script is None:
            return default_next_token(history)
        n_generated = len(history) - len(prompt)
        return script[n_generated] if n_generated < len(script) else self.eos_token

    def expected_tokens(self, prompt: list[int], n: int) -> list[int]:
        """What an ideal unbatched run generates for this prompt with ignore_eos (the reference)."""
        history = tuple(prompt)
        out: list[int] = []
        for _ in range(n):
            token = self.next_token(tuple(prompt), history)
            if self.is_eog(token):
                token = self.ignore_eos_token
            out.append(token)
            history += (token,)
        return out

    # -- vocabulary ---------------------------------------------------------------------------

    def token_bytes(self, token: int) -> bytes:
        """The token's piece: nothing for a special token, else from `pieces`, else "<id>"."""
        if token in self.specials:
            return b""
        return self.pieces.get(token, f"<{token}>".encode())

    def special_bytes(self, token: int) -> bytes:
        """The token's piece with a special token's markup."""
        return self.specials.get(token) or self.token_bytes(token)

    def is_eog(self, token: int) -> bool:
        """Only eos_token ends generation."""
        return token == self.eos_token

    # -- assertions helpers -------------------------------------------------------------------

    def batches_of(self, request_id: int) -> list[int]:
        """Indexes of the accepted batches that carried this request."""
        return [i for i, b in enumerate(self.batches) if any(e.request_id == request_id for e in b)]


BYTE_BASE = 100  # a FakeTextModel's token for byte b is BYTE_BASE + b


class FakeTextModel(FakeModel):
    """A FakeModel with a byte vocabulary and a chat template, so the runner's routes can load and drive it.

    Text tokenizes to one token per UTF-8 byte (BOS first with add_special). The answer to a prompt
    whose text contains a key of `replies` is that reply's bytes, then EOS; other prompts get
    default_next_token's tokens, which read as "<n>".
    """

    def __init__(self, replies: dict[str, str] | None = None, template: str | None = None, **kwargs):
        kwargs.setdefault("eos_token", 2)
        super().__init__(**kwargs)
        self.bos_token = 1
        self.n_vocab = max([BYTE_BASE + 256, *(t + 1 for t in self.specials)])
        self.add_bos = True
        self.architecture = "fake"
        self.eog_tokens = (self.eos_token,)
        self.replies = dict(replies or {})
        self._template = template
        self._reply_of: dict[tuple[int, ...], list[int] | None] = {}

    def chat_template(self) -> str | None:
        """The GGUF's template (None: the runner falls back to ChatML)."""
        return self._template

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """One token per byte (a special token's text as its id with parse_special), BOS first when add_special."""
        return ([self.bos_token] if add_special else []) + self._byte_tokens(text, parse_special)

    def _byte_tokens(self, text: str, parse_special: bool) -> list[int]:
        out: list[int] = []
        if not (parse_special and self.specials):
            return [BYTE_BASE + b for b in text.encode()]
        marks = sorted(((v.decode(), k) for k, v in self.specials.items()), key=lambda m: -len(m[0]))
        i = 0
        while i < len(text):
            hit = next(((mark, t) for mark, t in marks if text.startswith(mark, i)), None)
            if hit is not None:
                out.append(hit[1])
                i += len(hit[0])
            else:
                out.extend(BYTE_BASE + b for b in text[i].encode())
                i += 1
        return out

    def token_bytes(self, token: int) -> bytes:
        """A byte token's byte, a special token's text; else as FakeModel."""
        if BYTE_BASE <= token < BYTE_BASE + 256:
            return bytes([token - BYTE_BASE])
        return {self.bos_token: b"<s>", self.eos_token: b"</s>"}.get(token) or super().token_bytes(token)

    def token_text(self, token: int) -> str:
        """A token's text."""
        return self.token_bytes(token).decode("utf-8", "replace")

    def next_token(self, prompt: tuple[int, ...], history: tuple[int, ...]) -> int:
        """The reply chosen by the prompt's text, else FakeModel's own."""
        if prompt not in self._reply_of:
            text = b"".join(self.special_bytes(t) for t in prompt).decode("utf-8", "replace")
            reply = next((r for key, r in self.replies.items() if key in text), None)
            self._reply_of[prompt] = None if reply is None else self._byte_tokens(reply, True)
        reply = self._reply_of[prompt]
        if reply is None:
            return super().next_token(prompt, history)
        pos = len(history) - len(prompt)
        forced = self._forced_now
        if forced:
            # A forced special token (the end of a thought) moves the reply on to just after it, as a model
            # told its thought is over goes on with its answer; other forced tokens (a message) move nothing.
            pos = 0
            for i, t in enumerate(history[len(prompt):]):
                if i not in forced:
                    pos += 1
                elif t in self.specials and t in reply[pos:]:
                    pos = reply.index(t, pos) + 1
        return reply[pos] if pos < len(reply) else self.eos_token

    def fim_tokens(self) -> dict[str, int]:
        """No fill-in-the-middle tokens."""
        return {}

    def describe(self) -> dict:
        """What /props shows of the model."""
        return {"n_ctx": self.n_ctx, "n_vocab": self.n_vocab, "architecture": self.architecture}

    def kv_cache_bytes(self) -> int:
        """No real cache."""
        return 0
