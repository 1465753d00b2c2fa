"""The model and engine behind a runner's routes: loaded in the background so /health answers at once.

The model comes from a backend factory (ModelConfig -> model): llama.cpp's LlamaModel in a real
runner, a fake model in tests, which then drive every route without a GGUF.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.engine import formats
from app.engine import tools as toolfmt
from app.engine.chat import ChatTemplate, fallback_template, template_for
from app.engine.engine import Engine
from app.engine.grammar import Grammar, client_grammar
from app.engine.kv_tiers import MIB, DiskTier, cache_ram_bytes, tier_key
from app.engine.model_config import ModelConfig
from app.engine.named_template import NamedTemplate, is_template_name
from app.protocols.openai import ApiError
from app.runner.config import RunnerConfig

log = logging.getLogger(__name__)

# The texts that open a call in the families' formats (where one is a special token, a lazy grammar triggers on it).
CALL_OPENERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<|tool_call|>", "<｜tool▁calls▁begin｜>",
                "<|START_ACTION|>")

# Makes the model a runner serves from its settings.
Backend = Callable[[ModelConfig], Any]
# Makes a loaded model's projector from the mmproj path (None: the model takes no images).
ProjectorBackend = Callable[[Any, RunnerConfig], Any]


def mtmd_projector(model, config: RunnerConfig):
    """The real projector: libmtmd on the loaded llama.cpp model (imported only when a runner has --mmproj)."""
    from app.engine.mtmd_model import Projector

    return Projector(model, config.mmproj, config.model.n_threads, use_gpu=config.model.n_gpu_layers > 0)


def llama_backend(config: ModelConfig):
    """The real model: llama.cpp through llama-cpp-python (imported only when a runner loads one)."""
    from app.engine.llama_model import LlamaModel

    return LlamaModel(config)


class RunnerState:
    """The model, its chat template and tool format, and the engine; loads in the background."""

    def __init__(self, config: RunnerConfig, backend: Backend = llama_backend,
                 projector_backend: ProjectorBackend = mtmd_projector):
        self.config = config
        self.backend = backend
        self.projector_backend = projector_backend
        # The model's projector (app.engine.mtmd_model.Projector) when the runner has --mmproj, else None.
        self.projector = None
        self.status = "loading"
        self.error: str | None = None
        self.model = None
        self.engine: Engine | None = None
        # The draft model (app.engine.draft_model.DraftModel) of --spec-type draft-simple, else None.
        self.draft = None
        self.metrics = None
        self.template: ChatTemplate | None = None
        # The answer format detected from the template (C1), and what the engine needs of it: the special
        # tokens the parser must see rendered, the thought's markers as tokens (empty: the model does not think).
        self.chat_format: formats.ChatFormat = formats.detect(None)
        self.tool_format = toolfmt.GENERIC  # the prompt side's name: GENERIC unless the template takes tools
        self.special_ids: frozenset[int] = frozenset()
        self.think_tokens: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        self.budget_message_tokens: tuple[int, ...] = ()
        # The call markers that are one special token here: a lazy call grammar engages at them (their text
        # never shows in what the sampler watches).
        self.trigger_tokens: tuple[int, ...] = ()
        self.default_grammar: Grammar | None = None
        self.load_s: float | None = None
        # The load's phases in ms (/health and /props' load_timings): the model's read_ms, upload_ms (None
        # without GPU layers) and context_ms, engine_ms for the rest (template, projector, engine), and once
        # the first request after the load finished, its KV restore (restore_ms, kv_source) and first_prefill_ms.
        self.load_timings: dict[str, Any] = {}
        self._first_seen = False
        self._first_lock = threading.Lock()
        self._embedder = None
        self._embedder_lock = threading.Lock()

    def embedder(self):
        """The embedding context on the loaded model, made on first use (a runner that never embeds never pays for it)."""
        with self._embedder_lock:
            if self._embedder is None:
                from app.engine.embeddings import EmbeddingContext

                self._embedder = EmbeddingContext(self.model, self.config.model.n_threads, pooling=self.config.pooling)
            return self._embedder

    def load(self) -> None:
        """Load the model, create the engine and start its thread; records any failure for /health."""
        from app.runner.metrics import RunnerMetrics

        t0 = time.monotonic()
        cfg = self.config
        try:
            self.model = self.backend(cfg.model)
            self._read_template()
            self._read_format()
            media = None
            if cfg.mmproj:
                from app.engine.media import MediaStep

                self.projector = self.projector_backend(self.model, cfg)
                media = MediaStep(self.projector, cfg.model.n_ubatch or min(cfg.model.n_batch, 512))
            if cfg.draft_model is not None and cfg.spec.uses_draft_model:
                self.draft = self._load_draft()
            self.engine = Engine(
                self.model, mode=cfg.mode, token_budget=cfg.token_budget, max_waiting=cfg.max_waiting,
                prefix_cache=cfg.prefix_cache, spec=cfg.spec, cache_ram_bytes=cache_ram_bytes(cfg.cache_ram_mib),
                cache_disk=self._disk_tier(), media=media, draft_model=self.draft,
            ).start()
            self.metrics = RunnerMetrics(self.engine)
            self.load_s = time.monotonic() - t0
            self.load_timings = load_phases(getattr(self.model, "load_timings", None), self.load_s * 1000)
            self.status = "ok"
            log.info("model %s loaded in %.2f s", cfg.model.path, self.load_s)
        except Exception as exc:
            log.exception("loading %s failed", cfg.model.path)
            self.error = str(exc)
            self.status = "error"

    def _load_draft(self):
        """The draft model, refused unless its vocabulary is the target's (llama.cpp's compatibility check)."""
        from app.engine.draft_model import DraftModel, vocab_mismatch

        cfg = self.config
        path = cfg.draft_model.path
        draft = self.backend(cfg.draft_model)
        problem = vocab_mismatch(self.model, draft)
        if problem is not None:
            draft.close()
            raise ValueError(f"the draft model {path} cannot draft for {cfg.model.path}: {problem} (a draft model "
                             "must have the target's vocabulary)")
        target_facts, facts = self.model.describe(), draft.describe()
        size_ratio = facts["size_bytes"] / max(target_facts["size_bytes"], 1)
        info = {"path": path, "name": Path(path).name, "desc": facts.get("desc"), "n_params": facts.get("n_params"),
                "size_bytes": facts.get("size_bytes"), "n_gpu_layers": cfg.draft_model.n_gpu_layers,
                "n_ctx": facts.get("n_ctx"), "n_seq_max": facts.get("n_seq_max")}
        log.info("draft model %s loaded for %s (%.0f%% of its size)", path, cfg.model.path, 100 * size_ratio)
        return DraftModel(draft, p_min=cfg.spec.p_min, size_ratio=size_ratio, info=info)

    def note_finished(self, fin) -> None:
        """A request finished: the first one after the load adds its KV restore and prefill to the load's timings."""
        stats = fin.stats
        with self._first_lock:
            if self._first_seen or self.engine is None:
                return
            self._first_seen = True
        tiers = self.engine.tiers
        c = tiers.counters if tiers is not None else None
        restore_ms = c.restore_seconds_total * 1000 if c is not None else 0.0
        if c is None or not c.restored_tokens_total:
            kv_source = "none"
        else:
            kv_source = "disk" if c.disk_restored_tokens_total else "ram"
        # Restoring happens at admission, between the request's scheduling and its first token.
        until_ms = stats.ttft_ms if stats.ttft_ms is not None else stats.total_ms
        self.load_timings = {**self.load_timings, "restore_ms": restore_ms, "kv_source": kv_source,
                             "restored_tokens": c.restored_tokens_total if c is not None else 0,
                             "first_prefill_ms": max(0.0, until_ms - stats.queue_ms - restore_ms),
                             "first_prompt_tokens": stats.num_prompt_tokens,
                             "first_cached_tokens": stats.num_cached_tokens}

    def _disk_tier(self) -> DiskTier | None:
        """The disk tier for this model, template and KV settings (--cache-disk), or None."""
        cfg = self.config
        settings = getattr(self.model, "kv_settings", None)
        if not cfg.cache_disk or settings is None or not cfg.prefix_cache:
            return None
        key = tier_key(cfg.model.path, self.template.source or "", settings())
        mib = cfg.cache_disk_mib
        return DiskTier(cfg.cache_disk, key, None if mib == -1 else mib * MIB, max_age_s=cfg.cache_disk_max_age_s)

    def shutdown(self) -> None:
        """Stop the engine (the disk tier writes what it lacks first); the worker is exiting."""
        if self.engine is not None:
            self.engine.stop()
            if self.engine.tiers is not None and self.engine.tiers.disk is not None:
                self.engine.tiers.disk.close()

    def _read_template(self) -> None:
        """The chat template: --chat-template, else the GGUF's own, else a built-in one for its architecture, else ChatML."""
        m, chosen = self.model, self.config.chat_template
        # Read through llama.cpp, which has the metadata loaded already.
        bos, eos = m.token_text(m.bos_token), m.token_text(m.eos_token)
        if chosen and is_template_name(chosen):
            self.template = NamedTemplate(chosen, bos, eos)
        elif chosen:
            self.template = ChatTemplate(chosen, bos, eos, origin="command line")
        else:
            self.template = template_for(m.chat_template(), m.architecture, bos, eos) or fallback_template(bos, eos)

    def _read_format(self) -> None:
        """The template's answer format and its markers as this vocabulary's tokens; the default grammar, checked."""
        m, cfg = self.model, self.config
        fmt = self.chat_format = formats.detect(self.template.source)
        self.tool_format = fmt.name if fmt.tools else toolfmt.GENERIC
        self.special_ids = frozenset(t for text in {*fmt.preserved, fmt.think_start, fmt.think_end} if text
                                     for t in self._special_token(text))
        self.trigger_tokens = tuple(t for text in CALL_OPENERS if text in fmt.preserved
                                    for t in self._special_token(text))
        if fmt.reasoning and fmt.think_start and fmt.think_end:
            self.think_tokens = (self._marker(fmt.think_start), self._marker(fmt.think_end))
        if cfg.reasoning_budget_message:
            self.budget_message_tokens = self._marker(cfg.reasoning_budget_message)
        if cfg.grammar:
            self.default_grammar = client_grammar(cfg.grammar)
            if hasattr(m, "grammar_sampler"):  # parsed by llama.cpp once now, not refused on every request
                m.free_sampler(m.grammar_sampler(self.default_grammar))

    def _marker(self, text: str) -> tuple[int, ...]:
        return tuple(self.model.tokenize(text, add_special=False, parse_special=True))

    def _special_token(self, text: str) -> tuple[int, ...]:
        """The one special token a marker text stands for in this vocabulary (none when it is plain text there)."""
        ids = self._marker(text)
        if len(ids) != 1 or self.model.token_bytes(ids[0]) == text.encode():
            return ()
        return ids

    def start_loading(self) -> threading.Thread:
        """Load in a background thread."""
        t = threading.Thread(target=self.load, name="hearth-load", daemon=True)
        t.start()
        return t

    def ready(self) -> Engine:
        """The engine once the model is loaded; llama-server's 503 while it loads, a 500 when loading failed."""
        if self.status == "loading":
            raise ApiError(503, "the model is still loading; retry shortly", code="loading",
                           err_type="unavailable_error", headers={"Retry-After": "1"})
        if self.status == "error":
            raise ApiError(500, f"the model failed to load: {self.error}", code="load_failed", err_type="server_error")
        assert self.engine is not None
        return self.engine


def load_phases(model_timings: dict | None, load_ms: float) -> dict[str, Any]:
    """The runner's load split: the model's own phases (a fake model has none: all of it is engine_ms) and the rest."""
    t = dict(model_timings or {})
    read, upload, context = t.get("read_ms"), t.get("upload_ms"), t.get("context_ms")
    known = sum(v for v in (read, upload, context) if v is not None)
    return {"read_ms": read, "upload_ms": upload, "context_ms": context,
            "engine_ms": max(0.0, load_ms - known), "load_ms": load_ms}
