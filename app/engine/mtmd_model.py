"""A model's multimodal projector through libmtmd (llama-cpp-python's llama_cpp/mtmd_cpp.py bindings).

What it does, llama-server's way (tools/server: process_mtmd_prompt, mtmd_helper_decode_image_chunk):
  tokenize  the rendered prompt with each image at the media marker: libmtmd decodes the image bytes
            (stb_image, as llama-server) and returns text chunks and image chunks; the prompt here is
            one token list where an image's positions hold placeholder ids (app.engine.media);
  encode    an image chunk through the vision tower into embeddings of the text model's width (the
            expensive part; runs off the engine thread, app.engine.media.MediaStep);
  decode    those embeddings into a sequence's KV cells at its positions, with non-causal attention
            where the projector asks for it (Gemma 3), in one llama_decode of its own.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import mtmd_cpp as mtmd

from app.engine.media import MEDIA_MARKER, MediaSpan, placeholder_tokens

_log_callback = None  # kept referenced: libmtmd holds the raw pointer
_log_lock = threading.Lock()


def _quiet_logs(verbose: bool) -> None:
    """libmtmd's and its helper's logs through the runner's llama.cpp logger (warnings and errors only)."""
    global _log_callback
    from app.engine.llama_model import _llama_log

    with _log_lock:
        if _log_callback is None and not verbose:
            _log_callback = llama_cpp.llama_log_callback(_llama_log)
            mtmd.mtmd_log_set(_log_callback, ctypes.c_void_p(0))
            mtmd.mtmd_helper_log_set(_log_callback, ctypes.c_void_p(0))


class ProjectorError(ValueError):
    """The projector cannot be loaded, or an image cannot be tokenized or encoded."""


