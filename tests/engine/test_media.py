"""Images in the engine (app.engine.media): evaluated once at their place, encoded while others decode,
reused from the prefix cache by their hash, a failure confined to its request. Fake model, fake projector."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from fake_model import FakeModel
from test_engine_fake import collect, greedy, only_cache_left

from app.engine.engine import DECODE_NO_KV_SLOT, DECODE_OK, Engine
from app.engine.media import MediaPrompt, MediaSpan, MediaStep, image_key, placeholder_tokens
from tests.helpers import wait_until

N_IMAGE = 6
TIMEOUT_S = 10.0


class FakeProjector:
    """Encodes to zeros (optionally held until released) and decodes into the fake model's cells."""

    def __init__(self, model: FakeModel, fail: bool = False):
        self.model = model
        self.fail = fail
        self.encoded: list[str] = []
        self.decoded: list[tuple[int, int, str]] = []  # (slot, position, key)
        self.sharing: list[bool] = []  # share_cpu calls, in order
        self.encode_started = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def encode(self, span: MediaSpan):
        self.encode_started.set()
        assert self.release.wait(TIMEOUT_S)
        if self.fail:
            raise RuntimeError("the tower fell over")
        self.encoded.append(span.key)
        return np.zeros((span.n_tokens, 4), dtype=np.float32)

    def share_cpu(self, encoding: bool) -> None:
        self.sharing.append(encoding)

    def decode(self, slot: int, pos: int, span: MediaSpan, embd) -> int:
        m = self.model
        cells = m.seqs.setdefault(slot, [])
        if pos != len(cells):
            m.violations.append(f"image decode at {pos} into slot {slot} holding {len(cells)} cells")
        if m.kv_used + span.n_tokens > m.kv_capacity:
            return DECODE_NO_KV_SLOT
        for t in placeholder_tokens(span.key, span.n_tokens):
            m.cell_tokens[m._next_cell] = t
            m.refs[m._next_cell] = 1
            cells.append(m._next_cell)
            m._next_cell += 1
        self.decoded.append((slot, pos, span.key))
        return DECODE_OK


@pytest.fixture
def make_engine():
    """An engine on a fake model with a fake projector; stopped after the test."""
    engines: list[Engine] = []

    def factory(model: FakeModel, projector: FakeProjector | None = None) -> tuple[Engine, FakeProjector]:
        projector = projector or FakeProjector(model)
        engine = Engine(model, clock=model.clock, media=MediaStep(projector, max_batch_tokens=model.n_batch))
        engines.append(engine)
        return engine, projector

    yield factory
    for engine in engines:
        engine.stop()


def image_prompt(image: bytes, before: list[int], after: list[int]) -> tuple[list[int], MediaPrompt]:
    """Tokens with one image between `before` and `after`, and its MediaPrompt."""
    key = image_key(image)
    span = MediaSpan(start=len(before), n_tokens=N_IMAGE, key=key, non_causal=True)
    return before + placeholder_tokens(key, N_IMAGE) + after, MediaPrompt([span])


def test_an_image_is_evaluated_once_at_its_place_and_never_enters_a_token_batch():
    model = FakeModel()
    with_engine = Engine(model, clock=model.clock, media=MediaStep(projector := FakeProjector(model), 64))
    try:
        tokens, media = image_prompt(b"cat", [1, 50, 51], [52, 53])
        r = with_engine.submit(tokens, greedy(3, ignore_eos=True), media=media)
        with_engine.start()
        _, fin = collect(r)
    finally:
        with_engine.stop()
    assert fin.error is None and fin.finish_reason == "length"
    assert projector.encoded == [image_key(b"cat")]
    assert projector.decoded == [(0, 3, image_key(b"cat"))]
    assert all(t >= 0 for batch in model.batches for e in batch for t in e.tokens)
    starts = [(e.start_pos, len(e.tokens)) for batch in model.batches for e in batch]
    assert starts[:2] == [(0, 3), (3 + N_IMAGE, 2)]  # text up to the image, then the text after it
    assert fin.stats.num_prompt_tokens == len(tokens)
    # The request's stats carry its images and the encode time MediaStep measured around the projector.
    assert fin.stats.num_images == 1
    assert fin.stats.image_encode_ms == media.spans[0].encode_ms > 0
    assert model.violations == []
    assert only_cache_left(with_engine, model)


def test_other_sequences_keep_decoding_while_an_image_encodes(make_engine):
    # Room for the talker's 400 tokens beside the looker: a full cache would preempt the looker mid-encode (and its
    # encode would stop counting, so the cores would go back to the decodes), which is not what this test is about.
    model = FakeModel(n_ctx=1024)
    engine, projector = make_engine(model)
    projector.release.clear()
    talker = engine.submit([1, 60, 61, 62], greedy(400, ignore_eos=True))
    tokens, media = image_prompt(b"dog", [1, 70], [71])
    looker = engine.submit(tokens, greedy(2, ignore_eos=True), media=media)
    engine.start()
    assert projector.encode_started.wait(TIMEOUT_S)
    # While the encode is held, the other sequence goes on producing tokens.
    seen = 0
    while seen < 20:
        talker.events.get(timeout=TIMEOUT_S)
        seen += 1
    assert looker.num_computed <= media.spans[0].start and not projector.decoded
    assert projector.sharing == [True]  # the decodes left the encode its share of the cores
    projector.release.set()
    _, fin = collect(looker)
    assert fin.error is None and len(looker.output_tokens) == 2
    engine.cancel(talker)
    collect(talker)
    assert projector.sharing == [True, False]
    assert model.violations == []


