"""Embeddings: a second llama.cpp context on the runner's loaded model, with embeddings on.

Sharing the model means no second copy of the weights; the context is made on the first request,
so a runner that never embeds never pays for it. Pooling is the GGUF's own (`<arch>.pooling_type`:
mean, cls or last); a model without one (a generative model such as Gemma) is mean-pooled. Many
inputs go into one llama_decode, one sequence each, as many as fit the context's batch; vectors
are L2-normalised, as OpenAI's and Ollama's are. A runner in reranking mode makes one with rank
pooling, whose output is a relevance score instead of a vector (`rerank_tokens` lays out the
query and document as llama-server does). This module and app.engine.llama_model are the
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


POOLING_TYPES = {name: kind for kind, name in POOLING_NAMES.items()}


class EmbeddingContext:
    """Embeds token lists with the model's pooling (or the one asked for); thread-safe (one decode at a time).

    With rank pooling (a reranker) each vector is the classifier's output, n_cls_out scores, not
    normalised; its first value is the relevance score, as llama-server reads it.
    """

    def __init__(self, model, n_threads: int, max_batch_tokens: int | None = None, pooling: str | None = None):
        self._model = model
        handle = model.llama_model
        n_vocab = model.n_vocab
        fit = max(MIN_BATCH_TOKENS, min(MAX_BATCH_TOKENS, MAX_LOGITS_BYTES // max(1, n_vocab * 4)))
        n_batch = max_batch_tokens or fit
        if pooling is not None and pooling not in POOLING_TYPES:
            # "none" (one vector per token) included: this context returns one vector per input.
            raise ValueError(f"pooling {pooling!r} is not supported; use one of {', '.join(POOLING_TYPES)}")
        asked = POOLING_TYPES[pooling] if pooling else llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED
        self._ctx = self._context(handle, n_batch, n_threads, asked)
        pooling = llama_cpp.llama_pooling_type(self._ctx)
        if pooling == llama_cpp.LLAMA_POOLING_TYPE_NONE:
            # No pooling in the GGUF (a generative model): per-token vectors are of no use to a
            # client that wants one vector per input, so mean-pool them.
            llama_cpp.llama_free(self._ctx)
            self._ctx = self._context(handle, n_batch, n_threads, llama_cpp.LLAMA_POOLING_TYPE_MEAN)
            pooling = llama_cpp.LLAMA_POOLING_TYPE_MEAN
        self.pooling = POOLING_NAMES.get(pooling, str(pooling))
        self.n_batch = llama_cpp.llama_n_batch(self._ctx)
        self.rank = pooling == llama_cpp.LLAMA_POOLING_TYPE_RANK
        self.n_embd = llama_cpp.llama_model_n_cls_out(handle) if self.rank else llama_cpp.llama_model_n_embd_out(handle)
        # llama.cpp reads a sequence's scores at row n_cls_out × its index, which is right for a
        # classifier head only; a model without one (a generative model in reranking mode) would
        # get another sequence's values: with one sequence per decode every model scores alike.
        self._max_sequences = 1 if self.rank else MAX_SEQUENCES
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
                while end < len(cut) and end - start < self._max_sequences and used + len(cut[end]) <= self.n_batch:
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
            out.append(vec if self.rank else normalise(vec))
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


def rerank_tokens(model, query: str, document: str) -> list[int]:
    """The tokens a reranker scores for (query, document), laid out as llama-server lays them out."""
    handle = model.llama_model
    template = llama_cpp.llama_model_chat_template(handle, b"rerank")
    if template:
        # The model's own rerank prompt (Qwen3-style rerankers ship one in the GGUF).
        text = template.decode("utf-8", "replace").replace("{query}", query).replace("{document}", document)
        return model.tokenize(text, add_special=False, parse_special=True)
    vocab = llama_cpp.llama_model_get_vocab(handle)
    eos = llama_cpp.llama_vocab_eos(vocab)
    if eos == llama_cpp.LLAMA_TOKEN_NULL:
        eos = llama_cpp.llama_vocab_sep(vocab)
    add_eos = llama_cpp.llama_vocab_get_add_eos(vocab)
    tokens = [llama_cpp.llama_vocab_bos(vocab)] if llama_cpp.llama_vocab_get_add_bos(vocab) else []
    tokens += model.tokenize(query, add_special=False, parse_special=False)
    if add_eos:
        tokens.append(eos)
    if llama_cpp.llama_vocab_get_add_sep(vocab):
        tokens.append(llama_cpp.llama_vocab_sep(vocab))
    tokens += model.tokenize(document, add_special=False, parse_special=False)
    if add_eos:
        tokens.append(eos)
    return tokens