class Projector:
    """One mmproj GGUF loaded for a text model (its output width must be the model's)."""

    def __init__(self, model, path: str, n_threads: int, use_gpu: bool = False):
        if not Path(path).is_file():
            raise FileNotFoundError(f"projector file not found: {path}")
        _quiet_logs(model.config.verbose)
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = use_gpu
        # On a CPU an encode runs beside the engine's decodes: each gets half the cores while it does
        # (share_cpu). ggml's thread pools spin at their barriers, so more threads than cores between the
        # two would stall both (measured: hearth bench vision).
        self.n_threads = n_threads
        self.encode_threads = n_threads if use_gpu else max(1, n_threads // 2)
        params.n_threads = self.encode_threads
        params.print_timings = False
        params.warmup = True
        self._marker = MEDIA_MARKER.encode()
        params.media_marker = self._marker
        self.path = path
        self._model = model
        self._ctx = mtmd.mtmd_init_from_file(path.encode(), model.llama_model, params)
        if not self._ctx:
            raise ProjectorError(f"libmtmd could not load the projector {path} for {Path(model.config.path).name} "
                                 "(not an mmproj GGUF, or its output width is not the model's)")
        self.vision = bool(mtmd.mtmd_support_vision(self._ctx))
        self.audio = bool(mtmd.mtmd_support_audio(self._ctx))
        if not (self.vision or self.audio):
            self.close()
            raise ProjectorError(f"{path} has neither a vision nor an audio encoder")
        self.n_embd = int(llama_cpp.llama_model_n_embd_inp(model.llama_model))
        self.mrope = bool(mtmd.mtmd_decode_use_mrope(self._ctx))
        self.file_bytes = Path(path).stat().st_size
        # mtmd_get_output_embd is one buffer per context: encodes are serialised.
        self._encode_lock = threading.Lock()
        self._batch_embd: np.ndarray | None = None

    def describe(self) -> dict:
        """Facts for /props and /api/show."""
        return {"path": self.path, "file_bytes": self.file_bytes, "n_embd": self.n_embd, "vision": self.vision,
                "audio": self.audio}

    # -- tokenize --------------------------------------------------------------------------------

    def tokenize(self, text: str, images: list[bytes], keys: list[str]) -> tuple[list[int], list[MediaSpan]]:
        """The prompt as tokens (BOS added, specials parsed) with each image at its marker; keys name the images.

        Raises ProjectorError when libmtmd cannot decode an image or the markers and images do not pair up."""
        bitmaps = []
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            for i, data in enumerate(images):
                buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
                bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(self._ctx, buf, len(data), False)
                if not bitmap:
                    raise ProjectorError(f"media {i + 1}: libmtmd could not decode it")
                mtmd.mtmd_bitmap_set_id(bitmap, keys[i].encode())
                bitmaps.append(bitmap)
            raw = text.encode("utf-8")
            inp = mtmd.mtmd_input_text(raw, len(raw), True, True)
            arr = (mtmd.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            rc = mtmd.mtmd_tokenize(self._ctx, chunks, ctypes.byref(inp), arr, len(bitmaps))
            if rc == 1:
                raise ProjectorError(f"the prompt has {text.count(MEDIA_MARKER)} image markers for {len(images)} images")
            if rc != 0:
                raise ProjectorError(f"libmtmd could not tokenize the prompt with its images (code {rc})")
            return self._read_chunks(chunks)
        finally:
            for bitmap in bitmaps:
                mtmd.mtmd_bitmap_free(bitmap)
            mtmd.mtmd_input_chunks_free(chunks)

    def _read_chunks(self, chunks) -> tuple[list[int], list[MediaSpan]]:
        tokens: list[int] = []
        spans: list[MediaSpan] = []
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            kind = mtmd.mtmd_input_chunk_get_type(chunk)
            if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t(0)
                ptr = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                tokens.extend(ptr[: n.value])
                continue
            if kind not in (mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE, mtmd.MTMD_INPUT_CHUNK_TYPE_AUDIO):
                raise ProjectorError("only images and audio are taken (the projector produced another kind of chunk)")
            n_tokens = int(mtmd.mtmd_input_chunk_get_n_tokens(chunk))
            n_pos = int(mtmd.mtmd_input_chunk_get_n_pos(chunk))
            if n_pos != n_tokens or self.mrope:
                raise ProjectorError("this projector places images by M-RoPE positions, which Hearth does not yet")
            key = (mtmd.mtmd_input_chunk_get_id(chunk) or b"").decode()
            owned = mtmd.mtmd_input_chunk_copy(chunk)
            spans.append(MediaSpan(start=len(tokens), n_tokens=n_tokens, key=key, handle=_Chunk(owned),
                                   non_causal=bool(mtmd.mtmd_decode_use_non_causal(self._ctx, chunk))))
            tokens.extend(placeholder_tokens(key, n_tokens))
        return tokens, spans

    # -- encode and decode -----------------------------------------------------------------------

    def encode(self, span: MediaSpan) -> np.ndarray:
        """The image's embeddings, n_tokens × n_embd float32 (runs the vision tower; thread-safe)."""
        with self._encode_lock:
            if not self._ctx:
                raise ProjectorError("the projector was closed")
            rc = mtmd.mtmd_encode_chunk(self._ctx, span.handle.ptr)
            if rc != 0:
                raise ProjectorError(f"libmtmd could not encode the image (code {rc})")
            ptr = mtmd.mtmd_get_output_embd(self._ctx)
            return np.ctypeslib.as_array(ptr, shape=(span.n_tokens * self.n_embd,)).copy()

    def decode(self, slot: int, pos: int, span: MediaSpan, embd: np.ndarray) -> int:
        """Evaluate an image's embeddings into sequence `slot` from position `pos`; llama_decode's return code.

        Engine thread only (it uses the model's context). Non-causal where the projector asks (Gemma 3
        attends across the whole image), as mtmd_helper_decode_image_chunk does; a causal span longer than the
        context's batch (30 s of audio is 750 positions) in batch-sized pieces, as that helper splits it."""
        embd = np.ascontiguousarray(embd, dtype=np.float32).reshape(span.n_tokens, self.n_embd)
        n_batch = int(llama_cpp.llama_n_batch(self._model.llama_context))
        if span.non_causal or span.n_tokens <= n_batch:
            return self._decode_piece(slot, pos, embd, span.non_causal)
        for start in range(0, span.n_tokens, n_batch):
            rc = self._decode_piece(slot, pos + start, embd[start:start + n_batch], False)
            if rc != 0:
                return rc
        return 0

    def _decode_piece(self, slot: int, pos: int, embd: np.ndarray, non_causal: bool) -> int:
        n = len(embd)
        batch = llama_cpp.llama_batch()
        embd = np.ascontiguousarray(embd)
        positions = np.arange(pos, pos + n, dtype=np.int32)
        n_seq = np.ones(n, dtype=np.int32)
        seq = np.full(n, slot, dtype=np.int32)
        seq_ptrs = (ctypes.POINTER(ctypes.c_int32) * n)(
            *[ctypes.cast(seq.ctypes.data + 4 * i, ctypes.POINTER(ctypes.c_int32)) for i in range(n)])
        logits = np.zeros(n, dtype=np.int8)
        batch.n_tokens = n
        batch.token = None
        batch.embd = embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        batch.pos = positions.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_pos))
        batch.n_seq_id = n_seq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        batch.seq_id = seq_ptrs
        batch.logits = logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        ctx = self._model.llama_context
        if non_causal:
            llama_cpp.llama_set_causal_attn(ctx, False)
        try:
            return int(llama_cpp.llama_decode(ctx, batch))
        finally:
            if non_causal:
                llama_cpp.llama_set_causal_attn(ctx, True)

    def share_cpu(self, encoding: bool) -> None:
        """While an encode runs (CPU), the model's decodes take the cores the encode leaves; all of them after."""
        n = max(1, self.n_threads - self.encode_threads) if encoding and self.encode_threads < self.n_threads \
            else self.n_threads
        llama_cpp.llama_set_n_threads(self._model.llama_context, n, n)

    def close(self) -> None:
        """Free the libmtmd context."""
        with self._encode_lock:
            if self._ctx:
                mtmd.mtmd_free(self._ctx)
                self._ctx = None


class _Chunk:
    """An owned mtmd_input_chunk: freed when the span that holds it is collected."""

    def __init__(self, ptr):
        self.ptr = ptr

    def __del__(self):
        if self.ptr:
            mtmd.mtmd_input_chunk_free(self.ptr)
            self.ptr = None
