"""The embedding context on the real Gemma 3 270M GGUF: pooling, normalisation, batching many inputs per decode."""

import numpy as np
import pytest

from app.engine.embeddings import MAX_SEQUENCES, EmbeddingContext, InputTooLong
from app.engine.llama_model import LlamaModel
from app.engine.model_config import ModelConfig

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def model(gemma_path):
    m = LlamaModel(ModelConfig(path=str(gemma_path), n_ctx=512, n_seq_max=2, n_batch=128, n_threads=2))
    yield m
    m.close()


@pytest.fixture(scope="module")
def embedder(model):
    e = EmbeddingContext(model, n_threads=2)
    yield e
    e.close()


def tokens(model, text):
    return model.tokenize(text, add_special=True, parse_special=False)


def test_a_generative_model_is_mean_pooled_into_unit_vectors(model, embedder):
    assert embedder.pooling == "mean" and embedder.n_embd == 640
    # Gemma's 262k vocabulary: every token's logits cost 1 MiB, so the batch is capped at 256 tokens.
    assert embedder.n_batch == 256
    out = embedder.embed([tokens(model, "The cat sat on the mat.")])
    assert len(out.vectors) == 1 and out.vectors[0].shape == (640,)
    assert np.linalg.norm(out.vectors[0]) == pytest.approx(1.0, abs=1e-5)


def test_batched_inputs_get_the_vectors_they_get_alone(model, embedder):
    texts = ["The cat sat on the mat.", "Quarterly revenue grew by four percent.", "Le chat est sur le tapis."]
    together = embedder.embed([tokens(model, t) for t in texts])
    assert together.num_decodes == 1
    for text, vec in zip(texts, together.vectors):
        alone = embedder.embed([tokens(model, text)]).vectors[0]
        assert float(vec @ alone) > 0.999  # batch sizes change the float sums a little
    cat, revenue, chat = together.vectors
    assert float(cat @ revenue) < 0.99 and float(cat @ chat) < 0.99  # sequences do not leak into each other


def test_many_short_inputs_share_few_decodes(model, embedder):
    inputs = [tokens(model, f"item number {i}") for i in range(MAX_SEQUENCES + 6)]
    out = embedder.embed(inputs)
    assert len(out.vectors) == len(inputs) and out.num_tokens == sum(map(len, inputs)) <= 2 * embedder.n_batch
    # At most 64 sequences and 256 tokens a decode: 70 inputs of a few tokens take 2 decodes, not 70.
    assert out.num_decodes == 2


def test_long_inputs_are_cut_or_refused(model, embedder):
    long = tokens(model, "word " * 400)
    assert len(long) > embedder.n_batch
    cut = embedder.embed([long]).vectors[0]
    assert float(cut @ embedder.embed([long[: embedder.n_batch]]).vectors[0]) > 0.9999
    with pytest.raises(InputTooLong, match="shorten it"):
        embedder.embed([long], truncate=False)
