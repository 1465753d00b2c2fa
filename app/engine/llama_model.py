"""The only module that calls llama.cpp: model, one context with a unified KV cache, batch, samplers."""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path

import llama_cpp
import numpy as np

from app.engine.model_config import ModelConfig
from app.engine.request import SamplingParams
from app.engine.scheduler import Chunk

log = logging.getLogger(__name__)

DECODE_OK = 0
DECODE_NO_KV_SLOT = 1

_backend_lock = threading.Lock()
_backend_ready = False
_log_callback = None  # kept referenced: llama.cpp holds the raw pointer


def _llama_log(level: int, text: bytes, _user) -> None:
    # ggml levels: 1 debug, 2 info, 3 warn, 4 error, 5 continuation. Only warnings and errors matter.
    if level in (3, 4):
        msg = text.decode("utf-8", "replace").rstrip()
        if msg:
            log.warning("llama.cpp: %s", msg)


def _init_backend(verbose: bool) -> None:
    global _backend_ready, _log_callback
    with _backend_lock:
        if _backend_ready:
            return
        if not verbose:
            _log_callback = llama_cpp.llama_log_callback(_llama_log)
            llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _backend_ready = True


class LlamaModel:
    """A GGUF model with one llama_context whose KV cache all sequences share."""

    def __init__(self, config: ModelConfig):
        if not Path(config.path).is_file():
            raise FileNotFoundError(f"model file not found: {config.path}")
        _init_backend(config.verbose)
        self.config = config
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = config.n_gpu_layers
        mparams.use_extra_bufts = config.repack_enabled
        self._model = llama_cpp.llama_model_load_from_file(config.path.encode(), mparams)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {config.path} (not a GGUF model it supports?)")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)

        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = config.n_ctx
        cparams.n_batch = config.n_batch
        # Same micro-batch as llama.cpp's tools default (512), so the reference is comparable.
        cparams.n_ubatch = min(config.n_batch, 512)
        cparams.n_seq_max = config.n_seq_max
        # The engine asks for at most one row of logits per sequence per batch; without this the
        # compute buffer is reserved for n_batch rows × the vocabulary (512 MiB for Gemma's 262k).
        cparams.n_outputs_max = config.n_seq_max
        cparams.kv_unified = True
        # Sliding-window layers get as many cells as the others (llama.cpp's default here, said
        # explicitly): the prefix cache keeps positions that slid out of a sequence's window.
        cparams.swa_full = True
        cparams.n_threads = config.n_threads
        cparams.n_threads_batch = config.n_threads
        cparams.no_perf = True
        self._ctx = llama_cpp.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            llama_cpp.llama_model_free(self._model)
            raise ValueError(
                f"llama.cpp could not create a context of {config.n_ctx} tokens × {config.n_seq_max} sequences "
                "(out of memory?)"
            )
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self.n_ctx = llama_cpp.llama_n_ctx(self._ctx)
        self.n_batch = llama_cpp.llama_n_batch(self._ctx)
        self.n_seq_max = llama_cpp.llama_n_seq_max(self._ctx)
        self.n_swa = int(llama_cpp.llama_model_n_swa(self._model))
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))
        self._eog_tokens = [t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self._vocab, t)]
        self._init_batch(self.n_batch)
        self._piece_buf = ctypes.create_string_buffer(256)

    # -- metadata ------------------------------------------------------------------------

    def chat_template(self) -> str | None:
        """The chat template stored in the GGUF, if any."""
        raw = llama_cpp.llama_model_chat_template(self._model, None)
        return raw.decode("utf-8") if raw else None

    def token_text(self, token: int) -> str:
        """The text of a token including special tokens (for BOS/EOS strings of chat templates)."""
        return self._piece(token, special=True).decode("utf-8", "replace")

    @property
    def bos_token(self) -> int:
        """Beginning-of-sequence token id."""
        return llama_cpp.llama_vocab_bos(self._vocab)

    @property
    def eos_token(self) -> int:
        """End-of-sequence token id."""
        return llama_cpp.llama_vocab_eos(self._vocab)

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
        }

    def _meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, 256)
        return buf.value.decode() if n >= 0 else None

    @property
    def architecture(self) -> str | None:
        """general.architecture of the GGUF (e.g. "gemma3")."""
        return self._meta("general.architecture")

    def kv_cache_bytes(self) -> int:
        """Bytes of the f16 KV cache for n_ctx cells over every layer (sliding-window layers at full size)."""
        arch = self._meta("general.architecture") or ""
        n_layer = int(self._meta(f"{arch}.block_count") or 0)
        n_head_kv = int(self._meta(f"{arch}.attention.head_count_kv") or 0)
        n_head = int(self._meta(f"{arch}.attention.head_count") or 1)
        n_embd = int(self._meta(f"{arch}.embedding_length") or 0)
        k_len = int(self._meta(f"{arch}.attention.key_length") or n_embd // n_head)
        v_len = int(self._meta(f"{arch}.attention.value_length") or n_embd // n_head)
        return n_layer * self.n_ctx * n_head_kv * (k_len + v_len) * 2

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
        n = llama_cpp.llama_token_to_piece(self._vocab, token, self._piece_buf, len(self._piece_buf), 0, special)
        if n < 0:
            self._piece_buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, self._piece_buf, -n, 0, special)
        return self._piece_buf.raw[:n]

    def token_bytes(self, token: int) -> bytes:
        """The raw bytes a generated token stands for (may be part of a UTF-8 character)."""
        return self._piece(token, special=False)

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, end of turn)."""
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    # -- batch and decode ------------------------------------------------------------------

    def _init_batch(self, capacity: int) -> None:
        # Our own arrays behind a llama_batch struct: numpy fills them in bulk, and nothing
        # here is freed by llama_batch_free.
        self._tok = np.zeros(capacity, dtype=np.int32)
        self._pos = np.zeros(capacity, dtype=np.int32)
        self._nseq = np.ones(capacity, dtype=np.int32)
        self._seq = np.zeros(capacity, dtype=np.int32)
        self._logits = np.zeros(capacity, dtype=np.int8)
        seq_base = self._seq.ctypes.data
        self._seq_ptrs = (ctypes.POINTER(ctypes.c_int32) * capacity)(
            *[ctypes.cast(seq_base + 4 * i, ctypes.POINTER(ctypes.c_int32)) for i in range(capacity)]
        )
        self._batch = llama_cpp.llama_batch()
        self._batch.token = self._tok.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token))
        self._batch.embd = None
        self._batch.pos = self._pos.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_pos))
        self._batch.n_seq_id = self._nseq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self._batch.seq_id = self._seq_ptrs
        self._batch.logits = self._logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))

    def decode(self, chunks: list[Chunk]) -> tuple[int, list[int]]:
        """Run one llama_decode over the chunks; returns (return code, batch index of each chunk's logits)."""
        n = 0
        logit_idx: list[int] = []
        for c in chunks:
            k = len(c.tokens)
            slot = c.request.slot
            self._tok[n : n + k] = c.tokens
            self._pos[n : n + k] = np.arange(c.start_pos, c.start_pos + k, dtype=np.int32)
            self._seq[n : n + k] = slot
            self._logits[n : n + k] = 0
            if c.want_logits:
                self._logits[n + k - 1] = 1
                logit_idx.append(n + k - 1)
            else:
                logit_idx.append(-1)
            n += k
        if n > self.n_batch:
            raise ValueError(f"batch of {n} tokens exceeds n_batch {self.n_batch}")
        self._batch.n_tokens = n
        rc = llama_cpp.llama_decode(self._ctx, self._batch)
        if rc < 0 or rc > 1:
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

    def kv_share_blocker(self) -> str | None:
        """Why sequences of this model cannot share KV cells by position (None: they can)."""
        if llama_cpp.llama_model_is_recurrent(self._model) or llama_cpp.llama_model_is_hybrid(self._model):
            return "the model keeps a recurrent state, which cannot be shared or cut by position"
        return None

    # -- sampling --------------------------------------------------------------------------

    def make_sampler(self, params: SamplingParams, prompt_tokens: list[int]):
        """A llama.cpp sampler chain for these settings, or None for the plain greedy fast path."""
        if params.greedy and not params.penalised:
            return None
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        add = lambda s: llama_cpp.llama_sampler_chain_add(chain, s)  # noqa: E731
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
                llama_cpp.llama_sampler_accept(chain, t)
        return chain

    def sample(self, sampler, params: SamplingParams, batch_index: int) -> int:
        """Choose the next token from the logits at batch_index."""
        if sampler is not None:
            return llama_cpp.llama_sampler_sample(sampler, self._ctx, batch_index)
        ptr = llama_cpp.llama_get_logits_ith(self._ctx, batch_index)
        logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        if params.ignore_eos and self._eog_tokens:
            logits[self._eog_tokens] = -np.inf
        return int(logits.argmax())

    def free_sampler(self, sampler) -> None:
        """Release a sampler chain made by make_sampler."""
        if sampler is not None:
            llama_cpp.llama_sampler_free(sampler)

    def close(self) -> None:
        """Free the context and the model."""
        if self._ctx:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            llama_cpp.llama_model_free(self._model)
            self._model = None
