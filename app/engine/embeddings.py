"""Embeddings: a second llama.cpp context on the runner's loaded model, with embeddings on.

Sharing the model means no second copy of the weights; the context is made on the first request,
so a runner that never embeds never pays for it. Pooling is the GGUF's own (`<arch>.pooling_type`:
mean, cls or last); a model without one (a generative model such as Gemma) is mean-pooled. Many
inputs go into one llama_decode, one sequence each, as many as fit the context's batch; vectors
are L2-normalised, as OpenAI's and Ollama's are. This module and app.engine.llama_model are the
only ones that call llama.cpp.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import llama_cpp
import numpy as np

POOLING_NAMES = {llama_cpp.LLAMA_POOLING_TYPE_MEAN: "mean", llama_cpp.LLAMA_POOLING_TYPE_CLS: "cls",
                 llama_cpp.LLAMA_POOLING_TYPE_LAST: "last", llama_cpp.LLAMA_POOLING_TYPE_RANK: "rank"}
MAX_SEQUENCES = 64  # inputs per decode (llama.cpp allows 256 sequences; 64 keeps the bookkeeping small)
MAX_BATCH_TOKENS = 512
# With embeddings on llama.cpp outputs every token, and a generative model's head then makes
# n_vocab floats per token (1 MiB each for Gemma's 262k vocabulary): the batch is sized so those
# logits stay within this many bytes.
MAX_LOGITS_BYTES = 256 * 2**20
MIN_BATCH_TOKENS = 64


class InputTooLong(ValueError):
    """An input longer than the embedding context, with truncation off."""


@dataclass(frozen=True)
class Embedded:
    """Vectors of one call, in input order, and the tokens they took."""

    vectors: list[np.ndarray]
    num_tokens: int
    num_decodes: int


class EmbeddingContext:
    """Embeds token lists with the model's pooling; thread-safe (one decode at a time)."""

    def __init__(self, model, n_threads: int, max_batch_tokens: int | None = None):
        self._model = model
        handle = model.llama_model
        n_vocab = model.n_vocab
        fit = max(MIN_BATCH_TOKENS, min(MAX_BATCH_TOKENS, MAX_LOGITS_BYTES // max(1, n_vocab * 4)))
        n_batch = max_batch_tokens or fit
        self._ctx = self._context(handle, n_batch, n_threads, llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED)
        pooling = llama_cpp.llama_pooling_type(self._ctx)
        if pooling == llama_cpp.LLAMA_POOLING_TYPE_NONE:
            # No pooling in the GGUF (a generative model): per-token vectors are of no use to a
            # client that wants one vector per input, so mean-pool them.
            llama_cpp.llama_free(self._ctx)
            self._ctx = self._context(handle, n_batch, n_threads, llama_cpp.LLAMA_POOLING_TYPE_MEAN)
            pooling = llama_cpp.LLAMA_POOLING_TYPE_MEAN
        self.pooling = POOLING_NAMES.get(pooling, str(pooling))
        self.n_batch = llama_cpp.llama_n_batch(self._ctx)
        self.n_embd = llama_cpp.llama_model_n_embd_out(handle)
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._encoder = bool(llama_cpp.llama_model_has_encoder(handle))
        self._lock = threading.Lock()
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, MAX_SEQUENCES)

    @staticmethod
    def _context(handle, n_batch: int, n_threads: int, pooling: int):
        cparams = llama_cpp.llama_context_default_params()
        # One decode holds a whole batch of inputs and nothing stays between calls: the context is the batch.
        cparams.n_ctx = n_batch
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch  # an input must sit in one micro-batch (non-causal models need it whole)
        cparams.n_seq_max = MAX_SEQUENCES
        cparams.kv_unified = True
        cparams.embeddings = True
        cparams.pooling_type = pooling
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads
        cparams.no_perf = True
        ctx = llama_cpp.llama_init_from_model(handle, cparams)
        if not ctx:
            raise ValueError(f"llama.cpp could not create an embedding context of {n_batch} tokens (out of memory?)")
        return ctx

    def embed(self, inputs: list[list[int]], truncate: bool = True) -> Embedded:
        """One normalised vector per token list; inputs longer than the batch are cut (or refused)."""
        cut = []
        for i, tokens in enumerate(inputs):
            if not tokens:
                raise ValueError(f"input {i} is empty")
            if len(tokens) > self.n_batch:
                if not truncate:
                    raise InputTooLong(f"input {i} has {len(tokens)} tokens, more than the {self.n_batch} an embedding "
                                       "holds; shorten it or allow truncation")
                tokens = tokens[: self.n_batch]
            cut.append(tokens)
        vectors: list[np.ndarray] = []
        decodes = 0
        start = 0
        with self._lock:
            while start < len(cut):
                end, used = start, 0
                while end < len(cut) and end - start < MAX_SEQUENCES and used + len(cut[end]) <= self.n_batch:
                    used += len(cut[end])
                    end += 1
                vectors += self._decode(cut[start:end])
                decodes += 1
                start = end
        return Embedded(vectors, sum(len(t) for t in cut), decodes)

    def _decode(self, group: list[list[int]]) -> list[np.ndarray]:
        llama_cpp.llama_memory_clear(self._memory, True)
        b = self._batch
        n = 0
        for seq, tokens in enumerate(group):
            for pos, tok in enumerate(tokens):
                b.token[n] = tok
                b.pos[n] = pos
                b.n_seq_id[n] = 1
                b.seq_id[n][0] = seq
                b.logits[n] = 1
                n += 1
        b.n_tokens = n
        run = llama_cpp.llama_encode if self._encoder else llama_cpp.llama_decode
        rc = run(self._ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama.cpp failed to embed a batch of {n} tokens (code {rc})")
        out = []
        for seq in range(len(group)):
            ptr = llama_cpp.llama_get_embeddings_seq(self._ctx, seq)
            if not ptr:
                raise RuntimeError(f"llama.cpp returned no pooled embedding for sequence {seq}")
            vec = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_embd,)).copy()
            out.append(normalise(vec))
        return out

    def close(self) -> None:
        """Free the context (the model belongs to the runner)."""
        if self._ctx:
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self._ctx)
            self._ctx = None


def normalise(vec: np.ndarray) -> np.ndarray:
    """The vector scaled to unit length (a zero vector stays zero)."""
    norm = float(np.linalg.norm(vec))
    return vec / norm if norm > 0 else vec
