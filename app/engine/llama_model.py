"""The only module that calls llama.cpp: model, one context with a unified KV cache, batch, samplers."""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import functools
import logging
import re
import threading
import time
from pathlib import Path

import llama_cpp
import numpy as np

from app.engine.backends import BufferLog, flash_attn_for, list_devices
from app.engine.engine import DECODE_NO_KV_SLOT, DECODE_OK
from app.engine.grammar import Grammar
from app.engine.kv_types import KV_TYPE_BYTES, kv_type_problem
from app.engine.model_config import ModelConfig
from app.engine.request import SamplingParams
from app.engine.scheduler import Chunk
from app.llama_tools import load_backends

log = logging.getLogger(__name__)

# A rejected token is resampled among the model's most likely tokens first: llama.cpp's grammar
# check over Gemma's whole 262k vocabulary takes ~115 ms here, over 256 candidates a fraction of a ms.
GRAMMAR_CANDIDATES = 256
MAX_CACHED_GRAMMARS = 64
# Parsed grammars kept, by the elements llama.cpp built for them (Grammar.elements, check_gbnf's
# count): an element is 8 bytes and a rule's vector some 60 more, so at most ~80 MB, and 64
# grammars of a million elements each could not be kept at once.
MAX_CACHED_GRAMMAR_ELEMENTS = 2 << 20
# How far into the output an anchored trigger (the generic envelope's opening brace) may appear.
ANCHORED_TRIGGER_CHARS = 64

MAX_LOGIT_VIEWS = 4096  # logits row views kept (one per row address a decode has used)
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)], align=True)

_backend_lock = threading.Lock()
_backend_ready = False
_log_callback = None  # kept referenced: llama.cpp holds the raw pointer
# The buffers llama.cpp reports allocating in this process (the device part of a load: lavapipe's driver does not
# report its use, so a device's memory in use is counted from these).
buffer_log = BufferLog()


def _llama_log(level: int, text: bytes, _user) -> None:
    # ggml levels: 1 debug, 2 info, 3 warn, 4 error, 5 continuation. Warnings and errors are logged; info lines
    # are only read for the buffer sizes.
    if level == 2:
        buffer_log.feed(text.decode("utf-8", "replace"))
    if level in (3, 4):
        msg = text.decode("utf-8", "replace").rstrip()
        if msg:
            log.warning("llama.cpp: %s", msg)