def test_the_same_image_again_reuses_its_cells_and_a_different_one_does_not(make_engine):
    model = FakeModel()
    engine, projector = make_engine(model)
    engine.start()
    # Longer than the prefix cache's shortest match (16 tokens).
    system = [1] + list(range(100, 120))
    first_tokens, first = image_prompt(b"garage", system, [82, 83, 84])
    _, fin = collect(engine.submit(first_tokens, greedy(2, ignore_eos=True), media=first))
    assert fin.error is None
    # A follow-up turn: the same image at the same place, then more text.
    again_tokens, again = image_prompt(b"garage", system, [82, 83, 84, 90, 91, 92])
    _, fin = collect(engine.submit(again_tokens, greedy(2, ignore_eos=True), media=again))
    assert fin.error is None
    assert projector.encoded == [image_key(b"garage")] and len(projector.decoded) == 1
    assert fin.stats.num_cached_tokens >= again.spans[0].end
    # Reused, not encoded: the image is counted and took no encode time.
    assert fin.stats.num_images == 1 and fin.stats.image_encode_ms == 0.0
    other_tokens, other = image_prompt(b"door", system, [82, 83, 84])
    _, fin = collect(engine.submit(other_tokens, greedy(2, ignore_eos=True), media=other))
    assert fin.error is None
    assert projector.encoded == [image_key(b"garage"), image_key(b"door")]
    assert fin.stats.num_cached_tokens <= other.spans[0].start
    assert model.violations == []


def test_an_image_that_fails_to_encode_fails_only_its_request(make_engine):
    model = FakeModel()
    engine, projector = make_engine(model, None)
    projector.fail = True
    engine.start()
    tokens, media = image_prompt(b"broken", [1, 90], [91])
    bad = engine.submit(tokens, greedy(2, ignore_eos=True), media=media)
    good = engine.submit([1, 92, 93], greedy(3, ignore_eos=True))
    _, fin_bad = collect(bad)
    _, fin_good = collect(good)
    assert fin_bad.finish_reason == "error" and "could not be encoded" in fin_bad.error
    assert fin_good.error is None and len(good.output_tokens) == 3
    assert model.violations == []


def test_an_engine_without_a_projector_refuses_images():
    engine = Engine(FakeModel())
    tokens, media = image_prompt(b"x", [1], [2])
    with pytest.raises(ValueError, match="no projector"):
        engine.submit(tokens, greedy(1), media=media)


def test_text_runs_stop_at_the_next_image():
    spans = [MediaSpan(start=3, n_tokens=4, key="a"), MediaSpan(start=9, n_tokens=2, key="b")]
    media = MediaPrompt(spans)
    assert media.text_run(0, 20) == 3
    assert media.text_run(3, 17) == 0  # at the image: the engine evaluates it
    assert media.text_run(7, 13) == 2
    assert media.text_run(11, 9) == 9
    assert media.span_at(5) is spans[0] and media.span_at(8) is None


def test_placeholders_differ_per_image_and_offset_and_are_no_token_ids():
    a, b = placeholder_tokens(image_key(b"a"), 8), placeholder_tokens(image_key(b"b"), 8)
    assert len(set(a)) == 8 and not set(a) & set(b)
    assert all(-(2**31) <= t < 0 for t in a + b)  # never a vocabulary id, always an int32
    assert placeholder_tokens(image_key(b"a"), 8) == a


def test_a_less_urgent_prompt_waits_while_a_more_urgent_ones_media_is_in_its_prompt(make_engine):
    """A voice request's audio encodes on the cores a background prefill would take: the background prompt is not
    prefilled until the voice prompt (encode, embeddings, text after them) is done; a decoding stream goes on."""
    model = FakeModel(n_ctx=8192)  # room for all three at once, and for a long talker
    engine, projector = make_engine(model)
    projector.release.clear()
    talker = engine.submit([1, 60, 61, 62], greedy(8000, ignore_eos=True), priority=2)
    tokens, media = image_prompt(b"voice", [1, 70], [71])
    voice = engine.submit(tokens, greedy(2, ignore_eos=True), media=media, priority=0)
    engine.start()
    assert projector.encode_started.wait(TIMEOUT_S)
    background = engine.submit(list(range(100, 140)), greedy(2, ignore_eos=True), priority=4)
    wait_until(lambda: background.admitted_s is not None, TIMEOUT_S, "the background request admitted")
    decoded = len(talker.output_tokens)
    # The engine iterates on (the talker decodes) while the encode is held; the background prompt waits.
    wait_until(lambda: len(talker.output_tokens) >= decoded + 20, TIMEOUT_S, "the talker decoding on")
    assert background.num_computed == 0 and engine.scheduler.media_prompt_priority == 0
    projector.release.set()
    _, fin = collect(voice)
    _, bg_fin = collect(background)
    assert fin.error is None and bg_fin.error is None
    assert voice.first_token_s <= background.first_token_s
    engine.cancel(talker)
    collect(talker)
    assert engine.scheduler.media_prompt_priority is None
    assert model.violations == []