class _BuftOverride(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


@functools.cache
def _ggml() -> ctypes.CDLL:
    """libggml, the backend registry that llama-cpp-python's libllama links: opened by its soname, so the copy
    libllama loaded (from LLAMA_CPP_LIB_PATH: the Vulkan build's, with its devices) is found again, not the wheel's
    CPU-only one beside llama_cpp (where --device Vulkan0 and -ot ...=Vulkan0 found no such device)."""
    lib = ctypes.CDLL("libggml.so.0")
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    lib.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_buft_name.restype = ctypes.c_char_p
    return lib


def buffer_types() -> dict[str, int]:
    """Every device's buffer type by name ("CPU", "Vulkan0"), as llama-server's -ot looks them up."""
    lib = _ggml()
    out = {}
    for i in range(lib.ggml_backend_dev_count()):
        buft = lib.ggml_backend_dev_buffer_type(lib.ggml_backend_dev_get(i))
        if buft:
            out[lib.ggml_backend_buft_name(buft).decode()] = buft
    return out


def _device_list(names: tuple[str, ...]):
    """The NULL-terminated ggml_backend_dev_t array of the named devices (--device), or None for all of them."""
    if not names:
        return None
    lib = _ggml()
    lib.ggml_backend_dev_by_name.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_dev_by_name.restype = ctypes.c_void_p
    if names == ("none",):
        return (ctypes.c_void_p * 1)()  # llama-server's --device none: no device offloads
    arr = (ctypes.c_void_p * (len(names) + 1))()
    for i, name in enumerate(names):
        dev = lib.ggml_backend_dev_by_name(name.encode())
        if not dev:
            raise ValueError(f"--device {name}: no such device in this llama.cpp (its names: {', '.join(sorted(buffer_types()))})")
        arr[i] = dev
    return arr


def _buft_overrides(rules: tuple[tuple[str, str], ...]):
    """The NULL-terminated llama_model_tensor_buft_override array of the rules, or None without any."""
    if not rules:
        return None
    bufts = buffer_types()
    unknown = sorted({t for _, t in rules if t not in bufts})
    if unknown:
        raise ValueError(f"-ot: unknown buffer type {', '.join(unknown)}; this llama.cpp has {', '.join(sorted(bufts))}")
    arr = (_BuftOverride * (len(rules) + 1))()
    for i, (pattern, target) in enumerate(rules):
        arr[i].pattern = pattern.encode()
        arr[i].buft = bufts[target]
    return arr


def _ggml_type(kv_type: str) -> int:
    """ggml's enum value of a KV cache type name (app.engine.kv_types.KV_TYPES)."""
    return getattr(llama_cpp, f"GGML_TYPE_{kv_type.upper()}")


def _init_backend(verbose: bool) -> None:
    global _backend_ready, _log_callback
    with _backend_lock:
        if _backend_ready:
            return
        if not verbose:
            _log_callback = llama_cpp.llama_log_callback(_llama_log)
            llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
        load_backends()
        _backend_ready = True


class BatchBuffer:
    """A llama_batch over arrays of our own, filled from the scheduler's chunks.

    numpy fills the arrays in bulk, and nothing here is freed by llama_batch_free. It needs no
    model, so the engine-overhead bench fills the very same batch without llama.cpp decoding it.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._tok = np.zeros(capacity, dtype=np.int32)
        self._pos = np.zeros(capacity, dtype=np.int32)
        self._nseq = np.ones(capacity, dtype=np.int32)
        self._seq = np.zeros(capacity, dtype=np.int32)
        self._logits = np.zeros(capacity, dtype=np.int8)
        seq_base = self._seq.ctypes.data
        self._seq_ptrs = (ctypes.POINTER(ctypes.c_int32) * capacity)(
            *[ctypes.cast(seq_base + 4 * i, ctypes.POINTER(ctypes.c_int32)) for i in range(capacity)]
        )
        self.batch = llama_cpp.llama_batch()
        self.batch.token = self._tok.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token))
        self.batch.embd = None
        self.batch.pos = self._pos.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_pos))
        self.batch.n_seq_id = self._nseq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.batch.seq_id = self._seq_ptrs
        self.batch.logits = self._logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))

    def fill(self, chunks: list[Chunk]):
        """Write the chunks into the batch; returns (the llama_batch, batch index of each chunk's logits, -1: none)."""
        # Plain lists first and one numpy write per array: a decode step is one token per
        # sequence, and five numpy slice writes per chunk cost more than the lists.
        toks: list[int] = []
        pos: list[int] = []
        seqs: list[int] = []
        logit_idx: list[int] = []
        n = 0
        drafts: list[tuple[int, int]] = []  # (first logit row, rows) of chunks with draft tokens
        for c in chunks:
            tokens = c.tokens
            k = len(tokens)
            slot = c.request.slot
            if k == 1:
                toks.append(tokens[0])
                pos.append(c.start_pos)
                seqs.append(slot)
            else:
                toks.extend(tokens)
                pos.extend(range(c.start_pos, c.start_pos + k))
                seqs.extend([slot] * k)
            n += k
            if c.num_draft:
                # Every draft token is verified: logits for the last sampled token and each draft token.
                first = n - 1 - c.num_draft
                drafts.append((first, c.num_draft + 1))
                logit_idx.append(first)
            else:
                logit_idx.append(n - 1 if c.want_logits else -1)
        if n > self.capacity:
            raise ValueError(f"batch of {n} tokens exceeds n_batch {self.capacity}")
        self._tok[:n] = toks
        self._pos[:n] = pos
        self._seq[:n] = seqs
        flags = self._logits
        flags[:n] = 0
        wanted = [i for i in logit_idx if i >= 0]
        if wanted:
            flags[wanted] = 1
        for first, rows in drafts:
            flags[first : first + rows] = 1
        self.batch.n_tokens = n
        return self.batch, logit_idx


class LlamaModel:
    """A GGUF model with one llama_context whose KV cache all sequences share."""

    def __init__(self, config: ModelConfig):
        if not Path(config.path).is_file():
            raise FileNotFoundError(f"model file not found: {config.path}")
        _init_backend(config.verbose)
        # Devices are read only when layers are offloaded: a CPU-only load initialises no other backend's driver.
        self.devices = list_devices() if config.n_gpu_layers > 0 else []
        flash_attn, why = flash_attn_for(self.devices, config.n_gpu_layers, config.flash_attn)
        if why:
            log.warning("%s", why)
            config = dataclasses.replace(config, flash_attn=flash_attn)
        buffer_log.clear()
        self.config = config
        mparams = self._model_params(config)
        # The load's phases (the Models page's cold-start split): reading the weights, then with GPU layers
        # the tensors' copy into device buffers, which llama.cpp reports through the progress callback
        # (its first call ends the metadata and mapping, the last one the tensors' upload).
        t0 = time.perf_counter()
        progress_at: list[float] = []

        def progress(_fraction: float, _user) -> bool:
            if not progress_at:
                progress_at.append(time.perf_counter())
            return True

        on_progress = llama_cpp.llama_progress_callback(progress)
        if config.n_gpu_layers > 0:
            mparams.progress_callback = on_progress
        self._model = llama_cpp.llama_model_load_from_file(config.path.encode(), mparams)
        t_read = time.perf_counter()
        if not self._model:
            raise ValueError(f"llama.cpp could not load {config.path} (not a GGUF model it supports?)")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)

        cparams = self._context_params(config)
        t_ctx = time.perf_counter()
        self._ctx = llama_cpp.llama_init_from_model(self._model, cparams)
        t_done = time.perf_counter()
        first = progress_at[0] if progress_at else t_read
        # upload_ms is None without GPU layers: there is no upload, and no part of the read is one.
        self.load_timings = {
            "read_ms": ((first if config.n_gpu_layers > 0 else t_read) - t0) * 1000,
            "upload_ms": (t_read - first) * 1000 if config.n_gpu_layers > 0 else None,
            "context_ms": (t_done - t_ctx) * 1000,
        }
        if not self._ctx:
            llama_cpp.llama_model_free(self._model)
            raise ValueError(
                f"llama.cpp could not create a context of {config.n_ctx} tokens × {config.n_seq_max} sequences "
                "(out of memory?)"
            )
        # What this load allocated, per buffer type (a runner holds one model; a draft model loads after it).
        self.buffers = buffer_log.by_buffer()
        self.offloaded_layers = buffer_log.offloaded
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self.n_ctx = llama_cpp.llama_n_ctx(self._ctx)
        self.n_batch = llama_cpp.llama_n_batch(self._ctx)
        self.n_seq_max = config.n_seq_max  # the slots (the context may hold a transfer sequence beyond them)
        self.n_swa = int(llama_cpp.llama_model_n_swa(self._model))
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))
        self._eog_tokens = [t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self._vocab, t)]
        self._batch = BatchBuffer(self.n_batch)
        self._piece_buf = ctypes.create_string_buffer(256)
        self._pieces: dict[int, bytes] = {}  # token (~token: rendered special) → its bytes
        self._eog_set = frozenset(self._eog_tokens)
        self._logit_views: dict[int, np.ndarray] = {}  # row address → a numpy view of it (logits())
        # Parsed grammars, cloned per sequence: parsing is paid once per distinct grammar.
        self._grammars: collections.OrderedDict[tuple[str, str], tuple[object, int]] = collections.OrderedDict()
        self._grammar_lock = threading.Lock()
        # Candidate buffers for constrained sampling; only the engine thread samples.
        self._cand = np.zeros(self.n_vocab, dtype=_TOKEN_DATA)
        self._cand_ids = np.arange(self.n_vocab, dtype=np.int32)
        self._cand_arr = llama_cpp.llama_token_data_array(
            data=self._cand.ctypes.data_as(llama_cpp.llama_token_data_p), size=0, selected=-1, sorted=False)
        self._one = np.zeros(1, dtype=_TOKEN_DATA)
        self._one_arr = llama_cpp.llama_token_data_array(
            data=self._one.ctypes.data_as(llama_cpp.llama_token_data_p), size=1, selected=-1, sorted=False)

    def _model_params(self, config: ModelConfig):
        """llama.cpp's model parameters: GPU layers, repacking, tensor overrides, devices and their split."""
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = config.n_gpu_layers
        mparams.use_extra_bufts = config.repack_enabled
        # Kept referenced while the model loads: llama.cpp reads the patterns through these pointers.
        self._overrides = _buft_overrides(config.tensor_overrides)
        if self._overrides is not None:
            mparams.tensor_buft_overrides = ctypes.cast(self._overrides, ctypes.c_void_p)
        self._devices = _device_list(config.devices)
        if self._devices is not None:
            mparams.devices = ctypes.cast(self._devices, ctypes.c_void_p)
        mparams.split_mode = {"none": llama_cpp.LLAMA_SPLIT_MODE_NONE, "layer": llama_cpp.LLAMA_SPLIT_MODE_LAYER,
                              "row": llama_cpp.LLAMA_SPLIT_MODE_ROW}[config.split_mode]
        mparams.main_gpu = config.main_gpu
        if config.tensor_split:
            self._split = (ctypes.c_float * max(llama_cpp.llama_max_devices(), len(config.tensor_split)))(
                *config.tensor_split)
            mparams.tensor_split = self._split
        return mparams

    def _context_params(self, config: ModelConfig):
        """llama.cpp's context parameters: cells, batches, flash attention, KV types, sequences and outputs, threads."""
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = config.n_ctx
        cparams.n_batch = config.n_batch
        # Same micro-batch as llama.cpp's tools default (512), so the reference is comparable.
        cparams.n_ubatch = config.n_ubatch or min(config.n_batch, 512)
        cparams.flash_attn_type = {"auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                                   "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED}[config.flash_attn]
        problem = kv_type_problem(config.type_k, config.type_v, config.flash_attn)
        if problem:
            raise ValueError(problem)
        cparams.type_k = _ggml_type(config.type_k)
        cparams.type_v = _ggml_type(config.type_v)
        # With KV tiers the context takes one more sequence id after the slots and their twins (the prefix
        # cache's guard), the transfer sequence: llama.cpp saves and restores states only below n_seq_max.
        self.transfer_seq: int | None = 2 * config.n_seq_max if config.kv_transfer else None
        cparams.n_seq_max = config.n_seq_max if self.transfer_seq is None else self.transfer_seq + 1
        # The engine asks for at most one row of logits per sequence per batch; without this the
        # compute buffer is reserved for n_batch rows × the vocabulary (512 MiB for Gemma's 262k).
        # Speculative decoding verifies up to n_outputs_extra draft tokens per iteration beyond those.
        # llama.cpp reserves a row per sequence id at least (output_reserve asserts it): the transfer one's too.
        cparams.n_outputs_max = max(config.n_seq_max + config.n_outputs_extra, cparams.n_seq_max)
        cparams.kv_unified = True
        # Sliding-window layers get as many cells as the others (llama.cpp's default here, said
        # explicitly): the prefix cache keeps positions that slid out of a sequence's window.
        cparams.swa_full = True
        cparams.n_threads = config.n_threads
        cparams.n_threads_batch = config.n_threads
        cparams.no_perf = True
        return cparams

    # -- metadata ------------------------------------------------------------------------

    def chat_template(self) -> str | None:
        """The chat template stored in the GGUF, if any."""
        raw = llama_cpp.llama_model_chat_template(self._model, None)
        return raw.decode("utf-8") if raw else None

    def token_text(self, token: int) -> str:
        """The text of a token including special tokens (for BOS/EOS strings of chat templates)."""
        return self._piece(token, special=True).decode("utf-8", "replace")

    @property
    def llama_model(self):
        """The loaded llama_model, for another context on the same weights (app.engine.embeddings)."""
        return self._model

    @property
    def llama_context(self):
        """The llama_context, for a projector's image decode into the same KV cache (app.engine.mtmd_model)."""
        return self._ctx

    @property
    def bos_token(self) -> int:
        """Beginning-of-sequence token id."""
        return llama_cpp.llama_vocab_bos(self._vocab)

    @property
    def eos_token(self) -> int:
        """End-of-sequence token id."""
        return llama_cpp.llama_vocab_eos(self._vocab)

    def fim_tokens(self) -> dict[str, int]:
        """The vocabulary's fill-in-the-middle tokens that exist: pre, suf, mid, and rep/sep/pad when present."""
        found = {
            "pre": llama_cpp.llama_vocab_fim_pre(self._vocab),
            "suf": llama_cpp.llama_vocab_fim_suf(self._vocab),
            "mid": llama_cpp.llama_vocab_fim_mid(self._vocab),
            "pad": llama_cpp.llama_vocab_fim_pad(self._vocab),
            "rep": llama_cpp.llama_vocab_fim_rep(self._vocab),
            "sep": llama_cpp.llama_vocab_fim_sep(self._vocab),
        }
        return {k: v for k, v in found.items() if v >= 0}

    def describe(self) -> dict:
        """Model facts for /props and the benchmark header."""
        buf = ctypes.create_string_buffer(256)
        llama_cpp.llama_model_desc(self._model, buf, 256)
        return {
            "path": self.config.path,
            "desc": buf.value.decode("utf-8", "replace"),
            "n_params": llama_cpp.llama_model_n_params(self._model),
            "size_bytes": llama_cpp.llama_model_size(self._model),
            "n_ctx_train": llama_cpp.llama_model_n_ctx_train(self._model),
            "n_vocab": self.n_vocab,
            "n_ctx": self.n_ctx,
            "n_batch": self.n_batch,
            "n_seq_max": self.n_seq_max,
            "n_threads": self.config.n_threads,
            "n_gpu_layers": self.config.n_gpu_layers,
            "repack": self.config.repack_enabled,
            "flash_attn": self.config.flash_attn,
            "devices": [dataclasses.asdict(d) for d in self.devices],
            "buffers": self.buffers,
            "offloaded_layers": list(self.offloaded_layers) if self.offloaded_layers else None,
            "cache_type_k": self.config.type_k,
            "cache_type_v": self.config.type_v,
            "tensor_overrides": [f"{p}={t}" for p, t in self.config.tensor_overrides],
            "use_devices": list(self.config.devices), "tensor_split": list(self.config.tensor_split),
            "split_mode": self.config.split_mode, "main_gpu": self.config.main_gpu,
        }

    def vocab_facts(self) -> dict:
        """What llama.cpp's draft/target compatibility check compares besides token texts (draft_model.vocab_mismatch)."""
        v = self._vocab
        return {"type": int(llama_cpp.llama_vocab_type(v)), "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(v)),
                "bos": llama_cpp.llama_vocab_bos(v), "add_eos": bool(llama_cpp.llama_vocab_get_add_eos(v)),
                "eos": llama_cpp.llama_vocab_eos(v), "n_vocab": self.n_vocab}

    def vocab_texts(self, start: int, end: int) -> list[bytes]:
        """The vocabulary's raw token texts of ids [start, end) (llama_vocab_get_text)."""
        get, v = llama_cpp.llama_vocab_get_text, self._vocab
        return [get(v, i) or b"" for i in range(start, end)]

    def _meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, 256)
        return buf.value.decode() if n >= 0 else None

    @property
    def architecture(self) -> str | None:
        """general.architecture of the GGUF (e.g. "gemma3")."""
        return self._meta("general.architecture")

    def kv_cache_bytes(self) -> int:
        """Bytes of the KV cache for n_ctx cells over every layer (sliding-window layers at full size), in its types."""
        arch = self._meta("general.architecture") or ""
        n_layer = int(self._meta(f"{arch}.block_count") or 0)
        n_head_kv = int(self._meta(f"{arch}.attention.head_count_kv") or 0)
        n_head = int(self._meta(f"{arch}.attention.head_count") or 1)
        n_embd = int(self._meta(f"{arch}.embedding_length") or 0)
        k_len = int(self._meta(f"{arch}.attention.key_length") or n_embd // n_head)
        v_len = int(self._meta(f"{arch}.attention.value_length") or n_embd // n_head)
        per_cell = n_head_kv * (k_len * KV_TYPE_BYTES[self.config.type_k] + v_len * KV_TYPE_BYTES[self.config.type_v])
        return round(n_layer * self.n_ctx * per_cell)

    # -- text ------------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Text to token ids, with BOS when the model wants it and add_special is true."""
        raw = text.encode("utf-8")
        cap = len(raw) + 8
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self._vocab, raw, len(raw), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self._vocab, raw, len(raw), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def _piece(self, token: int, special: bool) -> bytes:
        # A token's bytes never change: each is asked of llama.cpp once (a vocabulary's worth at most).
        key = token if not special else ~token
        piece = self._pieces.get(key)
        if piece is None:
            piece = self._pieces[key] = self._piece_of(token, special)
        return piece

    def _piece_of(self, token: int, special: bool) -> bytes:
        n = llama_cpp.llama_token_to_piece(self._vocab, token, self._piece_buf, len(self._piece_buf), 0, special)
        if n < 0:
            self._piece_buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, self._piece_buf, -n, 0, special)
        return self._piece_buf.raw[:n]

    @property
    def eog_tokens(self) -> tuple[int, ...]:
        """The end-of-generation tokens (EOS, end of turn, …)."""
        return tuple(self._eog_tokens)

    def token_bytes(self, token: int) -> bytes:
        """The raw bytes a generated token stands for (may be part of a UTF-8 character)."""
        return self._piece(token, special=False)

    def special_bytes(self, token: int) -> bytes:
        """A token's bytes with a special token's markup rendered (llama-server's preserved_tokens: "<think>")."""
        return self._piece(token, special=True)

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, end of turn)."""
        return token in self._eog_set

    # -- batch and decode ------------------------------------------------------------------

    def decode(self, chunks: list[Chunk]) -> tuple[int, list[int]]:
        """Run one llama_decode over the chunks; returns (return code, batch index of each chunk's logits)."""
        batch, logit_idx = self._batch.fill(chunks)
        rc = llama_cpp.llama_decode(self._ctx, batch)
        if rc not in (DECODE_OK, DECODE_NO_KV_SLOT):
            raise RuntimeError(f"llama_decode failed with code {rc}")
        return rc, logit_idx

    def clear_seq(self, slot: int) -> None:
        """Free every KV cell of one sequence."""
        llama_cpp.llama_memory_seq_rm(self._memory, slot, -1, -1)

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Give sequence dst the cells of src at positions [p0, p1) (unified cache: metadata only)."""
        llama_cpp.llama_memory_seq_cp(self._memory, src, dst, p0, p1)

    def seq_rm(self, seq: int, p0: int, p1: int) -> None:
        """Take positions [p0, p1) out of a sequence (-1: open end); cells nobody holds are freed."""
        if not llama_cpp.llama_memory_seq_rm(self._memory, seq, p0, p1):
            raise RuntimeError(f"llama.cpp refused to remove positions [{p0}, {p1}) of sequence {seq}")

    def seq_pos_min(self, seq: int) -> int:
        """Smallest position a sequence holds in the KV cache (-1: none); SWA layers' view on Gemma 3."""
        return llama_cpp.llama_memory_seq_pos_min(self._memory, seq)

    def kv_settings(self) -> dict:
        """What decides the bytes of a saved KV state besides the model file: the disk tier's key."""
        c = self.config
        return {"n_ctx": self.n_ctx, "n_swa": self.n_swa, "type_k": c.type_k, "type_v": c.type_v, "kv_unified": True,
                "swa_full": True, "flash_attn": c.flash_attn, "n_gpu_layers": c.n_gpu_layers,
                "n_ubatch": c.n_ubatch or min(c.n_batch, 512), "llama_cpp": llama_cpp.__version__}

    def state_save(self, seq: int) -> bytearray:
        """A copy of one sequence's KV cells (llama_state_seq_get_data), for a tier."""
        size = llama_cpp.llama_state_seq_get_size(self._ctx, seq)
        data = bytearray(size)
        n = llama_cpp.llama_state_seq_get_data(self._ctx, (ctypes.c_uint8 * size).from_buffer(data), size, seq)
        if n != size:
            raise RuntimeError(f"llama.cpp wrote {n} of {size} bytes of sequence {seq}'s state")
        return data

    def state_load(self, seq: int, data: bytearray) -> bool:
        """Put saved cells back under a sequence (replacing what it held); False when llama.cpp refuses them."""
        size = len(data)
        buf = (ctypes.c_uint8 * size).from_buffer(data)
        return llama_cpp.llama_state_seq_set_data(self._ctx, buf, size, seq) == size

    def seq_pos_range(self, seq: int) -> tuple[int, int]:
        """The smallest and largest position a sequence holds (-1, -1: none); the sliding-window layers' view."""
        return (llama_cpp.llama_memory_seq_pos_min(self._memory, seq),
                llama_cpp.llama_memory_seq_pos_max(self._memory, seq))

    def kv_share_blocker(self) -> str | None:
        """Why sequences of this model cannot share KV cells by position (None: they can)."""
        if llama_cpp.llama_model_is_recurrent(self._model) or llama_cpp.llama_model_is_hybrid(self._model):
            return "the model keeps a recurrent state, which cannot be shared or cut by position"
        return None

    # -- sampling --------------------------------------------------------------------------

    def make_sampler(self, params: SamplingParams, prompt_tokens: list[int]):
        """A llama.cpp sampler chain for these settings (None: plain greedy), grammar-constrained if asked."""
        chain = self._make_chain(params, prompt_tokens)
        if params.grammar is None:
            return chain
        try:
            return ConstrainedSampler(self, chain, params)
        except Exception:
            self.free_sampler(chain)
            raise

    def _make_chain(self, params: SamplingParams, prompt_tokens: list[int]):
        if params.greedy and not params.penalised and not params.logit_bias:
            return None
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        add = lambda s: llama_cpp.llama_sampler_chain_add(chain, s)  # noqa: E731
        if params.logit_bias:
            biases = (llama_cpp.llama_logit_bias * len(params.logit_bias))(
                *[llama_cpp.llama_logit_bias(t, b) for t, b in params.logit_bias]
            )
            add(llama_cpp.llama_sampler_init_logit_bias(self.n_vocab, len(params.logit_bias), biases))
        if params.ignore_eos and self._eog_tokens:
            biases = (llama_cpp.llama_logit_bias * len(self._eog_tokens))(
                *[llama_cpp.llama_logit_bias(t, float("-inf")) for t in self._eog_tokens]
            )
            add(llama_cpp.llama_sampler_init_logit_bias(self.n_vocab, len(self._eog_tokens), biases))
        if params.penalised:
            add(
                llama_cpp.llama_sampler_init_penalties(
                    self.n_vocab,
                    params.repeat_last_n,
                    params.repeat_penalty,
                    params.frequency_penalty,
                    params.presence_penalty,
                )
            )
        if params.greedy:
            add(llama_cpp.llama_sampler_init_greedy())
        else:
            if params.top_k > 0:
                add(llama_cpp.llama_sampler_init_top_k(params.top_k))
            add(llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
            add(llama_cpp.llama_sampler_init_min_p(params.min_p, 1))
            add(llama_cpp.llama_sampler_init_temp(params.temperature))
            seed = llama_cpp.LLAMA_DEFAULT_SEED if params.seed is None else params.seed & 0xFFFFFFFF
            add(llama_cpp.llama_sampler_init_dist(seed))
        if params.penalised and params.repeat_last_n != 0:
            # Penalties look back over the prompt too, as llama-server does.
            tail = prompt_tokens if params.repeat_last_n < 0 else prompt_tokens[-params.repeat_last_n :]
            for t in tail:
                if t >= 0:  # an image's placeholder positions are no tokens (app.engine.media)
                    llama_cpp.llama_sampler_accept(chain, t)
        return chain

    def sample(self, sampler, params: SamplingParams, batch_index: int) -> int:
        """Choose the next token from the logits at batch_index."""
        if isinstance(sampler, ConstrainedSampler):
            return sampler.sample(batch_index)
        if sampler is not None:
            return llama_cpp.llama_sampler_sample(sampler, self._ctx, batch_index)
        logits = self.logits(batch_index)
        if params.ignore_eos and self._eog_tokens:
            logits[self._eog_tokens] = -np.inf
        return int(logits.argmax())

    def force(self, sampler, params: SamplingParams, token: int) -> bool:
        """Take `token` as the next one without sampling (a forced end of thought): the sampler accepts it.

        False, with nothing changed, when the request's grammar does not admit the token here."""
        if isinstance(sampler, ConstrainedSampler):
            return sampler.force(token)
        if sampler is not None:
            llama_cpp.llama_sampler_accept(sampler, token)
        return True

    def free_sampler(self, sampler) -> None:
        """Release a sampler chain made by make_sampler."""
        if isinstance(sampler, ConstrainedSampler):
            sampler.free()
        elif sampler is not None:
            llama_cpp.llama_sampler_free(sampler)

    def logits(self, batch_index: int) -> np.ndarray:
        """The logits row at batch_index of the last decode (a view; valid until the next decode)."""
        ptr = llama_cpp.llama_get_logits_ith(self._ctx, batch_index)
        address = ctypes.cast(ptr, ctypes.c_void_p).value
        # Viewing a pointer as an array costs more than the greedy pick on a small vocabulary: one view per row
        # address, reused (only ever read at the address llama.cpp just gave, so a moved buffer is never read).
        view = self._logit_views.get(address)
        if view is None:
            if len(self._logit_views) >= MAX_LOGIT_VIEWS:
                self._logit_views.clear()
            view = self._logit_views[address] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        return view

    def top_token(self, batch_index: int, with_p: bool = False, top_k: int = 10) -> tuple[int, float]:
        """The most likely token at batch_index and, with_p, its probability among the top_k most likely (a draft
        model's greedy step, as llama-server's top-k draft sampler; without with_p the probability is 1)."""
        logits = self.logits(batch_index)
        best = int(logits.argmax())
        if not with_p:
            return best, 1.0
        top = np.partition(logits, -top_k)[-top_k:].astype(np.float64)
        return best, float(1.0 / np.exp(top - logits[best]).sum())

    def logprob(self, batch_index: int, token: int, top_n: int) -> dict:
        """OpenAI's logprob entry of token: its log-probability and the top_n most likely tokens'."""
        logits = self.logits(batch_index).astype(np.float64)
        finite = np.isfinite(logits)
        peak = logits[finite].max()
        lse = peak + np.log(np.exp(logits[finite] - peak).sum())

        def entry(t: int) -> dict:
            raw = self.token_bytes(t)
            lp = float(logits[t] - lse) if np.isfinite(logits[t]) else -9999.0
            return {"id": t, "token": raw.decode("utf-8", "replace"), "logprob": lp, "bytes": list(raw)}

        out = entry(token)
        top = []
        if top_n > 0:
            best = np.argpartition(-logits, top_n)[:top_n]
            top = [entry(int(t)) for t in best[np.argsort(-logits[best])]]
        out["top_logprobs"] = top
        return out

    # -- grammars ----------------------------------------------------------------------------

    def grammar_sampler(self, grammar: Grammar):
        """A fresh llama.cpp grammar sampler (cloned from a parsed one cached per grammar text)."""
        key = (grammar.gbnf, grammar.root)
        with self._grammar_lock:
            hit = self._grammars.get(key)
            if hit is None:
                proto = llama_cpp.llama_sampler_init_grammar(self._vocab, grammar.gbnf.encode(), grammar.root.encode())
                if not proto:
                    raise ValueError("llama.cpp could not parse the grammar")
                # A grammar made without measuring it (a test's own) counts as its length.
                size = grammar.elements or len(grammar.gbnf)
                self._grammars[key] = (proto, size)
                while len(self._grammars) > 1 and (len(self._grammars) > MAX_CACHED_GRAMMARS or sum(
                        n for _, n in self._grammars.values()) > MAX_CACHED_GRAMMAR_ELEMENTS):
                    old, _ = self._grammars.popitem(last=False)[1]
                    llama_cpp.llama_sampler_free(old)
            else:
                proto = hit[0]
                self._grammars.move_to_end(key)
            return llama_cpp.llama_sampler_clone(proto)

    def close(self) -> None:
        """Free the context and the model."""
        for proto, _ in self._grammars.values():
            llama_cpp.llama_sampler_free(proto)
        self._grammars.clear()
        if self._ctx:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            llama_cpp.llama_model_free(self._model)
            self._model = None


@functools.lru_cache(maxsize=64)
def _pattern(source: str) -> re.Pattern[bytes]:
    return re.compile(source.encode())


class ConstrainedSampler:
    """A sequence's sampler chain plus its grammar: only tokens the grammar admits are sampled.

    The chain picks a token as usual and the grammar only checks that one (cheap); a rejected
    token is resampled with the grammar applied to the model's GRAMMAR_CANDIDATES most likely
    tokens, then to the end-of-generation tokens, and to the whole vocabulary only as a last
    resort, so a constrained sequence rarely makes the batch wait.

    Lazy grammars wait in Python for a trigger in the output: llama.cpp's own lazy sampler feeds
    the text after a trigger into the grammar unchecked, and off-grammar text there throws a C++
    exception that aborts the whole runner. Here the text is checked token by token first, and
    an off-grammar token at the trigger is resampled instead.
    """

    def __init__(self, model: LlamaModel, chain, params: SamplingParams):
        self.model = model
        self.chain = chain
        self.params = params
        self.grammar = params.grammar
        self._g = None if self.grammar.lazy else model.grammar_sampler(self.grammar)
        self._text = b""  # output so far, while a lazy grammar awaits its trigger
        self._patterns = [_pattern(p) for p in self.grammar.trigger_patterns]
        self._awaiting = self.grammar.lazy
        self.num_resampled = 0

    def free(self) -> None:
        """Release the chain and the grammar."""
        if self.chain is not None:
            llama_cpp.llama_sampler_free(self.chain)
            self.chain = None
        if self._g is not None:
            llama_cpp.llama_sampler_free(self._g)
            self._g = None

    # -- one token ---------------------------------------------------------------------------

    def sample(self, batch_index: int) -> int:
        """The next token: the chain's choice if the grammar admits it, else a resample under the grammar."""
        m = self.model
        logits = m.logits(batch_index)
        if self.params.ignore_eos and m._eog_tokens:
            logits[m._eog_tokens] = -np.inf
        token = self._choose(logits, constrain=None)
        if self._awaiting:
            token = self._watch_trigger(token, logits)
        elif self._g is not None:
            if not self._admits(self._g, token):
                token = self._resample(logits, self._g)
            if not m.is_eog(token):
                llama_cpp.llama_sampler_accept(self._g, token)
        if self.chain is not None:
            llama_cpp.llama_sampler_accept(self.chain, token)
        return token

    def force(self, token: int) -> bool:
        """Accept a token chosen outside sampling (a forced end of thought); False when the grammar refuses it.

        A lazy grammar still awaiting its trigger only records the token's text: a forced end of thought
        never begins a call."""
        m = self.model
        if self._awaiting:
            self._text += m.token_bytes(token)
        elif self._g is not None:
            if not self._admits(self._g, token):
                return False
            llama_cpp.llama_sampler_accept(self._g, token)
        if self.chain is not None:
            llama_cpp.llama_sampler_accept(self.chain, token)
        return True

    def _choose(self, logits: np.ndarray, constrain, candidates: int | None = None) -> int:
        """The chain's pick (greedy argmax without one), optionally over grammar-admitted candidates."""
        m = self.model
        if constrain is None and self.chain is None:
            return int(logits.argmax())
        cand, arr = m._cand, m._cand_arr
        if candidates is not None:
            # Only the likeliest candidates are written: filling all 262k entries and letting
            # llama.cpp's top-k pick them costs ~5 ms, this ~1 ms.
            top = np.argpartition(logits, -candidates)[-candidates:]
            cand["id"][:candidates] = top
            cand["logit"][:candidates] = logits[top]
            arr.size = candidates
        else:
            cand["id"] = m._cand_ids
            cand["logit"] = logits
            arr.size = m.n_vocab
        arr.selected, arr.sorted = -1, False
        if constrain is not None:
            llama_cpp.llama_sampler_apply(constrain, ctypes.byref(arr))
            # Only admitted tokens go on to the chain, unsorted: its top-k would otherwise trust
            # the order of a list the grammar has punched holes in.
            admitted = cand[: arr.size][np.isfinite(cand["logit"][: arr.size])]
            if not len(admitted):
                return -1
            cand[: len(admitted)] = admitted
            arr.size, arr.sorted = len(admitted), False
        if self.chain is None:
            return int(cand["id"][int(cand["logit"][: arr.size].argmax())])
        llama_cpp.llama_sampler_apply(self.chain, ctypes.byref(arr))
        return int(cand["id"][arr.selected])

    def _admits(self, g, token: int) -> bool:
        one = self.model._one
        one["id"], one["logit"], one["p"] = token, 0.0, 0.0
        self.model._one_arr.size, self.model._one_arr.selected = 1, -1
        llama_cpp.llama_sampler_apply(g, ctypes.byref(self.model._one_arr))
        return bool(np.isfinite(one["logit"][0]))

    def _resample(self, logits: np.ndarray, g) -> int:
        self.num_resampled += 1
        token = self._choose(logits, g, candidates=GRAMMAR_CANDIDATES)
        if token >= 0:
            return token
        # A complete value admits only end of generation.
        eog = next((t for t in self.model._eog_tokens if self._admits(g, t)), None)
        if eog is not None:
            return eog
        token = self._choose(logits, g)
        # Nothing admitted at all (ignore_eos at a complete value): end the sequence.
        return token if token >= 0 else self.model.eos_token

    # -- lazy grammars -----------------------------------------------------------------------

    def _feed(self, g, text: bytes) -> bool:
        """Accept text into g token by token if the grammar admits all of it; False (g unchanged
        only up to the refusal) otherwise."""
        try:
            decoded = text.decode("utf-8")
        except UnicodeDecodeError:
            return False
        for t in self.model.tokenize(decoded, add_special=False, parse_special=True):
            if not self._admits(g, t):
                return False
            llama_cpp.llama_sampler_accept(g, t)
        return True

    def _watch_trigger(self, token: int, logits: np.ndarray) -> int:
        m = self.model
        if token in self.grammar.trigger_tokens:
            self._g = m.grammar_sampler(self.grammar)
            self._awaiting = False
            if not self._admits(self._g, token):
                token = self._resample(logits, self._g)
            if not m.is_eog(token):  # llama.cpp aborts on an end token the grammar did not admit
                llama_cpp.llama_sampler_accept(self._g, token)
            return token
        if m.is_eog(token):
            return token
        before = self._text
        text = before + m.token_bytes(token)
        start = self._trigger_start(text, len(before))
        if start is None:
            self._text = text
            return token
        self._awaiting = False
        g = m.grammar_sampler(self.grammar)
        if self._feed(g, text[start:]):
            self._g = g
            return token
        llama_cpp.llama_sampler_free(g)
        g = m.grammar_sampler(self.grammar)
        if start < len(before) and not self._feed(g, before[start:]):
            # The call began off-grammar in tokens already sent: leave this sequence free.
            llama_cpp.llama_sampler_free(g)
            return token
        self._g = g
        token = self._resample(logits, g)
        if not m.is_eog(token):
            llama_cpp.llama_sampler_accept(g, token)
        return token

    def _trigger_start(self, text: bytes, old_len: int) -> int | None:
        alive = False
        for p in self._patterns:
            if p.pattern.startswith(b"^"):
                if len(text) > ANCHORED_TRIGGER_CHARS:
                    continue
                alive = True
                found = p.search(text)
            else:
                alive = True
                found = p.search(text, max(0, old_len - 32))
            if found:
                return found.start(1) if found.lastindex else found.start()
        if not alive:
            self._awaiting = False
        return None
